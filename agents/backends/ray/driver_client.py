"""What a node agent asks of its jobs' drivers (``agents.backends.ray.driver``), and reads of the
job's spec the agent and the driver share.

The driver is one detached actor per job that runs the RL loop; an agent starts it when it first
launches a worker of the job (``ensure_driver``: by name, with ``get_if_exists``, so exactly one
exists), hands it the control plane's picture of the job from each heartbeat reply (``observe``),
and reads its progress for the heartbeat (``driver_progress``, ``progress_entry``). This module
stays free of the training stack: the driver's own module imports megatron-core and the RL loop,
which an agent only needs the first time it starts a driver, not on every restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agents.backends.ray.actors import JOB_DRIVER_ACTOR, actor_class, job_of, kill_actor
from agents.backends.ray.connection import RayNode
from runtime.model.config import GPTConfig
from runtime.rl.grpo import GRPOConfig
from runtime.rl.job import RLJobConfig
from runtime.task.arithmetic import TaskConfig
from runtime.task.tokenizer import CharTokenizer

CALL_TIMEOUT_S: Final = 2.0
DRIVER_PREFIX: Final = "dynarl-job-"
RESULTS_SENT: Final = 8  # the latest iteration results each heartbeat repeats (kept once by iteration)
ENGINE_MAX_RUNNING: Final = 64
# The runtime's own settings, not the spec's: the asymmetric clip of DAPO (more room to raise a
# good token's probability than to lower it) and a short warm-start warmup, as tuned in
# tests/runtime/rl/test_loop.py.
CLIP_LOW: Final = 0.2
CLIP_HIGH: Final = 0.28
WARM_START_WARMUP_STEPS: Final = 10
# The kinds whose workers a restart migration moves (they hold no state).
RESTARTED_KINDS: Final = ("reward", "tool")


# The step kinds the driver carries out, once for all of a step's nodes, per strategy.
P2P_KINDS: Final = frozenset(
    {"transfer_state", "discard_transfer", "rebuild_groups", "restore_groups", "barrier", "switch"}
)
WORKLOAD_KINDS: Final = frozenset(
    {
        "pause_workers",
        "resume_workers",
        "take_back_requests",
        "return_requests",
        "redistribute_requests",
        "release_devices",
        "switch",
        "shed_requests",
    }
)


def driver_name(job_id: int) -> str:
    return f"{DRIVER_PREFIX}{job_id}"


def rl_config(spec: Mapping[str, Any]) -> RLJobConfig:
    """The RL job a stored spec (``JobSpec.to_json()``) describes; ValueError when the ray runtime
    cannot run it (the spec parser refuses those already; this guards the backend's own door)."""
    runtime = spec.get("runtime")
    workload = spec.get("workload")
    if not isinstance(runtime, Mapping) or not isinstance(workload, Mapping):
        raise ValueError("the spec has no runtime section (the model, task and training a real job runs)")
    if workload.get("kind") not in ("math", "agentic"):
        raise ValueError(f"the ray runtime runs math and agentic workloads, not {workload.get('kind')!r}")
    agentic = workload.get("kind") == "agentic"
    try:
        return RLJobConfig(
            model=GPTConfig(vocab_size=CharTokenizer().vocab_size, **runtime["model"]),
            task=TaskConfig(
                max_digits=int(runtime["task"]["max_digits"]),
                zipf_exponent=float(runtime["task"]["zipf_exponent"]),
                # An agentic episode sums max_turns numbers: a calculator call per turn but the last.
                calculator=agentic,
                max_terms=int(workload["max_turns"]) if agentic else 2,
            ),
            tool_latency_s=float(workload["tool_latency_s"]) if agentic else 0.0,
            routing=str(runtime.get("routing", "priority")),
            seed=int(runtime["seed"]),
            iterations=int(workload["iterations"]),
            prompts_per_iteration=int(workload["prompts_per_iteration"]),
            group_size=int(workload["samples_per_prompt"]),
            max_new_tokens=int(workload["max_new_tokens"]),
            temperature=float(runtime["temperature"]),
            learning_rate=float(runtime["learning_rate"]),
            micro_batch_size=int(runtime["micro_batch_size"]),
            ppo_epochs=int(runtime.get("ppo_epochs", 1)),
            grpo=GRPOConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=float(runtime["kl_coef"])),
            dataset_size=None if runtime.get("dataset_size") is None else int(runtime["dataset_size"]),
            warm_start_steps=int(runtime["warm_start_steps"]),
            warm_start_warmup_steps=WARM_START_WARMUP_STEPS,
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the spec's runtime section is incomplete: {exc}") from exc


def requested_engine(spec: Mapping[str, Any]) -> str:
    """The spec's ``runtime.engine`` (``auto`` for specs stored before it existed)."""
    runtime = spec.get("runtime")
    return str(runtime.get("engine", "auto")) if isinstance(runtime, Mapping) else "auto"


def engine_settings(config: RLJobConfig) -> dict[str, Any]:
    """A job's engine settings as a launch passes them to the actor (plain values)."""
    return dict(vars(config.engine_settings(max_running_requests=ENGINE_MAX_RUNNING)))


# -- the agents' side ---------------------------------------------------------------------------


def ensure_driver(job_id: int, spec: Mapping[str, Any], node: RayNode, checkpoint_dir: str) -> Any:
    """The job's driver, started near ``node`` unless another agent started it first."""
    existing = driver_handle(job_id)
    if existing is not None:
        return existing
    return (
        ray.remote(actor_class(JOB_DRIVER_ACTOR))
        .options(
            name=driver_name(job_id),
            get_if_exists=True,
            lifetime="detached",
            max_restarts=0,  # a driver that died has lost the job's loop: the job fails
            num_cpus=0,
            # The agents' calls (progress, observe, a migration's steps from several nodes) run
            # beside one another; the loop has a thread of its own.
            max_concurrency=8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=True),
        )
        .remote(job_id, dict(spec), checkpoint_dir)
    )


