"""The agent command's state machine, shared by delivery, reports and re-registration.

Commands move through ``COMMAND_TRANSITIONS``; a report for a finished command changes nothing and
answers with the recorded outcome.
"""

from __future__ import annotations

from cluster.models import AgentCommand, CommandState
from common.transitions import check_transition

COMMAND_TRANSITIONS: dict[str, frozenset[str]] = {
    CommandState.QUEUED: frozenset(
        {CommandState.DELIVERED, CommandState.DONE, CommandState.FAILED, CommandState.CANCELLED}
    ),
    # DELIVERED -> DELIVERED is a re-delivery; -> QUEUED when the node's agent registers again.
    CommandState.DELIVERED: frozenset(
        {
            CommandState.DELIVERED,
            CommandState.QUEUED,
            CommandState.DONE,
            CommandState.FAILED,
            CommandState.CANCELLED,
        }
    ),
    CommandState.DONE: frozenset(),
    CommandState.FAILED: frozenset(),
    CommandState.CANCELLED: frozenset(),
}
FINISHED_COMMAND_STATES = frozenset({CommandState.DONE, CommandState.FAILED, CommandState.CANCELLED})


def check_command(command: AgentCommand, target: str) -> None:
    check_transition("agent command", COMMAND_TRANSITIONS, command.state, target)
