"""The simulator's performance model: how long engines, log-prob workers and the trainer take.

Roofline-style and deliberately simple; every constant is listed in ``PerfParams`` and explained in
docs/simulator.md. Decode is memory-bound (each step reads the weights and every running sequence's
KV cache), prefill and training are compute-bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.costs import TRAINER_STATE_BYTES_PER_PARAM
from scheduler.core.sim.hardware import GB, HardwareSpec, ModelSpec


@dataclass(frozen=True)
class PerfParams:
    """Efficiency constants of the model (see docs/simulator.md for their sources)."""

    hbm_efficiency: float = 0.8  # achieved fraction of HBM bandwidth by decode kernels
    decode_step_overhead_s: float = 0.001  # scheduler + launch per decode step (CUDA graphs on)
    tp_allreduce_s: float = 10e-6  # one small all-reduce over NVLink; two per layer per step
    decode_mfu: float = 0.5  # GEMM efficiency when a large decode batch turns compute-bound
    prefill_mfu: float = 0.5
    prefill_overhead_s: float = 0.002  # per prefill batch
    engine_mem_fraction: float = 0.85  # SGLang mem_fraction_static: weights + KV pool
    # A colocated engine shares its GPUs with the trainer's resident state; verl's GRPO examples
    # set rollout.gpu_memory_utilization=0.6.
    colocated_engine_mem_fraction: float = 0.6
    kv_reserve_ratio: float = 0.3  # share of a request's remaining max_new_tokens reserved at admission
    network_gb_s: float = 25.0  # per GPU across nodes (200 Gb/s InfiniBand)
    pcie_gb_s: float = 25.0  # host <-> device, for colocated offload / onload
    grad_comm_exposed: float = 0.5  # share of the gradient reduce-scatter / all-gather not overlapped
    weight_sync_fixed_s: float = 0.5  # trainer -> engines weight update, fixed part
    colocate_switch_fixed_s: float = 2.0  # colocated phase switch: memory release / re-init, fixed part


@dataclass(frozen=True)
class EngineCoeffs:
    """Decode step time of one engine: ``fixed + max(weights + per_context_token * C, per_seq * B)``.

    ``C`` is the total context (KV tokens) of the running batch and ``B`` its size.
    """

    fixed_s: float
    weights_s: float
    per_context_token_s: float
    per_sequence_s: float
    prefill_s_per_flop: float
    prefill_overhead_s: float
    params: float
    layers: int
    hidden: int
    kv_capacity_tokens: int

    def step_s(self, batch: int, context: float) -> float:
        memory = self.weights_s + self.per_context_token_s * context
        compute = self.per_sequence_s * batch
        return self.fixed_s + max(memory, compute)

    def prefill_flops(self, new_tokens: int, cached_tokens: int) -> float:
        """Dense GEMMs on the new tokens plus causal attention against the cached prefix."""
        pairs = new_tokens * cached_tokens + new_tokens * new_tokens / 2.0
        return 2.0 * self.params * new_tokens + 4.0 * self.layers * self.hidden * pairs

    def prefill_s(self, flops: float) -> float:
        if flops <= 0:
            return 0.0
        return self.prefill_overhead_s + flops * self.prefill_s_per_flop


class PerfModel:
    """Times of every kind of work for one model, on any hardware mix."""

    def __init__(self, model: ModelSpec, params: PerfParams | None = None) -> None:
        self.model = model
        self.params = params or PerfParams()

    # -- inference engines -------------------------------------------------------------------

    def engine_coeffs(self, hardware: HardwareSpec, *, colocated: bool = False) -> EngineCoeffs:
        tp = self.model.rollout_tp
        p = self.params
        mem_fraction = p.colocated_engine_mem_fraction if colocated else p.engine_mem_fraction
        m = self.model
        bandwidth = tp * hardware.hbm_bytes_s * p.hbm_efficiency
        fixed = p.decode_step_overhead_s + (2 * m.layers * p.tp_allreduce_s if tp > 1 else 0.0)
        capacity = (tp * hardware.hbm_gb * GB * mem_fraction - m.weight_bytes) / m.kv_bytes_per_token
        if capacity <= 0:
            raise ValueError(f"model {m.name} does not fit {tp} x {hardware.name}")
        return EngineCoeffs(
            fixed_s=fixed,
            weights_s=m.weight_bytes / bandwidth,
            per_context_token_s=m.kv_bytes_per_token / bandwidth,
            per_sequence_s=2.0 * m.params / (tp * hardware.peak_flops * p.decode_mfu),
            prefill_s_per_flop=1.0 / (tp * hardware.peak_flops * p.prefill_mfu),
            prefill_overhead_s=p.prefill_overhead_s,
            params=m.params,
            layers=m.layers,
            hidden=m.hidden,
            kv_capacity_tokens=int(capacity),
        )

    def engine_peak_tokens_per_s(
        self, coeffs: EngineCoeffs, max_running: int, typical_context: float, max_new_tokens: int
    ) -> float:
        """Decode tokens/s of a full engine: as many sequences as slots and KV allow, each with the
        typical context and, half-way through on average, the KV reserve admission keeps for it.

        Throughput B / step(B) grows with B, so the peak is at the largest admissible batch.
        """
        per_sequence = max(typical_context + self.params.kv_reserve_ratio * max_new_tokens / 2.0, 1.0)
        batch = max(1, min(max_running, int(coeffs.kv_capacity_tokens // per_sequence)))
        return batch / coeffs.step_s(batch, batch * typical_context)

    # -- trainer and log-prob workers --------------------------------------------------------

    def train_flops(self, sequence_lengths: Sequence[int]) -> float:
        """Forward + backward: 6 N per token plus causal attention, 6 L d s^2 per sequence."""
        m = self.model
        return sum(6.0 * m.params * s + 6.0 * m.layers * m.hidden * s * s for s in sequence_lengths)

    def forward_flops(self, sequence_lengths: Sequence[int]) -> float:
        """One forward pass (a log-prob computation): 2 N per token plus causal attention."""
        m = self.model
        return sum(2.0 * m.params * s + 2.0 * m.layers * m.hidden * s * s for s in sequence_lengths)

    def compute_rate(self, hardware: Sequence[HardwareSpec]) -> float:
        """FLOP/s of a gang of GPUs at the trainer's MFU; a gang runs at its slowest member's pace."""
        if not hardware:
            return 0.0
        slowest = min(h.peak_flops for h in hardware)
        return len(hardware) * slowest * self.model.train_mfu

    def grad_sync_s(self, data_parallel: int) -> float:
        """Exposed part of one optimizer step's reduce-scatter + all-gather across DP ranks."""
        if data_parallel <= 1:
            return 0.0
        m = self.model
        shard_bytes = m.weight_bytes / (m.trainer_tp * m.trainer_pp)
        ring = 2.0 * (data_parallel - 1) / data_parallel * shard_bytes
        return self.params.grad_comm_exposed * ring / (self.params.network_gb_s * GB)

    # -- transitions -------------------------------------------------------------------------

    def weight_sync_s(self) -> float:
        """New policy weights from the trainer into every engine (broadcast, shards in parallel)."""
        shard = self.model.weight_bytes / self.model.rollout_tp
        return self.params.weight_sync_fixed_s + shard / (self.params.network_gb_s * GB)

    def colocate_switch_s(self, total_gpus: int) -> float:
        """One colocated phase switch: offload one side's state to host memory, onload the other's."""
        state_per_gpu = self.model.params * TRAINER_STATE_BYTES_PER_PARAM / max(total_gpus, 1)
        return self.params.colocate_switch_fixed_s + state_per_gpu / (self.params.pcie_gb_s * GB)


def largest_valid(count: int, valid: Sequence[int]) -> int:
    """The largest allowed size not above ``count`` (any size when ``valid`` is empty)."""
    if not valid:
        return count
    allowed = [v for v in valid if v <= count]
    return max(allowed) if allowed else 0


def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))
