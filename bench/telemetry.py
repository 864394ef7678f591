"""The telemetry ingest benchmark: simulated node agents heartbeating into a real ASGI server.

    python -m bench.telemetry                  # 128 nodes x 8 GPUs, 1 Hz, 30 s
    python -m bench.telemetry --nodes 16 --duration 10 --clients 8 --no-poll

Against the configured DATABASE_URL and REDIS_URL (apply migrations first, or pass --migrate),
it starts daphne on a free port of 127.0.0.1, registers the nodes through the agent protocol,
fills every GPU with workers of running jobs (submitted, admitted, and launched by the agents'
reports), then has every node send one heartbeat per period (one GPU reading and one worker
sample per GPU) through a bounded pool of keep-alive connections, for a bounded time, while
each node also holds a command long-poll open. It prints one table: samples accepted per
second, request latency percentiles, errors, and the rows the ingest wrote. Everything it
created is deleted afterwards unless --keep. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import psutil

from bench.stack import (
    HOST,
    Run,
    cleanup,
    listening_socket,
    percentile,
    start_servers,
    stop_servers,
    table,
)

# --- a small HTTP/1.1 keep-alive client (the standard library has no asyncio one) -----------------


class HttpConnection:
    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, token: str, body: bytes = b"") -> tuple[int, bytes]:
        try:
            return await self._request(method, path, token, body)
        except BaseException:
            await self.close()  # never reuse a connection in an unknown state
            raise

    async def _request(self, method: str, path: str, token: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        assert self.reader is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                chunks.append(chunk[:-2])
            data = b"".join(chunks)
        else:
            data = await self.reader.read()
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, data


def call(port: int, method: str, path: str, token: str, body: Any = None) -> Any:
    """A plain blocking request, for the setup phase."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://{HOST}:{port}{path}",
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


# --- the simulated cluster ------------------------------------------------------------------------


@dataclass
class SimNode:
    name: str
    token: str
    gpus: int
    workers: list[tuple[str, int]] = field(default_factory=list)  # (worker, device index)

    def heartbeat(self, rng: random.Random) -> bytes:
        now = time.time()
        by_device = dict((index, name) for name, index in self.workers)
        return json.dumps(
            {
                "sent_at": now,
                "devices": [
                    {
                        "index": i,
                        "utilisation": round(rng.random(), 3),
                        "memory_used_gb": round(rng.uniform(20, 78), 1),
                    }
                    for i in range(self.gpus)
                ],
                "workers": [
                    {
                        "worker": by_device[i],
                        "at": now,
                        "utilisation": round(rng.random(), 3),
                        "queue_length": rng.randrange(0, 32),
                        "in_flight": rng.randrange(0, 64),
                        "tokens": rng.randrange(0, 4000),
                        "progress": round(rng.random(), 3),
                    }
                    for i in range(self.gpus)
                    if i in by_device
                ],
            },
            separators=(",", ":"),
        ).encode()


@dataclass
class Stats:
    sent: int = 0
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    devices_accepted: int = 0
    samples_accepted: int = 0
    duplicates: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    lags_ms: list[float] = field(default_factory=list)
    polls_answered: int = 0
    poll_errors: int = 0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def postgres_cpu_s(database: str) -> float:
    """CPU seconds used so far by the PostgreSQL sessions of ``database`` on this machine (0 when the
    server runs elsewhere or its processes cannot be read)."""
    total = 0.0
    for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["name"] == "postgres" and f" {database} " in f" {cmdline} " and proc.info["cpu_times"]:
            total += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return total


# --- phases ---------------------------------------------------------------------------------------


