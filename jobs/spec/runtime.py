"""The ``runtime`` section: what a job on the ``ray`` backend really runs.

A job on the ``sim`` backend is a model of a job; a job on ``ray`` runs: a small GPT policy trained
with GRPO on a synthetic arithmetic task (``runtime/`` and docs/ray-backend.md). This section sizes
that model and task and sets the training; the workload gives the batch shape and the iterations.
It is refused on the ``sim`` backend, and on ``ray`` every value and every cross-field rule is
checked here, so a job the runtime cannot run is a 400 naming the field, not a failed job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from jobs.spec.components import Draft
from jobs.spec.model import RuntimeModelSpec, RuntimeSpec, WorkloadSpec
from jobs.spec.sections import Section
from scheduler.core.hypergraph import ComponentKind

RUNTIME_KEYS: Final = (
    "engine",
    "model",
    "task",
    "dataset_size",
    "seed",
    "temperature",
    "learning_rate",
    "kl_coef",
    "micro_batch_size",
    "ppo_epochs",
    "warm_start_steps",
    "routing",
)
RUNTIME_MODEL_KEYS: Final = ("hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "max_positions")
TASK_KEYS: Final = ("max_digits", "zipf_exponent")
# The rollout engines a job may ask for (runtime/engine/sglang_server.py chooses between them).
ENGINES: Final = ("auto", "sglang", "cpu")
RAY_KINDS: Final = (
    ComponentKind.ROLLOUT,
    ComponentKind.INFERENCE,
    ComponentKind.REWARD,
    ComponentKind.TOOL,
    ComponentKind.ACTOR,
)
# How an agentic job's turns reach the engines (runtime/rl/agentic.py): the DataRouter's order
# with KV affinity, or arrival order on any engine.
ROUTINGS: Final = ("priority", "fifo")
# Bounds that keep a job a small model on the hosts' CPUs or GPUs, not a mistake that runs for days.
MAX_HIDDEN: Final = 4096
MAX_LAYERS: Final = 48
MAX_POSITIONS: Final = 8192
MAX_DIGITS: Final = 64
# Optimizer steps per batch: PPO takes a few; far past that every ratio is clipped flat.
MAX_PPO_EPOCHS: Final = 64
# An agentic episode sums workload.max_turns numbers with the calculator.
MAX_AGENTIC_TURNS: Final = 32


def batch_sizes(batch: int, min_workers: int, max_workers: int | None) -> tuple[int, ...]:
    """The trainer sizes a global batch of ``batch`` samples splits evenly over, within the
    group's worker limits."""
    top = batch if max_workers is None else min(batch, max_workers)
    return tuple(n for n in range(max(1, min_workers), top + 1) if batch % n == 0)


def prompt_tokens(max_digits: int, terms: int = 2) -> int:
    """The longest prompt of the task: BOS, ``terms`` operands, the '+'s and a newline."""
    return terms * max_digits + terms + 1


def read_runtime(
    top: Section,
    *,
    backend: str | None,
    workload: WorkloadSpec | None,
    drafts: Sequence[Draft],
) -> tuple[bool, RuntimeSpec | None]:
    """``(ok, runtime)``: the section read (its defaults when a ``ray`` job leaves it out), None
    for a ``sim`` job; ``ok`` is False when a problem was reported."""
    if backend != "ray":
        if top.has("runtime"):
            top.fail("runtime", f"only applies to jobs on the ray backend (backend is {backend!r})")
            return False, None
        return True, None
    before = len(top.problems.errors)
    section = top.mapping("runtime") if top.has("runtime") else None
    defaults = RuntimeSpec()
    model = RuntimeModelSpec()
    runtime = defaults
    if section is not None:
        section.reject_unknown(RUNTIME_KEYS)
        model_section = section.mapping("model")
        if model_section is not None:
            model = _read_model(model_section) or model
        task = section.mapping("task")
        max_digits = defaults.max_digits
        zipf = defaults.zipf_exponent
        if task is not None:
            task.reject_unknown(TASK_KEYS)
            max_digits = task.integer("max_digits", defaults.max_digits, minimum=1, maximum=MAX_DIGITS) or 1
            zipf = task.number("zipf_exponent", defaults.zipf_exponent, above=0.0, maximum=16.0) or 1.0
        runtime = RuntimeSpec(
            model=model,
            max_digits=max_digits,
            zipf_exponent=zipf,
            dataset_size=section.integer("dataset_size", None, nullable=True, minimum=1, maximum=10_000_000),
            seed=section.integer("seed", defaults.seed, minimum=0, maximum=2**31 - 1) or 0,
            temperature=section.number("temperature", defaults.temperature, above=0.0, maximum=10.0) or 1.0,
            learning_rate=section.number("learning_rate", defaults.learning_rate, above=0.0, maximum=1.0)
            or 1.0,
            kl_coef=section.number("kl_coef", defaults.kl_coef, minimum=0.0, maximum=100.0) or 0.0,
            micro_batch_size=section.integer("micro_batch_size", defaults.micro_batch_size, minimum=1) or 1,
            ppo_epochs=section.integer("ppo_epochs", defaults.ppo_epochs, minimum=1, maximum=MAX_PPO_EPOCHS)
            or 1,
            warm_start_steps=section.integer(
                "warm_start_steps", defaults.warm_start_steps, minimum=0, maximum=1_000_000
            )
            or 0,
            engine=section.string("engine", defaults.engine, choices=ENGINES) or defaults.engine,
            routing=section.string("routing", defaults.routing, choices=ROUTINGS) or defaults.routing,
        )
    _check_job(top, runtime, workload, drafts)
    ok = len(top.problems.errors) == before
    return ok, runtime if ok else None


