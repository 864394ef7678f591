"""How long a migration takes, by strategy. Shared by the policies, the planner and the simulator.

Defaults follow the DynaRL paper's measurements (each reallocation 0.5-5 s; trainer migration
under 0.5% of end-to-end time even at 32B / 128 GPUs) and ordinary hardware figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.core.hypergraph import MigrationStrategy

# Mixed-precision Adam: bf16 params (2) + bf16 grads (2) + fp32 master params (4) + Adam m and v (8).
TRAINER_STATE_BYTES_PER_PARAM = 16.0
GB = 1e9


@dataclass(frozen=True)
class MigrationCostModel:
    """Seconds a move costs, given the model size and what has to travel."""

    model_params_b: float  # billions of parameters
    p2p_bandwidth_gb_s: float = 25.0  # per receiving GPU; ~200 Gb/s InfiniBand per GPU
    restart_s: float = 2.0  # stop + start a light stateless worker (reward, tool)
    engine_start_s: float = 3.0  # bring up an inference engine on a GPU with weights already cached
    workload_pause_s: float = 0.3  # pause donors and take back pending / in-flight requests
    p2p_fixed_s: float = 0.5  # rebuild communication groups + barrier + switch
    # What a deployment adds to the figures above (control-plane round trips per step, slow
    # hosts): the measured / modelled duration of the job's recent migrations; 1 until measured.
    measured_scale: float = 1.0
    # How long this deployment took to bring the job's own serving workers up, from placing one
    # to its running (engine start, weights load, the agent's round trip); None until measured.
    # A new engine cannot start faster than that, so it floors the modelled engine start.
    worker_start_measured_s: float | None = None

    @property
    def trainer_state_gb(self) -> float:
        return self.model_params_b * 1e9 * TRAINER_STATE_BYTES_PER_PARAM / GB

    def estimate_s(
        self,
        strategy: MigrationStrategy,
        *,
        gpus_moved: int,
        recipient_gpus_after: int,
        requests_taken_back: int = 0,
    ) -> float:
        """Wall time of one move from decision to switch, in seconds."""
        return self.measured_scale * self._modelled_s(
            strategy,
            gpus_moved=gpus_moved,
            recipient_gpus_after=recipient_gpus_after,
            requests_taken_back=requests_taken_back,
        )

    def _modelled_s(
        self,
        strategy: MigrationStrategy,
        *,
        gpus_moved: int,
        recipient_gpus_after: int,
        requests_taken_back: int,
    ) -> float:
        if gpus_moved <= 0:
            return 0.0
        if strategy is MigrationStrategy.RESTART:
            return self.restart_s
        if strategy is MigrationStrategy.WORKLOAD:
            # Re-queued requests are re-prefilled by the remaining workers; that cost lands on
            # the workload itself (the simulator charges it), the move pays pause + hand-over.
            return self.workload_pause_s + 0.001 * requests_taken_back
        # p2p: each new rank receives its shard of the full trainer state from the old ranks,
        # in parallel across receivers; then groups are rebuilt and everyone switches.
        shard_gb = self.trainer_state_gb / max(recipient_gpus_after, 1)
        return self.p2p_fixed_s + shard_gb / self.p2p_bandwidth_gb_s

    def engine_launch_s(self) -> float:
        """Starting a fresh engine on a GPU given to a serving group."""
        modelled = self.measured_scale * self.engine_start_s
        if self.worker_start_measured_s is None:
            return modelled
        return max(modelled, self.worker_start_measured_s)
