"""A node's workers as Ray actors pinned to that node, holding the devices the control plane gave.

Every worker is a named, detached actor (``<node>/<worker>`` in the agent's namespace): it outlives
an agent restart, and the agent finds its node's workers again by name. Placement is the control
plane's, not Ray's: the actor is pinned to this agent's Ray node (``NodeAffinitySchedulingStrategy``,
not soft) and sees exactly its assigned devices through ``CUDA_VISIBLE_DEVICES``, which we set and
Ray is told to leave alone. Ray still counts the GPUs a worker holds alone (``num_gpus``), so other
Ray work does not land on them; devices a worker time-shares with others of its job (a colocated
placement) are counted by none of them.

The agent starts a worker with what its own node knows (the job's spec, the worker's kind and
devices); what needs the whole job (the trainer's ranks and world, the warm-start weights, the
engines' addresses) is given later by the job's driver (``agents.backends.ray.driver``). Kinds:

- ``rollout`` and ``inference``: ``EngineWorker``, an engine serving SGLang's HTTP protocol on a
  free port of its node (real SGLang on a CUDA host that has it, else the CPU stand-in,
  ``runtime.engine``); an ``inference`` engine
  scores responses under the frozen reference weights (input-token log-probs);
- ``actor``: ``TrainerRankWorker`` (``agents.backends.ray.trainer_rank``, a module of its own so
  that the other workers' processes do not import megatron-core), one data-parallel rank of the
  trainer (``runtime.rl.trainer``); rank 0 hosts the TCP store its peers join, and the
  weight-update group of the engines;
- ``reward``: ``RewardWorker``, the rule-based exact-match reward;
- ``tool``: ``ToolWorker``, the agentic job's calculator (``runtime.task.calculator``).

Each worker also answers ``usage()``: what it did so far (busy seconds, tokens, its process's CPU
time), from which the agent's telemetry takes differences.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

import psutil
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agents.backends.ray.connection import RayNode
from runtime.engine.cpu_engine import CpuEngine, EngineSettings
from runtime.engine.cpu_server import CpuEngineServer
from runtime.engine.model import init_random_gpt
from runtime.engine.sglang_server import SGLangServer, choose_engine
from runtime.model.checkpoint import save_checkpoint
from runtime.model.config import GPTConfig
from runtime.task.arithmetic import Problem, score
from runtime.task.calculator import Calculator, ToolCallError
from runtime.task.tokenizer import BOS_ID, EOS_ID, PAD_ID

# Ray sets CUDA_VISIBLE_DEVICES to the GPU ids it picked unless told not to.
KEEP_OUR_DEVICES: Final = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
ENGINE_KINDS: Final = ("rollout", "inference")
WORKER_THREADS: Final = 2
# Calls one tool worker serves at once: the calculator's latency stands for a remote tool's.
TOOL_CONCURRENCY: Final = 16
# How long a kill waits for an actor to say which process it runs in; a busy one is killed unasked.
PROCESS_PROBE_S: Final = 2.0


# The control plane names a job's workers j<job>-<group>-w<i> at launch and <group>-m<job>-<decision>-w<k>
# when a migration adds them (scheduler/core/migration.py).
WORKER_NAME: Final = re.compile(r"^(?:j(?P<job>\d+)-|[^/]+?-m(?P<migrated>\d+)-\d+-w\d+$)")


# Actors whose modules import the training stack (megatron-core, and torch's compiler with it:
# seconds of imports), named rather than imported here: an agent loads one the first time it starts
# such an actor (``actor_class``), and a restarted agent that finds its workers and its jobs'
# drivers running does not load it at all.
TRAINER_RANK_ACTOR: Final = "agents.backends.ray.trainer_rank:TrainerRankWorker"
JOB_DRIVER_ACTOR: Final = "agents.backends.ray.driver:JobDriver"


@functools.cache
def imported_class(path: str) -> type:
    """The class ``path`` (``module:Class``) names, imported on first use."""
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not isinstance(cls, type):
        raise TypeError(f"{path} names {type(cls).__name__}, not an actor class")
    return cls


class ForwardingActor:
    """The base of ``actor_class``'s classes: built in the actor's process, it builds the class
    ``target`` names there and hands every call to it."""

    target: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.forwarded_to = imported_class(self.target)(*args, **kwargs)


def _forwarding(name: str) -> Callable[..., Any]:
    def forward(self: ForwardingActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.forwarded_to, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


@functools.cache
def actor_class(path: str) -> type:
    """What an actor of the class ``path`` names is started from: a class with its public
    methods, each handing the call on to an instance of it that the actor's process builds.

    Ray keeps an actor's class in the cluster and loads it into every process that gets a handle
    to the actor, ``ray.get_actor`` included. A class of a module is kept by reference, so that
    loading it imports the module: for the trainer's ranks and the job's driver, the training
    stack, in every agent that merely looks its workers up after a restart. This class is made
    here at run time, so Ray keeps it by value, and loading it imports this module only."""
    cls = imported_class(path)
    methods = {
        name: _forwarding(name)
        for name, _ in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }
    return type(
        cls.__name__,
        (ForwardingActor,),
        {
            "__module__": __name__,
            "__qualname__": f"{cls.__name__}Forwarder",
            "__doc__": cls.__doc__,
            "target": path,
            **methods,
        },
    )


def job_of(worker: str) -> int | None:
    """The job a worker belongs to, from its name; None for a name of neither form."""
    match = WORKER_NAME.match(worker)
    if match is None:
        return None
    return int(match.group("job") or match.group("migrated"))


def actor_name(node: str, worker: str) -> str:
    return f"{node}/{worker}"


def actor_options(node: RayNode, worker: str, devices: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Ray options for ``worker`` on ``node`` with its ``devices`` (the launch payload's entries:
    ``index`` on the host, ``shared`` when time-shared)."""
    visible = ",".join(str(int(d["index"])) for d in devices)
    exclusive = sum(1 for d in devices if not d.get("shared"))
    return {
        "name": actor_name(node.name, worker),
        "lifetime": "detached",
        "max_restarts": 0,  # a worker that dies is reported lost; the control plane decides what next
        # A second thread answers the agent's usage() while a long call (a trainer step) runs.
        "max_concurrency": WORKER_THREADS,
        "num_cpus": 0,  # CPU threads are each worker's own (one torch thread on CPU hosts)
        "num_gpus": exclusive,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": visible, **KEEP_OUR_DEVICES}},
    }