def _read_model(section: Section) -> RuntimeModelSpec | None:
    section.reject_unknown(RUNTIME_MODEL_KEYS)
    default = RuntimeModelSpec()
    hidden = section.integer("hidden_size", default.hidden_size, minimum=8, maximum=MAX_HIDDEN)
    layers = section.integer("num_layers", default.num_layers, minimum=1, maximum=MAX_LAYERS)
    heads = section.integer("num_heads", default.num_heads, minimum=1, maximum=128)
    ffn = section.integer("ffn_hidden_size", default.ffn_hidden_size, minimum=8, maximum=4 * MAX_HIDDEN)
    positions = section.integer("max_positions", default.max_positions, minimum=16, maximum=MAX_POSITIONS)
    if hidden is None or layers is None or heads is None or ffn is None or positions is None:
        return None
    if hidden % heads:
        section.fail("hidden_size", f"must be a multiple of num_heads ({heads}), got {hidden}")
        return None
    return RuntimeModelSpec(
        hidden_size=hidden, num_layers=layers, num_heads=heads, ffn_hidden_size=ffn, max_positions=positions
    )


def _check_job(
    top: Section, runtime: RuntimeSpec, workload: WorkloadSpec | None, drafts: Sequence[Draft]
) -> None:
    """The rules across sections that the runtime relies on."""
    problems = top.problems
    for draft in drafts:
        if draft.kind is not None and draft.kind not in RAY_KINDS:
            problems.add(
                f"components[{draft.index}].kind",
                f"the ray runtime runs {', '.join(k.value for k in RAY_KINDS)} components, not {draft.kind.value!r}",
            )
    kinds = {draft.kind for draft in drafts}
    agentic = workload is not None and workload.kind == "agentic"
    if agentic and ComponentKind.TOOL not in kinds:
        problems.add(
            "components",
            "an agentic job on the ray backend needs a tool component (its workers run the calculator)",
        )
    if workload is not None and not agentic:
        for draft in drafts:
            if draft.kind is ComponentKind.TOOL:
                problems.add(
                    f"components[{draft.index}].kind",
                    f"a tool component needs workload.kind agentic (the ray runtime's tool is the agentic "
                    f"task's calculator); workload.kind is {workload.kind!r}",
                )
        if runtime.routing != RuntimeSpec().routing:
            problems.add(
                "runtime.routing", f"only applies when workload.kind is agentic (it is {workload.kind!r})"
            )
    if ComponentKind.REWARD not in kinds:
        problems.add(
            "components", "a job on the ray backend needs a reward component (its reward workers score)"
        )
    if runtime.kl_coef > 0 and ComponentKind.INFERENCE not in kinds:
        problems.add(
            "runtime.kl_coef" if top.has("runtime") else "components",
            "a KL penalty needs an inference component to serve the reference policy's log-probs",
        )
    if workload is None:
        return
    if workload.kind not in ("math", "agentic"):
        problems.add(
            "workload.kind", f"the ray runtime runs math and agentic workloads, not {workload.kind!r}"
        )
    if workload.staleness:
        problems.add("workload.staleness", "the ray runtime trains synchronously: staleness must be 0")
    terms = 2
    if agentic and workload.max_turns is not None:
        if not 2 <= workload.max_turns <= MAX_AGENTIC_TURNS:
            problems.add(
                "workload.max_turns",
                f"an agentic ray job's episode sums max_turns numbers, one calculator call per turn but the "
                f"last: it must be between 2 and {MAX_AGENTIC_TURNS}, got {workload.max_turns}",
            )
        terms = workload.max_turns
    longest = prompt_tokens(runtime.max_digits, terms) + workload.max_new_tokens
    if longest > runtime.model.max_positions:
        problems.add(
            "workload.max_new_tokens",
            f"the longest prompt ({prompt_tokens(runtime.max_digits, terms)} tokens at runtime.task.max_digits="
            f"{runtime.max_digits}{f' and {terms} terms' if agentic else ''}) plus {workload.max_new_tokens} "
            f"new tokens exceeds runtime.model.max_positions ({runtime.model.max_positions})",
        )
    batch = workload.samples_per_iteration
    for draft in drafts:
        if draft.kind is ComponentKind.ACTOR and draft.worker_count:
            sizes = sorted({draft.worker_count, *(draft.valid_dp or ())})
            if bad := [size for size in sizes if batch % size]:
                problems.add(
                    f"components[{draft.index}]",
                    f"the global batch ({batch} samples: prompts_per_iteration x samples_per_prompt) must "
                    f"split evenly over the trainer's data-parallel sizes; it does not over {bad}",
                )
            elif (
                draft.valid_dp == ()
                and draft.min_workers is not None
                and draft.max_workers_ok
                and draft.min_workers <= draft.worker_count <= (draft.max_workers or draft.worker_count)
            ):
                # The trainer keeps the global batch fixed at every size it is moved to, so a
                # size the batch does not split over is not one it can run: stating the sizes
                # here makes every policy, move and re-placement keep to them.
                draft.valid_dp = batch_sizes(batch, draft.min_workers, draft.max_workers)