def prepare(run: Run, port: int, node_count: int, gpus: int, gpus_per_job: int) -> None:
    """Register the nodes, fill their GPUs with running jobs' workers."""
    # Django's models load only after setup_django(); this module is imported before it runs.
    from django.contrib.auth import get_user_model

    from common.audit import Actor
    from jobs.services import submit_job

    for i in range(node_count):
        name = f"{run.tag}-n{i:03d}"
        body = {
            "host": name,
            "agent_version": "bench",
            "backend": "sim",
            "devices": [{"index": g, "hardware": run.hardware, "memory_gb": 80.0} for g in range(gpus)],
        }
        reply = call(port, "POST", "/api/v1/agent/register", run.bootstrap_raw, body)
        run.nodes.append(SimNode(name=name, token=reply["token"], gpus=gpus))

    owner = get_user_model().objects.create_user(username=f"{run.tag}-owner")
    total = node_count * gpus
    for j in range(total // gpus_per_job):
        actor_gpus = max(1, gpus_per_job // 4)
        spec = {
            "name": f"{run.tag}-job{j}",
            "model": {"name": "bench-1.5b", "params_b": 1.5},
            "workload": {
                "kind": "math",
                "iterations": 1000,
                "prompts_per_iteration": 64,
                "samples_per_prompt": 4,
            },
            "components": [
                {
                    "name": "rollout",
                    "kind": "rollout",
                    "workers": gpus_per_job - actor_gpus,
                    "hardware": [run.hardware],
                },
                {
                    "name": "actor",
                    "kind": "actor",
                    "workers": actor_gpus,
                    "depends_on": ["rollout"],
                    "hardware": [run.hardware],
                },
            ],
            # Keep the scheduling loop's hands off: this measures ingest, not migrations.
            "policy": {"name": "static-disaggregated"},
        }
        job = submit_job(owner=owner, source=spec, actor=Actor.system("telemetry-bench")).job
        run.job_ids.append(job.pk)

    for node in run.nodes:
        for command in call(port, "GET", "/api/v1/agent/commands?wait=0", node.token)["commands"]:
            if command["kind"] == "launch_workers":
                for worker in command["payload"]["workers"]:
                    node.workers.extend((worker["worker"], d["index"]) for d in worker["devices"])
            call(
                port,
                "POST",
                f"/api/v1/agent/commands/{quote(command['command_id'], safe='')}/report",
                node.token,
                {"ok": True},
            )


async def heartbeats(
    run: Run, port: int, duration_s: float, period_s: float, clients: int, poll: bool
) -> Stats:
    stats = Stats()
    pool: asyncio.Queue[HttpConnection] = asyncio.Queue()
    for _ in range(clients):
        pool.put_nowait(HttpConnection(port))
    start = time.monotonic() + 1.0
    stop = start + duration_s

    async def agent(index: int, node: SimNode) -> None:
        rng = random.Random(index)
        due = start + period_s * index / len(run.nodes)  # spread the nodes over the period
        while due < stop:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            connection = await pool.get()
            began = time.monotonic()
            stats.lags_ms.append((began - due) * 1000)
            stats.sent += 1
            try:
                status, body = await connection.request(
                    "POST", "/api/v1/agent/heartbeat", node.token, node.heartbeat(rng)
                )
                stats.latencies_ms.append((time.monotonic() - began) * 1000)
                if status == 200:
                    reply = json.loads(body)
                    stats.ok += 1
                    stats.devices_accepted += reply["accepted_devices"]
                    stats.samples_accepted += reply["accepted_samples"]
                    stats.duplicates += int(reply["duplicate"])
                else:
                    stats.error(f"HTTP {status}")
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                stats.error(type(exc).__name__)
            finally:
                pool.put_nowait(connection)
            due += period_s

    async def long_poll(node: SimNode) -> None:
        connection = HttpConnection(port)
        try:
            while time.monotonic() < stop:
                try:
                    status, _ = await connection.request("GET", "/api/v1/agent/commands?wait=25", node.token)
                    if status == 200:
                        stats.polls_answered += 1
                    else:
                        stats.poll_errors += 1
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    stats.poll_errors += 1
                    await asyncio.sleep(1.0)
        finally:
            await connection.close()

    pollers = [asyncio.create_task(long_poll(n)) for n in run.nodes] if poll else []
    await asyncio.gather(*(agent(i, n) for i, n in enumerate(run.nodes)))
    for task in pollers:
        task.cancel()
    await asyncio.gather(*pollers, return_exceptions=True)
    while not pool.empty():
        await pool.get_nowait().close()
    return stats


# --- the report -----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.telemetry", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of heartbeats")
    parser.add_argument("--period", type=float, default=1.0, help="seconds between a node's heartbeats")
    parser.add_argument("--clients", type=int, default=32, help="keep-alive connections for heartbeats")
    parser.add_argument("--gpus-per-job", type=int, default=64)
    parser.add_argument(
        "--servers", type=int, default=os.cpu_count() or 1, help="daphne processes (default: one per core)"
    )
    parser.add_argument("--no-poll", dest="poll", action="store_false", help="no command long-polls")
    parser.add_argument(
        "--migrate", action="store_true", help="apply migrations to the configured database first"
    )
    parser.add_argument("--keep", action="store_true", help="leave the nodes, jobs and rows in place")
    args = parser.parse_args(argv)
    if (args.nodes * args.gpus) % args.gpus_per_job:
        parser.error("--nodes x --gpus must be a multiple of --gpus-per-job")

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    # Django's models load only after setup_django(); this module is imported before it runs.
    import django

    django.setup()
    # Django's models load only after setup_django(); this module is imported before it runs.
    from django.core.management import call_command
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor
    from django.db.models import Count, Sum

    from agents.models import BootstrapToken
    from cluster.models import Device
    from common.models import hash_token
    from scheduler.models import TelemetrySample

    if args.migrate:
        call_command("migrate", verbosity=0)
    elif MigrationExecutor(connection).migration_plan(
        MigrationExecutor(connection).loader.graph.leaf_nodes()
    ):
        print(
            "the configured database has unapplied migrations; run migrate or pass --migrate", file=sys.stderr
        )
        return 2

    tag = f"bench{secrets.token_hex(3)}"
    run = Run(tag=tag, hardware=f"BENCH-{tag}", bootstrap_raw=secrets.token_urlsafe(24))
    BootstrapToken.objects.create(name=tag, key_hash=hash_token(run.bootstrap_raw))
    sock = listening_socket()
    port = int(sock.getsockname()[1])
    with tempfile.TemporaryFile() as server_log:
        servers = start_servers(sock, args.servers, server_log)
        try:
            setup_started = time.monotonic()
            prepare(run, port, args.nodes, args.gpus, args.gpus_per_job)
            setup_s = time.monotonic() - setup_started
            workers = sum(len(n.workers) for n in run.nodes)
            processes = [psutil.Process(p.pid) for p in servers]
            server_cpu = sum(sum(p.cpu_times()[:2]) for p in processes)
            database_cpu = postgres_cpu_s(connection.settings_dict["NAME"])
            psutil.cpu_percent(None)
            began = time.time()
            wall = time.monotonic()
            stats = asyncio.run(heartbeats(run, port, args.duration, args.period, args.clients, args.poll))
            wall = time.monotonic() - wall - 1.0  # the first second is the start-up offset
            machine_cpu = psutil.cpu_percent(None)
            server_cpu = sum(sum(p.cpu_times()[:2]) for p in processes) - server_cpu
            database_cpu = postgres_cpu_s(connection.settings_dict["NAME"]) - database_cpu
            history = TelemetrySample.objects.filter(job_id__in=run.job_ids).aggregate(
                rows=Count("pk"), folded=Sum("samples")
            )
            reported = Device.objects.filter(
                node__name__startswith=f"{tag}-", reported_at__isnull=False
            ).count()
        finally:
            stop_servers(servers)
            sock.close()
            if not args.keep:
                cleanup(run)
        server_log.seek(0)
        logged = server_log.read().decode(errors="replace").splitlines()
        server_problems = [line for line in logged if " ERROR " in line or "Traceback" in line]

    elapsed = max(wall, args.duration)
    gpus = args.nodes * args.gpus
    rows = [
        (
            "GPUs (nodes x GPUs)",
            f"{gpus} ({args.nodes} x {args.gpus}), {workers} workers in {len(run.job_ids)} jobs",
        ),
        ("heartbeat period / duration", f"{args.period:g} s / {args.duration:g} s"),
        ("server processes (daphne, one socket)", str(args.servers)),
        ("client connections (+ long-polls held)", f"{args.clients} (+ {args.nodes if args.poll else 0})"),
        ("heartbeats sent / ok / errors", f"{stats.sent} / {stats.ok} / {stats.errors}"),
        ("heartbeats/s offered / achieved", f"{args.nodes / args.period:.1f} / {stats.ok / elapsed:.1f}"),
        ("GPU readings accepted/s", f"{stats.devices_accepted / elapsed:.0f}"),
        ("worker samples accepted/s", f"{stats.samples_accepted / elapsed:.0f}"),
        (
            "request latency p50 / p90 / p99 / max (ms)",
            " / ".join(f"{percentile(stats.latencies_ms, q):.1f}" for q in (0.5, 0.9, 0.99, 1.0)),
        ),
        (
            "send lag behind schedule p50 / p99 (ms)",
            " / ".join(f"{percentile(stats.lags_ms, q):.1f}" for q in (0.5, 0.99)),
        ),
        ("long-polls answered / errors", f"{stats.polls_answered} / {stats.poll_errors}"),
        ("TelemetrySample rows / samples folded in", f"{history['rows']} / {history['folded'] or 0}"),
        ("Device rows with a reading", f"{reported} of {gpus}"),
        ("server CPU (all daphne processes)", f"{server_cpu / elapsed * 100:.0f}% of one core"),
        ("server CPU per heartbeat", f"{server_cpu / max(stats.ok, 1) * 1000:.1f} ms"),
        ("PostgreSQL CPU (this database's sessions)", f"{database_cpu / elapsed * 100:.0f}% of one core"),
        ("machine CPU busy (all processes)", f"{machine_cpu:.0f}% of {psutil.cpu_count()} cores"),
        ("setup (register, admit, launch)", f"{setup_s:.1f} s"),
    ]
    rows.append(("server log: errors / tracebacks", str(len(server_problems))))
    if stats.error_kinds:
        rows.append(("error kinds", ", ".join(f"{k}: {v}" for k, v in sorted(stats.error_kinds.items()))))
    print(f"Telemetry ingest benchmark, started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(began))}")
    print(table(rows))
    if server_problems:
        print("server log (first problem):")
        print("\n".join(logged[logged.index(server_problems[0]) :][:40]))
    return 0 if stats.errors == 0 and not server_problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
