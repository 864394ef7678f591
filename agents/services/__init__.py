"""The agent protocol's business logic, one module per responsibility; callers import from the
module itself (nothing is re-exported here):

- ``payloads``: request-body checks shared by the parsers;
- ``command_states``: the agent command's state machine;
- ``liveness``: nodes lost for silence, and restored when they come back;
- ``delivery``: handing commands to nodes, long-polls and their Redis wake-ups;
- ``registration``: registering a node and its devices, what its agent should be running;
- ``heartbeat``: a node's heartbeat (liveness and telemetry);
- ``progress``: the job-progress picture the heartbeat carries both ways;
- ``reports``: agents' outcomes of commands and migration steps.

Every state change runs in one transaction with its AuditEvent (agents act as
``Actor.for_agent(node.name)``; the liveness check as ``Actor.system("liveness")``).
"""
