"""The scheduling benchmark: every policy on the same traces, one table.

    python -m bench.policies                       # everything (see BENCHMARKS.md for a run)
    python -m bench.policies --workload math-7B-64 --policy dynarl --iterations 3
    python -m bench.policies --trace my-trace.jsonl --gpus 128 --json

Per workload and policy: tokens/s, the ratio to the two static baselines (static-colocated, the
verl-like one, and static-disaggregated, the RLinf-like one), the share of the oracle bound,
migrations, online overhead and the wall time of ``decide``; where each run's GPU-time went (the
rollout decoding, its partly idle and empty engines, log-prob and trainer workers busy or idle,
migrations and colocated switches). Then the DataRouter priority vs FIFO
comparison on agentic workloads, a U_low sweep of dynarl, and dynarl's decision latency on a
synthetic 1,024-GPU, 64-group job. Virtual time makes every number except the decision
latencies a pure function of the flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from scheduler.core.policies import POLICY_NAMES
from scheduler.core.sim.latency import LatencyResult, decision_latency
from scheduler.core.sim.oracle import OracleBound, oracle_bound
from scheduler.core.sim.results import SimResult
from scheduler.core.sim.runner import simulate
from scheduler.core.sim.simulator import SimOptions
from scheduler.core.sim.trace import TraceRecord, generate_trace, read_trace_file
from scheduler.core.sim.workloads import Workload, WorkloadKind, get_workload

BENCH_WORKLOADS = ("math-1.5B-64", "math-7B-64", "math-32B-128", "math-7B-64-async", "agentic-7B-64")
BASELINES = ("static-colocated", "static-disaggregated")
U_LOW_SWEEP = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
SWEEP_WORKLOAD = "math-1.5B-64"
SWEEP_POLICY = "dynarl"
ROUTER_POLICIES = ("static-disaggregated", "dynarl")

# The targets from the DynaRL paper the benchmark reports against (DESIGN.md).
TARGET_VS_COLOCATED = 1.27
TARGET_VS_COLOCATED_32B = 1.9
TARGET_VS_DISAGGREGATED = 1.2
TARGET_ORACLE_SHARE = 0.9
TARGET_PRIORITY_VS_FIFO = 1.2
TARGET_DECISION_P99_MS = 20.0
TARGET_OVERHEAD = 0.01


@dataclass
class Run:
    workload: str
    policy: str
    variant: str  # "" for the main table; "router=fifo", "u_low=0.1", ...
    result: SimResult | None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "policy": self.policy,
            "variant": self.variant,
            "error": self.error,
            "result": self.result.to_dict(include_wall_clock=True) if self.result else None,
        }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.policies", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload", action="append", help=f"repeatable; default: {', '.join(BENCH_WORKLOADS)}"
    )
    parser.add_argument("--policy", action="append", choices=POLICY_NAMES, help="repeatable; default: all")
    parser.add_argument("--trace", help="a JSONL trace replacing the generator (docs/trace-format.md)")
    parser.add_argument("--gpus", type=int, help="cluster size for every workload (a multiple of 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, help="RL iterations per run (default: the workload's)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument("--no-sweep", action="store_true", help=f"skip the U_low sweep on {SWEEP_WORKLOAD}")
    parser.add_argument("--no-router", action="store_true", help="skip the priority vs FIFO comparison")
    parser.add_argument("--no-latency", action="store_true", help="skip the 1,024-GPU decision latency run")
    parser.add_argument("--latency-calls", type=int, default=200)
    return parser


def _workloads(args: argparse.Namespace, trace_workload: str | None) -> list[Workload]:
    names = args.workload or ([trace_workload or "math-7B-64"] if args.trace else list(BENCH_WORKLOADS))
    workloads = []
    for name in names:
        workload = get_workload(name)
        if args.gpus:
            workload = replace(workload, gpus=args.gpus, node_hardware=())
        workloads.append(workload)
    return workloads


def _run(
    workload: Workload,
    policy: str,
    records: Sequence[TraceRecord],
    variant: str = "",
    *,
    params: dict[str, Any] | None = None,
    options: SimOptions | None = None,
) -> Run:
    try:
        result = simulate(workload, policy, records=records, params=params, options=options)
    except Exception as exc:  # a policy's failure is a benchmark finding, not a crash
        return Run(workload.name, policy, variant, None, f"{type(exc).__name__}: {exc}")
    return Run(workload.name, policy, variant, result)


def run_benchmark(args: argparse.Namespace, log: Any = sys.stderr) -> dict[str, Any]:
    trace = read_trace_file(args.trace) if args.trace else None
    workloads = _workloads(args, trace.workload if trace else None)
    selected = list(args.policy or POLICY_NAMES)
    policies = [*BASELINES, *[p for p in selected if p not in BASELINES]]
    runs: list[Run] = []
    oracles: dict[str, OracleBound] = {}
    records_of: dict[str, list[TraceRecord]] = {}
    started = time.perf_counter()

    def note(run: Run) -> Run:
        status = f"{run.result.tokens_per_s:,.0f} tokens/s" if run.result else f"error: {run.error}"
        elapsed = time.perf_counter() - started
        print(f"[{elapsed:6.1f}s] {run.workload} {run.policy} {run.variant}: {status}", file=log, flush=True)
        return run

    for workload in workloads:
        if trace is not None:
            records = list(trace.records)
        else:
            records = generate_trace(workload, args.seed, iterations=args.iterations)
        records_of[workload.name] = records
        oracles[workload.name] = oracle_bound(workload, records, iterations=args.iterations)
        for policy in policies:
            runs.append(note(_run(workload, policy, records, options=SimOptions(iterations=args.iterations))))
        if workload.kind is WorkloadKind.AGENTIC and not args.no_router:
            other = "fifo" if workload.router_mode == "priority" else "priority"
            for policy in [p for p in ROUTER_POLICIES if p in policies]:
                options = SimOptions(iterations=args.iterations, router_mode=other)
                runs.append(note(_run(workload, policy, records, f"router={other}", options=options)))
        if workload.name == SWEEP_WORKLOAD and not args.no_sweep and SWEEP_POLICY in policies:
            for u_low in U_LOW_SWEEP:
                runs.append(
                    note(
                        _run(
                            workload,
                            SWEEP_POLICY,
                            records,
                            f"u_low={u_low}",
                            params={"u_low": u_low},
                            options=SimOptions(iterations=args.iterations),
                        )
                    )
                )
    latency: LatencyResult | None = None
    latency_error: str | None = None
    if not args.no_latency and SWEEP_POLICY in policies:
        try:
            latency = decision_latency(SWEEP_POLICY, calls=args.latency_calls, seed=args.seed)
        except Exception as exc:
            latency_error = f"{type(exc).__name__}: {exc}"
    return {
        "command": "python -m bench.policies " + " ".join(sys.argv[1:]),
        "seed": args.seed,
        "selected_policies": selected,
        "runs": [run.to_json() for run in runs],
        "oracles": {name: asdict(bound) for name, bound in oracles.items()},
        "latency": asdict(latency) if latency else None,
        "latency_error": latency_error,
        "wall_s": time.perf_counter() - started,
    }


# -- the tables --------------------------------------------------------------------------------


def _main_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    runs = [r for r in report["runs"] if not r["variant"]]
    for run in runs:
        result = run["result"]
        base = {
            b["policy"]: b["result"]["tokens_per_s"]
            for b in runs
            if b["workload"] == run["workload"] and b["policy"] in BASELINES and b["result"]
        }
        oracle = report["oracles"][run["workload"]]["tokens_per_s"]
        row: dict[str, Any] = {"workload": run["workload"], "policy": run["policy"], "error": run["error"]}
        if result:
            tokens = result["tokens_per_s"]
            row.update(
                tokens_per_s=tokens,
                vs_colocated=tokens / base["static-colocated"] if "static-colocated" in base else None,
                vs_disaggregated=tokens / base["static-disaggregated"]
                if "static-disaggregated" in base
                else None,
                oracle_share=tokens / oracle,
                migrations=result["migrations"],
                overhead=result["online_overhead"],
                p50_ms=result["decision_latency_p50_ms"],
                p99_ms=result["decision_latency_p99_ms"],
            )
        rows.append(row)
    return rows


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def render(report: dict[str, Any]) -> str:
    lines = ["## Throughput", ""]
    lines.append(
        "| workload | policy | tokens/s | × static-colocated | × static-disaggregated | % of oracle "
        "| migrations | online overhead | decide p50 / p99 (ms) |"
    )
    lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in _main_rows(report):
        if row["error"]:
            lines.append(f"| {row['workload']} | {row['policy']} | error: {row['error']} | | | | | | |")
            continue
        lines.append(
            f"| {row['workload']} | {row['policy']} | {row['tokens_per_s']:,.0f} | "
            f"{_fmt(row['vs_colocated'], '.2f')} | {_fmt(row['vs_disaggregated'], '.2f')} | "
            f"{100 * row['oracle_share']:.1f}% | {row['migrations']} | {100 * row['overhead']:.2f}% | "
            f"{row['p50_ms']:.2f} / {row['p99_ms']:.2f} |"
        )
    lines.append("")
    lines.append(
        "Oracle bound (tokens/s): "
        + ", ".join(f"{k} {v['tokens_per_s']:,.0f}" for k, v in report["oracles"].items())
    )
    lines += _gpu_time_lines(report)
    router = [r for r in report["runs"] if r["variant"].startswith("router=")]
    if router:
        lines += ["", "## DataRouter: priority vs FIFO (agentic)", ""]
        lines.append(
            "| workload | policy | priority tokens/s | FIFO tokens/s | priority / FIFO | re-prefilled tokens (priority / FIFO) |"
        )
        lines.append("| --- | --- | ---: | ---: | ---: | ---: |")
        for run in router:
            main = next(
                (
                    m
                    for m in report["runs"]
                    if not m["variant"] and m["workload"] == run["workload"] and m["policy"] == run["policy"]
                ),
                None,
            )
            if not main or not main["result"] or not run["result"]:
                lines.append(
                    f"| {run['workload']} | {run['policy']} | error: {run['error'] or (main and main['error'])} | | | |"
                )
                continue
            by_mode = {
                main["result"]["router_mode"]: main["result"],
                run["result"]["router_mode"]: run["result"],
            }
            p, f = by_mode["priority"], by_mode["fifo"]
            lines.append(
                f"| {run['workload']} | {run['policy']} | {p['tokens_per_s']:,.0f} | {f['tokens_per_s']:,.0f} | "
                f"{p['tokens_per_s'] / f['tokens_per_s']:.2f} | {p['reprefilled_tokens']:,} / {f['reprefilled_tokens']:,} |"
            )
    sweep = [r for r in report["runs"] if r["variant"].startswith("u_low=")]
    if sweep:
        lines += ["", f"## U_low sweep ({SWEEP_POLICY} on {SWEEP_WORKLOAD})", ""]
        lines.append("| U_low | tokens/s | % of the sweep's peak | migrations |")
        lines.append("| ---: | ---: | ---: | ---: |")
        peak = max((r["result"]["tokens_per_s"] for r in sweep if r["result"]), default=0.0)
        for run in sweep:
            u_low = run["variant"].split("=", 1)[1]
            if not run["result"]:
                lines.append(f"| {u_low} | error: {run['error']} | | |")
                continue
            tokens = run["result"]["tokens_per_s"]
            lines.append(
                f"| {u_low} | {tokens:,.0f} | {100 * tokens / peak:.1f}% | {run['result']['migrations']} |"
            )
    if report["latency"] or report["latency_error"]:
        lines += ["", "## Decision latency at scale", ""]
        if report["latency"]:
            lat = report["latency"]
            lines.append(
                f"{lat['policy']} on a synthetic {lat['gpus']:,}-GPU, {lat['groups']}-group job, {lat['calls']} calls: "
                f"p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, max {lat['max_ms']:.1f} ms "
                f"({lat['decisions_per_call']:.2f} decisions per call)."
            )
        else:
            lines.append(f"error: {report['latency_error']}")
    lines += ["", "## Targets", ""] + [f"- {line}" for line in targets(report)]
    return "\n".join(lines)


# Columns of the GPU-time table: (heading, the kinds of SimResult.gpu_seconds it sums).
GPU_TIME_COLUMNS = (
    ("rollout decoding", ("rollout_decoding",)),
    ("rollout partly idle", ("rollout_partly_idle",)),
    ("rollout empty", ("rollout_empty",)),
    ("log-probs busy", ("log_prob_busy",)),
    ("log-probs idle", ("log_prob_idle",)),
    ("trainer busy", ("trainer_busy",)),
    ("trainer idle", ("trainer_idle",)),
    ("moving / switching / free", ("in_migration", "colocated_switch", "free")),
)


def _gpu_time_lines(report: dict[str, Any]) -> list[str]:
    """Where each main run's GPU-time went, as shares of all GPU-seconds of the run."""
    runs = [r for r in report["runs"] if not r["variant"] and r["result"] and r["result"].get("gpu_seconds")]
    if not runs:
        return []
    lines = ["", "## Where the GPU-time goes", ""]
    lines.append("| workload | policy | " + " | ".join(h for h, _ in GPU_TIME_COLUMNS) + " |")
    lines.append("| --- | --- | " + " | ".join("---:" for _ in GPU_TIME_COLUMNS) + " |")
    for run in runs:
        spent = run["result"]["gpu_seconds"]
        total = sum(spent.values())
        if total <= 0:
            continue
        shares = [sum(spent.get(k, 0.0) for k in kinds) / total for _, kinds in GPU_TIME_COLUMNS]
        lines.append(
            f"| {run['workload']} | {run['policy']} | " + " | ".join(f"{100 * x:.0f}%" for x in shares) + " |"
        )
    return lines