def driver_handle(job_id: int) -> Any | None:
    try:
        return ray.get_actor(driver_name(job_id))
    except ValueError:
        return None


def job_actors(job_id: int) -> list[str]:
    """Names of the job's worker actors alive anywhere in the cluster (``<node>/<worker>``)."""
    return [name for name in ray.util.list_named_actors() if job_of(name.rpartition("/")[2]) == job_id]


def stop_driver(job_id: int, *, timeout_s: float = 30.0) -> None:
    handle = driver_handle(job_id)
    if handle is not None:
        kill_actor(handle, driver_name(job_id), timeout_s=timeout_s)


def observe(job_id: int, view: Mapping[str, Any]) -> None:
    """Hand the control plane's picture of the job to its driver (not waited for)."""
    handle = driver_handle(job_id)
    if handle is not None:
        handle.observe.remote(dict(view))


def driver_progress(job_id: int) -> dict[str, Any] | None:
    """The driver's progress, or None when it does not answer in time. A driver that is gone
    (died, or killed) answers ``{"failure": ...}``."""
    handle = driver_handle(job_id)
    if handle is None:
        return {"failure": f"the job's driver ({driver_name(job_id)}) is gone"}
    try:
        progress: dict[str, Any] = ray.get(handle.progress.remote(), timeout=CALL_TIMEOUT_S)
    except GetTimeoutError:
        return None
    except RayActorError as exc:
        return {"failure": f"the job's driver ({driver_name(job_id)}) died: {exc}"}
    return progress


def progress_entry(
    job_id: int, progress: Mapping[str, Any] | None, mine: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """This node's heartbeat entry for the job: its workers' part of the current iteration (the
    rollout's samples are summed over nodes by the control plane, the trainer's are the gang's),
    the trained iteration, the latest results and a failure."""
    progress = progress or {}
    iteration = int(progress.get("iteration", 0))
    trained = progress.get("trained_iteration")
    groups: dict[str, dict[str, int]] = {}
    per_worker: Mapping[str, Sequence[int]] = progress.get("samples", {})
    for payload in mine:
        group = str(payload.get("group"))
        done, assigned = per_worker.get(str(payload.get("worker")), (0, 0))
        counts = groups.setdefault(group, {"completed": 0, "assigned": 0})
        if payload.get("kind") == "actor":
            trained_samples = int(progress.get("trained_samples", 0))
            counts.update(completed=trained_samples, assigned=int(progress.get("batch", 0)))
        else:
            counts["completed"] += int(done)
            counts["assigned"] += int(assigned)
    entry: dict[str, Any] = {
        "job": job_id,
        "iteration": iteration,
        "groups": groups,
        "trained_iteration": trained if isinstance(trained, int) and trained <= iteration else None,
    }
    results = progress.get("results", [])
    if results:
        entry["results"] = list(results[-RESULTS_SENT:])
    if progress.get("failure"):
        entry["failure"] = str(progress["failure"])[:2000]
    return entry
