"""The job the live benchmarks submit by default: a math-RL job sized to the GPUs it is given."""

from __future__ import annotations

from typing import Any


def job_spec(tag: str, index: int, hardware: str, gpus: int, speed_iterations: int) -> dict[str, Any]:
    """A math-RL job under dynarl whose rollout drains into a long tail every iteration."""
    actor = max(1, gpus // 4)
    return {
        "name": f"{tag}-job{index}",
        "model": {"name": "load-1.5b", "params_b": 1.5},
        "workload": {
            "kind": "math",
            "iterations": speed_iterations,
            "prompts_per_iteration": 32 * gpus,
            "samples_per_prompt": 8,
            "max_new_tokens": 8192,
        },
        "components": [
            {
                "name": "rollout",
                "kind": "rollout",
                "workers": gpus - actor,
                "min_workers": 1,
                "hardware": [hardware],
            },
            {
                "name": "actor",
                "kind": "actor",
                "workers": actor,
                "min_workers": 1,
                "max_workers": gpus - 1,
                "depends_on": ["rollout"],
                "hardware": [hardware],
            },
        ],
        "policy": {"name": "dynarl", "params": {"u_low": 0.2, "sustain_s": 3.0, "cooldown_s": 10.0}},
    }