def targets(report: dict[str, Any]) -> list[str]:
    """Each target from DESIGN.md with what this run measured (met or missed)."""
    out = []
    rows = [r for r in _main_rows(report) if r["policy"] == SWEEP_POLICY]
    for row in rows:
        if row["error"]:
            out.append(f"{row['workload']}: {SWEEP_POLICY} failed ({row['error']})")
            continue
        math = row["workload"].startswith("math")
        checks = []
        if math and row["vs_colocated"] is not None:
            need = TARGET_VS_COLOCATED_32B if "32B" in row["workload"] else TARGET_VS_COLOCATED
            checks.append(("× static-colocated", row["vs_colocated"], need))
        if row["vs_disaggregated"] is not None:
            checks.append(("× static-disaggregated", row["vs_disaggregated"], TARGET_VS_DISAGGREGATED))
        checks.append(("share of oracle", row["oracle_share"], TARGET_ORACLE_SHARE))
        for label, value, need in checks:
            verdict = "met" if value >= need else "MISSED"
            out.append(f"{row['workload']}: {label} {value:.2f} (target ≥ {need}) — {verdict}")
        verdict = "met" if row["overhead"] < TARGET_OVERHEAD else "MISSED"
        out.append(
            f"{row['workload']}: online overhead {100 * row['overhead']:.2f}% (target < 1%) — {verdict}"
        )
    for run in [
        r for r in report["runs"] if r["variant"].startswith("router=") and r["policy"] == SWEEP_POLICY
    ]:
        main = next(
            (
                m
                for m in report["runs"]
                if not m["variant"] and m["workload"] == run["workload"] and m["policy"] == run["policy"]
            ),
            None,
        )
        if main and main["result"] and run["result"]:
            by_mode = {
                main["result"]["router_mode"]: main["result"],
                run["result"]["router_mode"]: run["result"],
            }
            ratio = by_mode["priority"]["tokens_per_s"] / by_mode["fifo"]["tokens_per_s"]
            verdict = "met" if ratio >= TARGET_PRIORITY_VS_FIFO else "MISSED"
            out.append(
                f"{run['workload']}: priority / FIFO {ratio:.2f} (target ≥ {TARGET_PRIORITY_VS_FIFO}) — {verdict}"
            )
    sweep = [r for r in report["runs"] if r["variant"].startswith("u_low=") and r["result"]]
    if sweep:
        best = max(sweep, key=lambda r: r["result"]["tokens_per_s"])
        peak_u = float(best["variant"].split("=", 1)[1])
        ends_lower = all(
            r["result"]["tokens_per_s"] < best["result"]["tokens_per_s"]
            for r in (sweep[0], sweep[-1])
            if r is not best
        )
        verdict = "met" if 0.1 <= peak_u <= 0.3 and ends_lower else "MISSED"
        out.append(
            f"U_low sweep: peak at {peak_u}, ends lower: {ends_lower} (target: peak in 0.1–0.3) — {verdict}"
        )
    if report["latency"]:
        p99 = report["latency"]["p99_ms"]
        verdict = "met" if p99 <= TARGET_DECISION_P99_MS else "MISSED"
        out.append(
            f"decision p99 at 1,024 GPUs: {p99:.1f} ms (target ≤ {TARGET_DECISION_P99_MS:.0f} ms) — {verdict}"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.gpus is not None and (args.gpus <= 0 or args.gpus % 8):
        _parser().error("--gpus must be a positive multiple of 8")
    for name in args.workload or ():
        try:
            get_workload(name)
        except KeyError as exc:
            _parser().error(str(exc.args[0]))
    report = run_benchmark(args)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(render(report))
        print(f"\n({report['wall_s']:.0f} s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
