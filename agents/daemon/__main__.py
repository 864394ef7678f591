"""``python -m agents.daemon`` / ``dynarl-agent``: run the node agent until SIGTERM or SIGINT."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from agents.daemon.config import ConfigError, configure_logging, parse_config
from agents.daemon.loop import EXIT_CONFIG, run_agent


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"dynarl-agent: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(config.log_level)
    return run_agent(config)


if __name__ == "__main__":
    sys.exit(main())
