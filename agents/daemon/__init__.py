"""The node agent daemon: runs on a GPU host, speaks the agent protocol (version 1, HTTP + JSON) to
the control plane and carries its commands out through an execution backend.

It imports nothing from Django or the control plane's apps (GPU hosts get a slim install): only the
standard library, ``agents.backends.*`` and, through a backend, ``scheduler.core.*``.

``python -m agents.daemon`` or the ``dynarl-agent`` console script runs it; docs/agent-daemon.md
describes its flags, its state directory and its behaviour on restart, outage and SIGTERM.
"""
