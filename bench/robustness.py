"""The robustness table: every policy on traces whose response lengths come from other
distributions than the generator's, as a ratio to the best static placement on that trace.

    python -m bench.robustness                                   # the table in BENCHMARKS.md
    python -m bench.robustness --workload math-7B-64 --family uniform --iterations 3
    python -m bench.robustness --json
    python -m bench.robustness --workload math-7B-64 --family constant --family shrinking  # not in the table

For each workload, the generator's episodes are drawn once (``--seed``) and their response lengths
redrawn per family (``scheduler/core/sim/families.py``: lognormal, uniform, pareto, bimodal,
growing; lognormal and longer-turns for agentic workloads; more for math workloads when named with
``--family``: constant, shrinking, tail-vanishes, tail-appears, exponential, wide, short,
truncated, rare-outliers). Every policy runs on the same trace;
a row's ratios divide each policy's tokens/s by the best static placement's, the better of
static-colocated and static-disaggregated on that trace. The targets are dynarl's: never below the
best static placement, at least 1.15x it where the lengths have a tail, and within 2% of the best
policy on every trace. Virtual time: every figure is a pure function of the flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.core.decisions import Reason
from scheduler.core.policies import POLICY_NAMES
from scheduler.core.sim.families import LengthFamily, families_drawn_for, families_for, reshape
from scheduler.core.sim.runner import simulate
from scheduler.core.sim.simulator import SimOptions
from scheduler.core.sim.trace import generate_trace
from scheduler.core.sim.workloads import get_workload

WORKLOADS = ("math-7B-64", "math-32B-128", "agentic-7B-64")
STATIC = ("static-colocated", "static-disaggregated")
DEFAULT_ITERATIONS = 4
SUBJECT = "dynarl"
TARGET_NO_HARM = 1.00
TARGET_WITH_TAIL = 1.15
TARGET_NEAR_BEST = 0.98  # of the best policy's tokens/s


@dataclass
class Row:
    workload: str
    family: LengthFamily
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # policy -> tokens/s
    errors: dict[str, str] = field(default_factory=dict)
    placements: str = ""  # dynarl's placement per iteration: D(isaggregated) or C(olocated)
    replans: list[str] = field(default_factory=list)  # dynarl's placement changes and re-planned splits

    @property
    def best_static(self) -> float | None:
        static = [self.tokens_per_s[p] for p in STATIC if p in self.tokens_per_s]
        return max(static) if len(static) == len(STATIC) else None

    def ratio(self, policy: str) -> float | None:
        best = self.best_static
        tokens = self.tokens_per_s.get(policy)
        return None if best is None or tokens is None else tokens / best

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "family": str(self.family),
            "tokens_per_s": self.tokens_per_s,
            "errors": self.errors,
            "best_static_tokens_per_s": self.best_static,
            "ratios": {p: self.ratio(p) for p in self.tokens_per_s},
            "dynarl_placements": self.placements,
            "dynarl_replans": self.replans,
        }


def run(
    workloads: Sequence[str],
    families: Sequence[LengthFamily] | None,
    policies: Sequence[str],
    *,
    iterations: int,
    seed: int,
    log: Any = sys.stderr,
) -> list[Row]:
    """Every policy on every (workload, family) trace; a policy that fails is a row's finding."""
    started = time.perf_counter()
    rows = []
    for name in workloads:
        workload = get_workload(name)
        base = generate_trace(workload, seed, iterations=iterations)
        # The table's families, or those asked for that this kind of workload draws.
        drawn = families_for(workload) if families is None else families_drawn_for(workload)
        for family in drawn:
            if families is not None and family not in families:
                continue
            records = reshape(base, workload, family, seed)
            row = Row(workload.name, family)
            for policy in policies:
                try:
                    result = simulate(
                        workload, policy, records=records, options=SimOptions(iterations=iterations)
                    )
                except Exception as exc:
                    row.errors[policy] = f"{type(exc).__name__}: {exc}"
                    status = f"error: {row.errors[policy]}"
                else:
                    row.tokens_per_s[policy] = result.tokens_per_s
                    status = f"{result.tokens_per_s:,.0f} tokens/s"
                    if policy == SUBJECT:
                        row.placements = "".join(p[0].upper() for p in result.placements)
                        row.replans = [
                            f"after iteration {c.iteration - 1}: {c.to} ({c.why})"
                            for c in result.placement_changes
                        ]
                        rebased = result.moves_by_reason.get(Reason.REPLAN_BASE_SPLIT.value, 0)
                        if rebased:
                            row.replans.append(f"{rebased} re-planned base splits")
                elapsed = time.perf_counter() - started
                print(f"[{elapsed:6.1f}s] {name} {family} {policy}: {status}", file=log, flush=True)
            rows.append(row)
    return rows