def node_ip() -> str:
    """The address peers on other nodes reach this worker's node at."""
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class WorkerUsage:
    """What a worker did since it started; the agent reports differences between two readings."""

    busy_s: float = 0.0  # seconds spent working (a trainer step, scoring)
    waiting_s: float = 0.0  # seconds between calls, after the first: waiting for input (data to train on)
    tokens: int = 0  # generated (engines) or trained on (trainer ranks)
    items: int = 0  # requests finished, responses scored, steps taken
    cpu_s: float = 0.0  # the worker process's CPU time (user + system)


def process_cpu_seconds() -> float:
    times = os.times()
    return float(times.user + times.system)


class Usage:
    """Busy-time bookkeeping shared by the workers that work in calls (trainer, reward, tool).
    Calls may overlap (a tool worker's do): the worker is busy while at least one runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy_s = 0.0
        self._waiting_s = 0.0
        self._tokens = 0
        self._items = 0
        self._running = 0
        self._busy_since = 0.0
        self._idle_since: float | None = None

    def begin(self) -> float:
        now = time.monotonic()
        with self._lock:
            if self._running == 0:
                if self._idle_since is not None:
                    self._waiting_s += now - self._idle_since
                self._idle_since = None
                self._busy_since = now
            self._running += 1
        return now

    def end(self, started: float, *, tokens: int = 0, items: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self._running -= 1
            self._tokens += tokens
            self._items += items
            if self._running == 0:
                self._busy_s += now - self._busy_since
                self._idle_since = now

    def reading(self) -> WorkerUsage:
        with self._lock:
            now = time.monotonic()
            # A wait or a call still going on counts up to now, so a long one shows while it lasts.
            waiting = 0.0 if self._idle_since is None else now - self._idle_since
            busy = now - self._busy_since if self._running else 0.0
            return WorkerUsage(
                busy_s=self._busy_s + busy,
                waiting_s=self._waiting_s + waiting,
                tokens=self._tokens,
                items=self._items,
                cpu_s=process_cpu_seconds(),
            )


class EngineWorker:
    """A rollout or inference engine serving SGLang's HTTP protocol on a free port of its node,
    reachable from the other nodes: a real SGLang server where SGLang and CUDA are present (a
    child process of this actor, which dies with it), else the CPU stand-in. ``requested`` is
    the spec's ``runtime.engine``; `describe` says which engine runs and why."""

    def __init__(self, config_json: str, settings: Mapping[str, Any], requested: str = "auto") -> None:
        torch.set_num_threads(1)
        config = GPTConfig.from_json(config_json)
        engine_settings = EngineSettings(**settings)
        self._kind, self._note = choose_engine(requested)
        self._engine: CpuEngine | None = None
        self._sglang: SGLangServer | None = None
        if self._kind == "sglang":
            # SGLang starts from a checkpoint: the seeded random model the CPU engine would start
            # with; the job's driver then loads the warm start through /update_weights_from_disk.
            start = Path(tempfile.mkdtemp(prefix="dynarl-engine-start-")) / "model"
            save_checkpoint(
                start,
                init_random_gpt(config, seed=engine_settings.seed).state_dict(),
                config,
                bos_token_id=BOS_ID,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
            )
            self._sglang = SGLangServer(
                start,
                host=node_ip(),
                port=free_port(),
                max_running_requests=engine_settings.max_running_requests,
                weight_version=engine_settings.weight_version,
                seed=engine_settings.seed,
            )
            self._url = self._sglang.start()
        else:
            self._engine = CpuEngine(config, engine_settings)
            self._url = CpuEngineServer(self._engine, host=node_ip()).start()

    def url(self) -> str:
        return self._url

    def describe(self) -> dict[str, str]:
        """Which engine serves (``sglang`` or ``cpu``) and, for the stand-in, why."""
        return {"engine": self._kind, "note": self._note, "url": self._url}

    def visible_devices(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def usage(self) -> WorkerUsage:
        if self._sglang is not None:
            tokens, requests = self._sglang.counters()
            return WorkerUsage(tokens=tokens, items=requests, cpu_s=process_cpu_seconds())
        assert self._engine is not None
        state = self._engine.state()
        return WorkerUsage(
            tokens=int(state["generated_tokens"]),
            items=int(state["finished_requests"]),
            cpu_s=process_cpu_seconds(),
        )


class RewardWorker:
    """The rule-based reward: exact match of the response's final answer."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._usage = Usage()

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> list[float]:
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
        started = self._usage.begin()
        rewards = [score(problem, text) for problem, text in zip(problems, responses, strict=True)]
        self._usage.end(started, items=len(rewards))
        return rewards

    def usage(self) -> WorkerUsage:
        return self._usage.reading()


class ToolWorker:
    """The agentic job's tool: the calculator, with the job's latency per call. Calls run
    concurrently (``TOOL_CONCURRENCY``): a tool worker waits on its tool, not on a core."""

    def __init__(self, latency_s: float) -> None:
        torch.set_num_threads(1)
        self._calculator = Calculator(latency_s=latency_s)
        self._usage = Usage()

    def call(self, expression: str) -> str | None:
        """The calculator's answer, or None for an expression it refuses."""
        started = self._usage.begin()
        try:
            return self._calculator.call(expression)
        except ToolCallError:
            return None
        finally:
            self._usage.end(started)

    def usage(self) -> WorkerUsage:
        return self._usage.reading()


def free_port() -> int:
    """A port free on this node now (the caller binds it next)."""
    with socket.socket() as probe:
        probe.bind((node_ip(), 0))
        return int(probe.getsockname()[1])


def start_engine_worker(
    node: RayNode,
    worker: str,
    devices: Sequence[Mapping[str, Any]],
    config: GPTConfig,
    settings: EngineSettings,
    *,
    timeout_s: float = 60.0,
) -> str:
    """Start ``worker``'s engine on ``node``; returns its URL once it serves."""
    handle = start_worker_actor(node, worker, devices, EngineWorker, config.to_json(), asdict(settings))
    return str(ray.get(handle.url.remote(), timeout=timeout_s))


def start_worker_actor(
    node: RayNode, worker: str, devices: Sequence[Mapping[str, Any]], cls: type, *args: Any
) -> Any:
    """Start ``worker`` as an actor of ``cls`` on ``node`` holding ``devices``; returns its handle
    at once (the actor may still be starting)."""
    options = actor_options(node, worker, devices)
    if cls is ToolWorker:
        options["max_concurrency"] = TOOL_CONCURRENCY
    return ray.remote(cls).options(**options).remote(*args)


def worker_handle(node: str, worker: str) -> Any | None:
    """The live actor of ``worker`` on ``node``, or None."""
    try:
        return ray.get_actor(actor_name(node, worker))
    except ValueError:
        return None


def node_workers(node: str) -> list[str]:
    """The workers whose actors live on ``node`` (by name, in the agent's namespace)."""
    prefix = f"{node}/"
    return sorted(name[len(prefix) :] for name in ray.util.list_named_actors() if name.startswith(prefix))


def stop_worker(node: str, worker: str, *, timeout_s: float = 30.0) -> bool:
    """End ``worker``'s actor; False when it was not running. Returns once its name is free."""
    handle = worker_handle(node, worker)
    if handle is None:
        return False
    kill_actor(handle, actor_name(node, worker), timeout_s=timeout_s)
    return True


@dataclass(frozen=True)
class ActorProcess:
    """Which process an actor runs in: its host, pid and start time (a pid alone can be reused)."""

    host: str
    pid: int
    started: float

    def running_here(self) -> bool:
        """Whether this process still runs, seen from this host; False for another host's."""
        if self.host != socket.gethostname():
            return False
        try:
            process = psutil.Process(self.pid)
            # A zombie has ended (its sockets closed); only its parent's reaping is left.
            return process.create_time() == self.started and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def this_process() -> ActorProcess:
    process = psutil.Process()
    return ActorProcess(host=socket.gethostname(), pid=process.pid, started=process.create_time())


def actor_process(handle: Any, *, timeout_s: float) -> ActorProcess | None:
    """The actor's process, or None when the actor does not answer within ``timeout_s`` (still
    starting, busy in a call, or dead)."""
    try:
        found = ray.get(handle.__ray_call__.remote(lambda _actor: this_process()), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
    return found if isinstance(found, ActorProcess) else None


def kill_actor(handle: Any, name: str, *, timeout_s: float) -> None:
    """Kill an actor and return once it is dead (calls to it failing, its process gone when it ran
    on this host and answered who it was) and its name is free for a new one."""
    deadline = time.monotonic() + timeout_s
    # Ray reports an actor dead as soon as it is told to kill it, a moment before its process (and
    # what that process serves, such as an engine's port) has ended; so learn the process first.
    process = actor_process(handle, timeout_s=min(PROCESS_PROBE_S, timeout_s))
    ray.kill(handle, no_restart=True)
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=max(0.0, deadline - time.monotonic()))
    except ray.exceptions.RayActorError:
        pass
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(f"the actor {name} was still alive {timeout_s:g} s after it was killed") from exc
    while process is not None and process.running_here():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the process of actor {name} still runs {timeout_s:g} s after it was killed")
        time.sleep(0.05)  # a process of another parent offers no exit event to wait on
    while name in ray.util.list_named_actors():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the actor {name} still exists {timeout_s:g} s after it was killed")
        time.sleep(0.05)  # Ray frees the name asynchronously and offers no event to wait on
