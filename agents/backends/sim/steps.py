"""Migration steps on a simulated host: what each step kind does to ``host.SimHost`` and how long
it takes (``scheduler.core.migration.StepKind``; docs/sim-backend.md, "Steps").

``HostSteps.begin`` applies a step's first effects at once and returns a ``StepPlan``: the
virtual seconds the step takes, and what it checks and returns when that time has passed (the
backend waits the time out in between). A step that cannot be carried out raises ``HostError``,
which the backend reports as ``StepFailed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agents.backends.sim.host import PAUSED_FOREVER_S, SimHost
from agents.backends.sim.model import SpecProblem
from agents.backends.sim.state import HostEpisode, HostError, HostJob, HostWorker, WorkerState
from agents.backends.step_payload import StepContext
from scheduler.core.migration import COMPENSATION, StepKind
from scheduler.core.sim.engine import SimRequest
from scheduler.core.sim.stages import ACTOR, REWARD, ROLLOUT, TOOL

STEP_KINDS = frozenset(k.value for k in StepKind)
COMPENSATING_KINDS = frozenset(k.value for k in COMPENSATION.values() if k is not None)
HANDOVER_S_PER_REQUEST = 0.001  # MigrationCostModel's per-request hand-over time
# A queued request shed to another engine carries no partial output or cache: the router only
# sends its prompt elsewhere, a tenth of what a taken-back request costs.
SHED_S_PER_REQUEST = 0.0001
HELD_SIDES_KEPT = 8  # take-back / shed sides whose requests a job keeps for retries


@dataclass
class StepPlan:
    """What a step does after its first effects: wait ``duration_s`` (virtual), then ``finish``."""

    duration_s: float
    finish: Callable[[], dict[str, Any]]


class HostSteps:
    """The migration steps of one host. Not thread-safe: ``SimBackend`` holds its lock around
    every call, as around the host's."""

    def __init__(self, host: SimHost) -> None:
        self.host = host

    def begin(self, ctx: StepContext) -> StepPlan:
        """Apply a step's first effects and say how long it takes; raises HostError."""
        handler = getattr(self, f"_step_{ctx.kind}", None) if ctx.kind in STEP_KINDS else None
        if handler is None:
            raise HostError(f"unknown step kind {ctx.kind!r}")
        if ctx.kind not in COMPENSATING_KINDS:
            self._refuse_time_shared(ctx)
        plan: StepPlan = handler(ctx)
        self.host.take_turns()
        return plan

    def _refuse_time_shared(self, ctx: StepContext) -> None:
        """Workers that take turns on shared devices are not resized: the planner does not move a
        time-shared device, and a step that would touch one fails before doing anything."""
        shared = [w.name for w in self._listed(ctx) if self.host.time_shared(w)]
        for uid in ctx.device_ids:
            index = self.host.local_device(uid)
            if index is not None and len(self.host.devices[index].holders) > 1:
                shared.append(uid)
        if shared:
            raise HostError(
                f"{', '.join(shared)} time-share devices (colocated placement); migration steps do not "
                "apply to them"
            )

    def _listed(self, ctx: StepContext) -> list[HostWorker]:
        return [
            self.host.workers[n]
            for n in ctx.worker_ids
            if n in self.host.workers and self.host.workers[n].job_id == ctx.job_id
        ]

    def _expected_here(self, ctx: StepContext) -> list[str]:
        """Listed workers that should run on this host: already here, or holding a device here."""
        expected = {w.name for w in self._listed(ctx)}
        for worker, devices in ctx.devices_by_worker().items():
            if any(self.host.local_device(d) is not None for d in devices):
                expected.add(worker)
        return sorted(expected)

    def _require_running(self, ctx: StepContext, *, need_state: bool = False) -> None:
        for name in self._expected_here(ctx):
            worker = self.host.workers.get(name)
            if worker is None or worker.job_id != ctx.job_id or not worker.alive:
                raise HostError(f"worker {name} is not running on {self.host.name}")
            if worker.state is WorkerState.STARTING:
                raise HostError(f"worker {name} on {self.host.name} is still starting")
            if need_state and worker.kind == ACTOR and not worker.member and not worker.has_state:
                raise HostError(f"rank {name} on {self.host.name} has not received the trainer state")

    def _job_for(self, ctx: StepContext) -> HostJob | None:
        return self.host.jobs.get(ctx.job_id)

    @staticmethod
    def _done(result: dict[str, Any] | None = None) -> Callable[[], dict[str, Any]]:
        return lambda: dict(result or {})

    def _fixed_p2p_s(self, ctx: StepContext) -> float:
        job = self._job_for(ctx)
        return job.model.cost.p2p_fixed_s if job else 0.0

    def _launch_s(self, ctx: StepContext) -> float:
        job = self._job_for(ctx)
        if job is None:
            return 0.0
        spec = job.model.group(ctx.group)
        if spec is not None and spec.kind in (REWARD, TOOL):
            return job.model.cost.restart_s
        return job.model.cost.engine_launch_s()

    # -- workload strategy (serving groups) ---------------------------------------------------------

    def _step_pause_workers(self, ctx: StepContext) -> StepPlan:
        paused = []
        for worker in self._listed(ctx):
            self._pause(worker)
            paused.append(worker.name)
        job = self._job_for(ctx)
        seconds = job.model.cost.workload_pause_s / 2 if job else 0.0
        return StepPlan(seconds, self._done({"paused": paused}))

    def _pause(self, worker: HostWorker) -> None:
        if worker.state is not WorkerState.RUNNING:
            return
        worker.state = WorkerState.PAUSED
        if worker.engine is not None:
            engine = worker.engine
            engine.commit(self.host.now)
            worker.paused_prefill_s = max(0.0, engine.origin - self.host.now)
            engine.pause(self.host.now, PAUSED_FOREVER_S)
        self.host.cancel_item(worker)
        job = self.host.jobs.get(worker.job_id)
        if job is not None:
            self.host.update_training(job)

    def _resume(self, worker: HostWorker) -> None:
        if worker.state is not WorkerState.PAUSED:
            return
        worker.state = WorkerState.RUNNING
        worker.taken_back = False
        if worker.engine is not None:
            worker.engine.origin = self.host.now + worker.paused_prefill_s
            worker.engine.epoch += 1
            self.host.admit(worker)
        job = self.host.jobs.get(worker.job_id)
        if job is not None:
            self.host.materialise(job)
            self.host.kick_consumers(job)
            self.host.update_training(job)

    def _step_resume_workers(self, ctx: StepContext) -> StepPlan:
        resumed = []
        for worker in self._listed(ctx):
            self._resume(worker)
            resumed.append(worker.name)
        job = self._job_for(ctx)
        seconds = job.model.cost.workload_pause_s / 2 if job else 0.0
        return StepPlan(seconds, self._done({"resumed": resumed}))

    def _step_take_back_requests(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is None:
            return StepPlan(0.0, self._done({"requests": []}))
        held = self._hold(job, ctx.side_key)
        for worker in self._listed(ctx):
            if worker.kind != ROLLOUT or worker.engine is None:
                continue  # log-prob and reward work is re-partitioned by membership instead
            self._pause(worker)
            held.extend(self._take_back(job, worker))
            worker.taken_back = True
        held.sort(key=lambda r: (r["iteration"], r["episode"]))
        requests = list(held)
        return StepPlan(job.model.cost.workload_pause_s / 2, lambda: {"requests": requests})

    def _step_shed_requests(self, ctx: StepContext) -> StepPlan:
        """A growing rollout's old members give up ``share`` of the requests queued on them (not
        yet running: no cache is lost) for redistribute_requests to hand to the new members."""
        job = self._job_for(ctx)
        if job is None:
            return StepPlan(0.0, self._done({"requests": []}))
        if ctx.side_key in job.held:  # another attempt: the same requests, nothing shed twice
            again = list(job.held[ctx.side_key])
            return StepPlan(0.0, lambda: {"requests": again})
        if not 0.0 <= ctx.share <= 1.0:
            raise HostError(f"step.share must be between 0 and 1, got {ctx.share}")
        held = self._hold(job, ctx.side_key)
        for worker in self._listed(ctx):
            if worker.kind != ROLLOUT or worker.engine is None:
                continue
            shed = self._detach(job, worker.engine.take_queued(int(len(worker.engine.local) * ctx.share)))
            self._forget(job, shed)
            held.extend(shed)
        held.sort(key=lambda r: (r["iteration"], r["episode"]))
        requests = list(held)
        return StepPlan(SHED_S_PER_REQUEST * len(requests), lambda: {"requests": requests})

    @staticmethod
    def _hold(job: HostJob, side_key: str) -> list[dict[str, Any]]:
        """The list a step's taken requests are kept in for its retries and compensation; only
        the last few migrations' are kept (a job runs one migration at a time)."""
        if side_key not in job.held:
            while len(job.held) >= HELD_SIDES_KEPT:
                del job.held[next(iter(job.held))]
        return job.held.setdefault(side_key, [])

    def _take_back(self, job: HostJob, worker: HostWorker) -> list[dict[str, Any]]:
        """Every unfinished episode the worker holds, with what it generated so far."""
        assert worker.engine is not None
        finished, taken = worker.engine.take_back_all(self.host.now)
        for request in finished:
            self.host.turn_done(worker, request)
        out = self._detach(job, taken)
        for episode in [
            e for e in job.episodes.values() if e.worker == worker.name and e.tool_until is not None
        ]:
            episode.tool_epoch += 1
            out.append(self._request_json(job, episode, episode.context, 0, job.model.max_new_tokens))
        self._forget(job, out)
        return out

    def _detach(self, job: HostJob, requests: Iterable[SimRequest]) -> list[dict[str, Any]]:
        """Requests taken off an engine, as handover entries with what they generated so far."""
        out: list[dict[str, Any]] = []
        for request in requests:
            episode = self.host.requests.pop(request.rid, None)
            if episode is None:
                continue
            episode.rid = None
            out.append(self._request_json(job, episode, request.context, request.generated, request.max_new))
        return out

    @staticmethod
    def _forget(job: HostJob, handed_over: Iterable[Mapping[str, Any]]) -> None:
        """Handed-over episodes are no longer this host's: whoever places them counts them."""
        for item in handed_over:
            key = (item["iteration"], item["episode"])
            job.episodes.pop(key, None)
            job.count(job.assigned, key[0], item["group"], -1)

    def _request_json(
        self, job: HostJob, episode: HostEpisode, context: int, generated: int, max_new: int
    ) -> dict[str, Any]:
        in_tool = episode.tool_until is not None
        return {
            "job": job.model.job_id,
            "group": episode.group,
            "iteration": episode.key[0],
            "episode": episode.key[1],
            "turn": episode.turn,
            "phase": "tool" if in_tool else "generate",
            "tool_wait_s": round(max(0.0, (episode.tool_until or self.host.now) - self.host.now), 6),
            "context_tokens": context,
            "generated_tokens": generated,
            "max_new_tokens": max_new,
            "from": episode.worker,
        }

    def _step_redistribute_requests(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        requests = ctx.handover.get("requests", [])
        if not isinstance(requests, list):
            raise HostError("handover.requests must be a list")
        if job is None or ctx.side_key in job.redistributed:
            return StepPlan(0.0, self._done({"placed": 0}))
        targets = sorted(ctx.worker_ids)
        placed: dict[str, int] = {}
        for position, raw in enumerate(requests):
            request = self._parse_request(job, raw, f"handover.requests[{position}]")
            if request is None or not targets:
                continue
            # The control plane names each request's worker ("to"); without it, in turn.
            named = raw.get("to")
            preferred = named if isinstance(named, str) else targets[position % len(targets)]
            target = self.host.runnable(job, request["group"], preferred)
            if target is None:
                if preferred in self.host.workers:
                    target = self._any_runnable(job, request["group"], position)
                if target is None:
                    continue  # another host's share
            if self._place(job, request, target):
                placed[target.name] = placed.get(target.name, 0) + 1
        job.redistributed.add(ctx.side_key)
        count = sum(placed.values())
        return StepPlan(HANDOVER_S_PER_REQUEST * count, self._done({"placed": count, "workers": placed}))

    def _step_return_requests(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is None:
            return StepPlan(0.0, self._done({"returned": 0}))
        requests = ctx.handover.get("requests", [])
        if not isinstance(requests, list):
            raise HostError("handover.requests must be a list")
        returned = 0
        for position, raw in enumerate(requests):
            request = self._parse_request(job, raw, f"handover.requests[{position}]")
            if request is None:
                continue
            worker = self.host.workers.get(str(request.get("from", "")))
            if worker is None or worker.job_id != job.model.job_id or not worker.alive:
                continue
            worker.taken_back = False
            if self._place(job, request, worker):
                returned += 1
        for name in ctx.worker_ids:
            if name in self.host.workers:
                self.host.workers[name].taken_back = False
        job.held.pop(ctx.side_key, None)
        return StepPlan(HANDOVER_S_PER_REQUEST * returned, self._done({"returned": returned}))

    def _any_runnable(self, job: HostJob, group: str, position: int) -> HostWorker | None:
        candidates = sorted(
            (
                w
                for w in self.host.workers_of(job.model.job_id, group=group)
                if self.host.runnable(job, group, w.name)
            ),
            key=lambda w: w.name,
        )
        return candidates[position % len(candidates)] if candidates else None

    def _parse_request(self, job: HostJob, raw: Any, path: str) -> dict[str, Any] | None:
        if not isinstance(raw, Mapping):
            raise HostError(f"{path}: must be an object")
        if raw.get("job") != job.model.job_id:
            return None
        out: dict[str, Any] = {}
        for key in ("iteration", "episode", "turn", "context_tokens", "generated_tokens", "max_new_tokens"):
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise HostError(f"{path}.{key}: must be an integer >= 0")
            out[key] = value
        group = raw.get("group")
        if not isinstance(group, str) or job.model.group(group) is None:
            raise HostError(f"{path}.group: not a group of job {job.model.job_id}")
        wait = raw.get("tool_wait_s", 0.0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
            raise HostError(f"{path}.tool_wait_s: must be a number >= 0")
        records = job.model.records(out["iteration"])
        if out["episode"] >= len(records):
            raise HostError(f"{path}.episode: iteration {out['iteration']} has {len(records)} episodes")
        if out["turn"] >= records[out["episode"]].turns:
            raise HostError(f"{path}.turn: episode has {records[out['episode']].turns} turns")
        out.update(
            group=group,
            phase=raw.get("phase", "generate"),
            tool_wait_s=float(wait),
            **{"from": raw.get("from")},
        )
        return out

    def _place(self, job: HostJob, request: Mapping[str, Any], target: HostWorker) -> bool:
        """Resume a handed-over episode on ``target``: its partial output is now prompt (re-prefilled
        here, no cache), and it may generate only what the turn has left."""
        key = (int(request["iteration"]), int(request["episode"]))
        if key in job.episodes or key in job.done_keys:
            return False
        record = job.model.records(key[0])[key[1]]
        episode = self.host.new_episode(job, key, str(request["group"]), record, target)
        episode.turn = int(request["turn"])
        episode.context = int(request["context_tokens"])
        if request["phase"] == "tool":
            self.host.call_tool(episode, self.host.now + float(request["tool_wait_s"]))
            return True
        generated = int(request["generated_tokens"])
        sim_request = self.host.new_request(
            episode,
            max_new=int(request["max_new_tokens"]),
            remaining=episode.response_tokens - generated,
            fresh=0,
        )
        sim_request.generated = generated
        self.host.enqueue(target, sim_request)
        return True

    def _step_release_devices(self, ctx: StepContext) -> StepPlan:
        released = [w.name for w in self._listed(ctx)]
        for name in released:
            self.host.remove_worker(name)
        freed = []
        for uid in ctx.device_ids:
            index = self.host.local_device(uid)
            if index is None:
                continue
            device = self.host.devices[index]
            if not device.holders:  # a device another worker holds is not this step's to free
                device.reserved_by = None
                freed.append(uid)
        return StepPlan(0.0, self._done({"released": released, "devices": freed}))

    # -- restart strategy (reward, tool) ------------------------------------------------------------

    def _step_drain(self, ctx: StepContext) -> StepPlan:
        for worker in self._listed(ctx):
            if worker.state is WorkerState.RUNNING:
                worker.state = WorkerState.DRAINING
        job = self._job_for(ctx)
        return StepPlan(job.model.cost.restart_s / 2 if job else 0.0, self._done())

    def _step_undrain(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        for worker in self._listed(ctx):
            if worker.state is WorkerState.DRAINING:
                worker.state = WorkerState.RUNNING
                if job is not None:
                    self.host.kick_consumer(job, worker)
                self.host.admit(worker)
        return StepPlan(0.0, self._done())

    def _step_stop_workers(self, ctx: StepContext) -> StepPlan:
        stopped = []
        for worker in self._listed(ctx):
            if worker.alive:
                self.host.cancel_item(worker)
                worker.state = WorkerState.STOPPED
                worker.epoch += 1
                stopped.append(worker.name)
        job = self._job_for(ctx)
        if job is not None:
            self.host.update_training(job)
        return StepPlan(job.model.cost.restart_s / 2 if job else 0.0, self._done({"stopped": stopped}))

    def _step_restart_workers(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        restarted = []
        for worker in self._listed(ctx):
            if worker.state is WorkerState.STOPPED:
                self.host.restart(worker)
                restarted.append(worker.name)
        seconds = job.model.cost.restart_s if job and restarted else 0.0
        return StepPlan(seconds, self._done({"restarted": restarted}))

    # -- growing a group: start, check, switch ------------------------------------------------------

    def _step_reserve_devices(self, ctx: StepContext) -> StepPlan:
        reserved = []
        for uid in ctx.device_ids:
            index = self.host.local_device(uid)
            if index is None:
                continue
            device = self.host.devices[index]
            if device.holders:
                raise HostError(f"device {uid} is held by {', '.join(device.holders)}")
            if device.reserved_by not in (None, ctx.migration_id):
                raise HostError(f"device {uid} is reserved by migration {device.reserved_by}")
            device.reserved_by = ctx.migration_id
            reserved.append(uid)
        return StepPlan(0.0, self._done({"reserved": reserved}))

    def _step_release_reservation(self, ctx: StepContext) -> StepPlan:
        for uid in ctx.device_ids:
            index = self.host.local_device(uid)
            if index is not None and self.host.devices[index].reserved_by == ctx.migration_id:
                self.host.devices[index].reserved_by = None
        return StepPlan(0.0, self._done())

    def _step_start_workers(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is None:
            raise HostError(f"job {ctx.job_id} is unknown on {self.host.name}")
        started: list[HostWorker] = []
        for name, devices in ctx.devices_by_worker().items():
            local = [self.host.local_device(d) for d in devices]
            indices = [i for i in local if i is not None]
            if not indices:
                continue
            if len(indices) != len(local):
                raise HostError(f"worker {name} would span {self.host.name} and other hosts")
            try:
                started.append(self.host.add_worker(job, name, ctx.group, indices, member=False))
            except SpecProblem as exc:
                raise HostError(str(exc)) from exc
        ready_at = max((w.ready_at for w in started), default=self.host.now)
        names = [w.name for w in started]

        def finish() -> dict[str, Any]:
            failed = [
                n
                for n in names
                if n not in self.host.workers or self.host.workers[n].state is not WorkerState.RUNNING
            ]
            if failed:
                raise HostError(f"workers {failed} did not start on {self.host.name}")
            return {"started": names}

        return StepPlan(max(0.0, ready_at - self.host.now), finish)

    def _step_destroy_new(self, ctx: StepContext) -> StepPlan:
        destroyed = [w.name for w in self._listed(ctx) if not w.member]
        for name in destroyed:
            self.host.remove_worker(name)
        return StepPlan(0.0, self._done({"destroyed": destroyed}))

    def _step_health_check(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx)
        return StepPlan(0.3 * self._launch_s(ctx), self._done({"healthy": self._expected_here(ctx)}))

    # -- p2p strategy (the trainer) -----------------------------------------------------------------

    def _step_transfer_state(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        expected = self._expected_here(ctx)
        if job is None:
            if expected:
                raise HostError(f"job {ctx.job_id} is unknown on {self.host.name}")
            return StepPlan(0.0, self._done())
        self._require_running(ctx)
        listed = self._listed(ctx)
        members = set(self.host.members(job, ctx.group))
        spec = job.model.group(ctx.group)
        per_worker = spec.gpus_per_worker if spec else 1
        receiving = [w for w in ctx.worker_ids if w not in members]
        if receiving:  # a growing trainer: the new ranks receive their shards
            gpus_after = (len(members) + len(receiving)) * per_worker
        else:  # a shrinking trainer: the staying ranks receive the leaving ranks' shards
            gpus_after = max(1, len(members) - len(ctx.worker_ids)) * per_worker
        shard_gb = job.model.cost.trainer_state_gb / max(gpus_after, 1)
        seconds = shard_gb / job.model.cost.p2p_bandwidth_gb_s if expected else 0.0

        def finish() -> dict[str, Any]:
            for worker in listed:
                if self.host.workers.get(worker.name) is not worker or not worker.alive:
                    raise HostError(f"worker {worker.name} stopped during the transfer")
                if not worker.member:
                    worker.has_state = True
            return {"shard_gb": round(shard_gb, 6), "workers": [w.name for w in listed]}

        return StepPlan(seconds, finish)

    def _step_discard_transfer(self, ctx: StepContext) -> StepPlan:
        for worker in self._listed(ctx):
            if not worker.member:
                worker.has_state = False
        return StepPlan(0.0, self._done())

    def _step_rebuild_groups(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx)
        job = self._job_for(ctx)
        if job is not None:
            job.rebuilt[ctx.group] = tuple(sorted(ctx.worker_ids))
        return StepPlan(0.6 * self._fixed_p2p_s(ctx), self._done({"members": sorted(ctx.worker_ids)}))

    def _step_restore_groups(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is not None:
            job.rebuilt.pop(ctx.group, None)
        return StepPlan(0.6 * self._fixed_p2p_s(ctx), self._done())

    def _step_barrier(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx, need_state=True)
        return StepPlan(0.3 * self._fixed_p2p_s(ctx), self._done({"ranks": self._expected_here(ctx)}))

    def _step_switch(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx, need_state=True)
        seconds = 0.1 * (self._fixed_p2p_s(ctx) if ctx.strategy == "p2p" else self._launch_s(ctx))
        members = tuple(sorted(ctx.worker_ids))

        def finish() -> dict[str, Any]:
            # Checked again at the flip: a rank lost while waiting fails the switch, which then
            # did not happen (the old membership stands).
            self._require_running(ctx, need_state=True)
            job = self._job_for(ctx)
            local: list[str] = []
            if job is not None:
                for worker in self.host.workers_of(ctx.job_id, group=ctx.group):
                    worker.member = worker.name in members
                    if worker.member:
                        local.append(worker.name)
                job.overrides[ctx.group] = members
                self.host.materialise(job)
                self.host.kick_consumers(job)
                self.host.update_training(job)
            return {"members": sorted(local)}

        return StepPlan(seconds, finish)

    def _step_destroy_old(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        destroyed = []
        # The listed workers are the ranks the switch left out; their host may not have taken part
        # in the switch (it holds no staying rank), so they stop whatever their local membership.
        for worker in self._listed(ctx):
            worker.member = False
            if worker.alive:
                self.host.cancel_item(worker)
                worker.state = WorkerState.STOPPED
                worker.epoch += 1
                destroyed.append(worker.name)
        if job is not None:
            job.rebuilt.pop(ctx.group, None)
            self.host.update_training(job)
        return StepPlan(0.0, self._done({"destroyed": destroyed}))
