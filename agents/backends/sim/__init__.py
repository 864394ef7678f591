"""The ``sim`` execution backend: a simulated GPU host running RL workers (docs/sim-backend.md).

- ``backend.py``: ``SimBackend``, the ``ExecutionBackend``: wall time onto virtual time, the lock,
  step dispatch, injected faults;
- ``host.py``: ``SimHost``, one host's devices, workers and jobs in virtual time (deterministic,
  no threads), on the core simulator's engines and stages (``scheduler/core/sim``);
- ``state.py``: the records the host keeps (devices, workers, episodes, jobs, the control plane's
  view of a job);
- ``steps.py``: the migration steps on a host;
- ``telemetry.py``: worker samples, device readings and the heartbeat's progress report;
- ``model.py``: ``JobModel``, a job's workload, model and costs from its spec;
- ``faults.py``: fault specifications; ``traces.py``: which trace files a job may make it read.

None of it imports Django: agents run on GPU hosts with a slim install.
"""