def render(rows: Sequence[Row], policies: Sequence[str]) -> str:
    lines = ["## Robustness: × the best static placement on each trace", ""]
    lines.append("| workload | lengths | best static (tokens/s) | " + " | ".join(policies) + " |")
    lines.append("| --- | --- | ---: | " + " | ".join("---:" for _ in policies) + " |")
    for row in rows:
        best = row.best_static
        cells = []
        for policy in policies:
            ratio = row.ratio(policy)
            cells.append("error" if policy in row.errors else "n/a" if ratio is None else f"{ratio:.2f}")
        shown = "n/a" if best is None else f"{best:,.0f}"
        lines.append(f"| {row.workload} | {row.family} | {shown} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replans(rows: Sequence[Row]) -> list[str]:
    """What dynarl re-planned on each trace: its placement per iteration and every change."""
    lines = ["## What dynarl re-planned", "", "| workload | lengths | placement per iteration | changes |"]
    lines.append("| --- | --- | --- | --- |")
    for row in rows:
        if not row.placements:
            continue
        changes = "; ".join(row.replans) if row.replans else "none"
        lines.append(f"| {row.workload} | {row.family} | {row.placements} | {changes} |")
    return lines


def targets(rows: Sequence[Row]) -> list[str]:
    """dynarl against the table's three targets, row by row; a line per miss."""
    misses: list[str] = []
    checked = 0
    for row in rows:
        ratio = row.ratio(SUBJECT)
        if ratio is None or not row.tokens_per_s:
            continue
        checked += 1
        where = f"{row.workload} / {row.family}"
        if ratio < TARGET_NO_HARM:
            misses.append(
                f"- {where}: {ratio:.3f}× the best static placement (target ≥ {TARGET_NO_HARM:.2f}) — MISSED"
            )
        if row.family.has_tail and ratio < TARGET_WITH_TAIL:
            misses.append(f"- {where}: {ratio:.3f}× with a tail (target ≥ {TARGET_WITH_TAIL:.2f}) — MISSED")
        best_policy, best = max(row.tokens_per_s.items(), key=lambda item: item[1])
        share = row.tokens_per_s[SUBJECT] / best
        if share < TARGET_NEAR_BEST:
            misses.append(
                f"- {where}: {100 * share:.1f}% of the best policy, {best_policy} (target ≥ {100 * TARGET_NEAR_BEST:.0f}%) — MISSED"
            )
    head = [
        "## Targets (dynarl)",
        "",
        f"≥ {TARGET_NO_HARM:.2f}× the best static placement on every trace; ≥ {TARGET_WITH_TAIL:.2f}× on every "
        f"trace with a tail; within {100 * (1 - TARGET_NEAR_BEST):.0f}% of the best policy on every trace.",
        f"{checked} traces checked, {len(misses)} misses.",
    ]
    return [*head, *misses]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.robustness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", help=f"repeatable; default: {', '.join(WORKLOADS)}")
    parser.add_argument(
        "--family", action="append", choices=[str(f) for f in LengthFamily], help="repeatable; default: all"
    )
    parser.add_argument("--policy", action="append", choices=POLICY_NAMES, help="repeatable; default: all")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in args.workload or ():
        try:
            get_workload(name)
        except KeyError as exc:
            parser.error(str(exc.args[0]))
    if args.iterations < 1:
        parser.error("--iterations must be at least 1")
    selected = list(args.policy or POLICY_NAMES)
    policies = [*STATIC, *[p for p in selected if p not in STATIC]]
    families = [LengthFamily(f) for f in args.family] if args.family else None
    started = time.perf_counter()
    rows = run(args.workload or WORKLOADS, families, policies, iterations=args.iterations, seed=args.seed)
    if args.json:
        print(
            json.dumps(
                {"iterations": args.iterations, "seed": args.seed, "rows": [r.to_json() for r in rows]},
                indent=2,
            )
        )
    else:
        print(render(rows, policies))
        print()
        print("\n".join(replans(rows)))
        print()
        print("\n".join(targets(rows)))
        print(
            f"\n({time.perf_counter() - started:.0f} s wall, {args.iterations} iterations, seed {args.seed})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
