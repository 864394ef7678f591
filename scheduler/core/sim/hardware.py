"""Accelerator and model specifications the simulator's performance model reads.

Figures are public datasheet numbers (dense BF16 tensor-core peak, HBM bandwidth and capacity) and
the published architectures of the Qwen2.5 family (DynaRL's 1.5B/7B/32B models are Qwen2.5-based
R1 distillations). Nothing here is tuned to any result.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12
BF16_BYTES = 2


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator type."""

    name: str
    peak_tflops: float  # dense BF16 tensor-core peak
    hbm_tb_s: float  # HBM bandwidth
    hbm_gb: float  # HBM capacity

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * TB

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tb_s * TB


HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB.
    "H100": HardwareSpec("H100", peak_tflops=989.0, hbm_tb_s=3.35, hbm_gb=80.0),
    # H800: the H100 die with reduced NVLink; same compute and HBM (RollArt's training/prefill pool).
    "H800": HardwareSpec("H800", peak_tflops=989.0, hbm_tb_s=3.35, hbm_gb=80.0),
    # H20: 148 TFLOPS dense BF16 but 4.0 TB/s HBM3 and 96 GB (RollArt's decode-heavy pool).
    "H20": HardwareSpec("H20", peak_tflops=148.0, hbm_tb_s=4.0, hbm_gb=96.0),
    # A100 SXM4 80 GB: 312 TFLOPS dense BF16, 2.039 TB/s.
    "A100": HardwareSpec("A100", peak_tflops=312.0, hbm_tb_s=2.039, hbm_gb=80.0),
}


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer, with the parallelism a job runs it at."""

    name: str
    params_b: float  # billions of parameters
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    rollout_tp: int  # tensor parallel size of one inference engine
    trainer_tp: int  # tensor parallel size of one trainer rank group (Megatron)
    trainer_pp: int = 1
    train_mfu: float = 0.35  # model-FLOPs utilisation the trainer reaches

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    @property
    def weight_bytes(self) -> float:
        return self.params * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> float:
        # K and V, every layer, every KV head, BF16.
        return 2.0 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES

    @property
    def trainer_gpus_per_worker(self) -> int:
        return self.trainer_tp * self.trainer_pp


MODELS: dict[str, ModelSpec] = {
    # Qwen2.5-1.5B: 28 layers, hidden 1536, 2 KV heads of 128. Small models reach lower MFU.
    "1.5B": ModelSpec(
        "1.5B",
        params_b=1.54,
        layers=28,
        hidden=1536,
        kv_heads=2,
        head_dim=128,
        rollout_tp=1,
        trainer_tp=1,
        train_mfu=0.30,
    ),
    # Qwen2.5-7B: 28 layers, hidden 3584, 4 KV heads. 16 bytes/param of trainer state (112 GB)
    # does not fit one 80 GB GPU, hence TP 2 for the trainer.
    "7B": ModelSpec(
        "7B",
        params_b=7.62,
        layers=28,
        hidden=3584,
        kv_heads=4,
        head_dim=128,
        rollout_tp=1,
        trainer_tp=2,
        train_mfu=0.35,
    ),
    # Qwen2.5-32B: 64 layers, hidden 5120, 8 KV heads; 65 GB of BF16 weights -> TP 4 engines.
    "32B": ModelSpec(
        "32B",
        params_b=32.5,
        layers=64,
        hidden=5120,
        kv_heads=8,
        head_dim=128,
        rollout_tp=4,
        trainer_tp=8,
        train_mfu=0.40,
    ),
}
