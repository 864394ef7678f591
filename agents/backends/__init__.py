"""Execution backends of the node agent: ``sim`` (simulated GPU hosts) and ``ray`` (real workers)."""
