"""One process of node agents for the benchmarks: a real agent daemon (``sim`` backend) per host,
on threads, until SIGTERM; then what their heartbeats saw goes to a stats file.

    python -m bench.agent_host --url URL --token-file F --state-root DIR --stats-file F --hosts a,b

``bench.stack.AgentFleet`` starts these. No Django here: this is the agents' side.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.daemon.client import ControlPlaneClient
from agents.daemon.config import AgentConfig, configure_logging
from agents.daemon.loop import Agent

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"


def run_agent_host(
    hosts: list[str],
    url: str,
    token_file: Path,
    state_root: Path,
    options: dict[str, Any],
    stats_file: Path,
    trace_dir: Path | None = None,
) -> int:
    """Run one real agent daemon per host on threads until SIGTERM; then write what the
    heartbeats saw (sent at, latency, samples accepted) to ``stats_file``."""
    configure_logging("WARNING")
    beats: list[tuple[float, float, int, int]] = []
    failures: list[tuple[float, str]] = []
    lock = threading.Lock()

    class TimedClient(ControlPlaneClient):
        """The daemon's client, timing each heartbeat it sends."""

        def request(self, method: str, path: str, **kwargs: Any) -> Any:
            if path != HEARTBEAT_PATH:
                return super().request(method, path, **kwargs)
            sent, began = time.time(), time.perf_counter()
            try:
                reply = super().request(method, path, **kwargs)
            except Exception as exc:
                with lock:
                    failures.append((sent, type(exc).__name__))
                raise
            latency_ms = (time.perf_counter() - began) * 1000
            with lock:
                beats.append(
                    (
                        sent,
                        latency_ms,
                        int(reply.get("accepted_devices", 0)),
                        int(reply.get("accepted_samples", 0)),
                    )
                )
            return reply

    class HostedAgent(Agent):
        """An agent among many in this process: the process's signal handler stops them all."""

        def __init__(self, config: AgentConfig) -> None:
            super().__init__(config)
            self.client = TimedClient(config.url, user_agent=self.client.user_agent)

        def install_signal_handlers(self) -> None:
            pass

    bootstrap = token_file.read_text().strip()
    agents = [
        HostedAgent(
            AgentConfig(
                url=url,
                bootstrap_token=bootstrap,
                backend="sim",
                host=host,
                state_dir=state_root / host,
                backend_options=options,
                nvml=False,
                log_level="WARNING",
                shutdown_grace_s=5.0,
                trace_dir=trace_dir,
            )
        )
        for host in hosts
    ]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threads = [threading.Thread(target=agent.run, name=agent.config.host, daemon=True) for agent in agents]
    for thread in threads:
        thread.start()
        time.sleep(0.02)  # not all registrations in the same instant
    stop.wait()
    for agent in agents:
        agent.stopping.set()
    for thread in threads:
        thread.join(30)
    with lock:
        stats_file.write_text(json.dumps({"beats": beats, "failures": failures}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agent_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--state-root", type=Path, required=True)
    parser.add_argument("--stats-file", type=Path, required=True)
    parser.add_argument("--hosts", required=True, help="comma-separated host names")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--hardware")
    parser.add_argument("--speed", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", type=Path)
    args = parser.parse_args(argv)
    options = {"gpus": args.gpus, "hardware": args.hardware, "speed": args.speed, "seed": args.seed}
    return run_agent_host(
        args.hosts.split(","),
        args.url,
        args.token_file,
        args.state_root,
        options,
        args.stats_file,
        args.trace_dir,
    )


if __name__ == "__main__":
    raise SystemExit(main())
