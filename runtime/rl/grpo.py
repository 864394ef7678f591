"""GRPO: group-relative advantages and the clipped, KL-regularised token-level policy loss.

One prompt is sampled several times (a *group*); each response's advantage is its reward
relative to its group: ``(reward - group mean) / (group std + eps)``. A group whose rewards are
all equal teaches nothing and gets zero advantages. The policy loss per response token is PPO's
clipped surrogate with the sampling policy as the old policy::

    ratio = exp(new_logp - old_logp)
    policy = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    kl     = exp(ref_logp - new_logp) - (ref_logp - new_logp) - 1      (the k3 estimator, >= 0)
    token  = policy + beta * kl

and the batch loss is the mean of ``token`` over response tokens (prompt and padding are
masked out). Every function here is plain torch and runs on whichever device its inputs are on.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Trajectory:
    """One sampled response to one prompt, as the rollout produced it.

    ``sampling_logprobs`` and ``weight_versions`` are per response token: the log-probability the
    engine sampled each token with, and the weight version it was sampled under (a response
    resumed after a weight update spans several). ``reference_logprobs``, per response token too,
    come from the reference policy (the ``inference`` workers) and are needed only when the KL
    coefficient is non-zero. ``trained`` marks, per response token, the policy's own tokens: an
    agentic episode's response also holds what its tools answered, which the loss leaves out
    (None: every token is the policy's).
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    sampling_logprobs: tuple[float, ...]
    weight_versions: tuple[str | None, ...]
    reward: float
    group_id: str
    reference_logprobs: tuple[float, ...] | None = None
    trained: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a trajectory needs at least one prompt token")
        if not self.response_ids:
            raise ValueError("a trajectory needs at least one response token")
        per_token = {
            "sampling_logprobs": len(self.sampling_logprobs),
            "weight_versions": len(self.weight_versions),
        }
        if self.reference_logprobs is not None:
            per_token["reference_logprobs"] = len(self.reference_logprobs)
        if self.trained is not None:
            per_token["trained"] = len(self.trained)
        wrong = {name: n for name, n in per_token.items() if n != len(self.response_ids)}
        if wrong:
            raise ValueError(f"{len(self.response_ids)} response tokens but {wrong}")

    @property
    def trained_mask(self) -> tuple[bool, ...]:
        return self.trained if self.trained is not None else (True,) * len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        return len(self.response_ids) if self.trained is None else sum(self.trained)


@dataclass(frozen=True)
class GRPOConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.01
    advantage_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError("clip_low must be in [0, 1)")
        if self.clip_high < 0.0:
            raise ValueError("clip_high must be non-negative")
        if self.kl_coef < 0.0:
            raise ValueError("kl_coef must be non-negative")
        if self.advantage_eps <= 0.0:
            raise ValueError("advantage_eps must be positive")


def group_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable], eps: float = 1e-6) -> torch.Tensor:
    """Each reward normalised within its group: (reward - group mean) / (group std + eps).

    The std is the population std (no Bessel correction), so a group of one sample gets a zero
    advantage rather than NaN. Equal rewards give exactly zero: the deviations are all zero.
    """
    if rewards.dim() != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError(f"rewards {tuple(rewards.shape)} must be one value per group id ({len(group_ids)})")
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(group_ids):
        members.setdefault(group, []).append(index)
    for indices in members.values():
        index_tensor = torch.tensor(indices, device=rewards.device)
        group_rewards = rewards[index_tensor]
        deviation = group_rewards - group_rewards.mean()
        std = group_rewards.std(correction=0)
        advantages[index_tensor] = deviation / (std + eps)
    return advantages


def trajectory_advantages(trajectories: Sequence[Trajectory], eps: float = 1e-6) -> torch.Tensor:
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return group_advantages(rewards, [t.group_id for t in trajectories], eps)


@dataclass(frozen=True)
class PackedBatch:
    """Trajectories as right-padded next-token tensors [batch, seq].

    Position t predicts ``targets[:, t]`` from ``input_ids[:, :t+1]``; ``response_mask`` marks the
    positions whose target is a trained response token (not a tool's output), and the per-token
    tensors are aligned with it (zero elsewhere). ``advantages`` is one value per row.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    response_mask: torch.Tensor
    sampling_logprobs: torch.Tensor
    reference_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def response_tokens(self) -> int:
        return int(self.response_mask.sum())


def pack_trajectories(
    trajectories: Sequence[Trajectory], advantages: torch.Tensor, pad_id: int, need_reference: bool
) -> PackedBatch:
    """prompt + response per row, shifted into inputs and targets, padded with ``pad_id``."""
    if not trajectories:
        raise ValueError("no trajectories to pack")
    if advantages.shape != (len(trajectories),):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be one per trajectory")
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories) - 1
    rows = len(trajectories)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    targets = torch.full((rows, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.bool)
    sampling = torch.zeros((rows, width), dtype=torch.float32)
    reference = torch.zeros((rows, width), dtype=torch.float32)
    for row, trajectory in enumerate(trajectories):
        sequence = torch.tensor(trajectory.prompt_ids + trajectory.response_ids, dtype=torch.long)
        length = sequence.shape[0] - 1
        input_ids[row, :length] = sequence[:-1]
        targets[row, :length] = sequence[1:]
        # Response token k is the target of position len(prompt) - 1 + k.
        first = len(trajectory.prompt_ids) - 1
        last = first + len(trajectory.response_ids)
        response_mask[row, first:last] = torch.tensor(trajectory.trained_mask)
        sampling[row, first:last] = torch.tensor(trajectory.sampling_logprobs)
        if need_reference:
            if trajectory.reference_logprobs is None:
                raise ValueError(f"trajectory of group {trajectory.group_id!r} has no reference log-probs")
            reference[row, first:last] = torch.tensor(trajectory.reference_logprobs)
    return PackedBatch(input_ids, targets, response_mask, sampling, reference, advantages.float())


@dataclass(frozen=True)
class LossSums:
    """Token sums behind one batch's metrics; sums add across micro-batches and ranks."""

    loss: float
    policy_loss: float
    kl: float
    clipped_tokens: float
    tokens: float

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [self.loss, self.policy_loss, self.kl, self.clipped_tokens, self.tokens], dtype=torch.float64
        )

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> LossSums:
        loss, policy_loss, kl, clipped, tokens = (float(v) for v in values.tolist())
        return cls(loss, policy_loss, kl, clipped, tokens)

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums.from_tensor(self.as_tensor() + other.as_tensor())


@dataclass(frozen=True)
class GRPOMetrics:
    """Per-batch means over response tokens (mean_reward is over samples)."""

    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    mean_reward: float
    response_tokens: int

    @classmethod
    def from_sums(cls, sums: LossSums, mean_reward: float) -> GRPOMetrics:
        tokens = max(sums.tokens, 1.0)
        return cls(
            loss=sums.loss / tokens,
            policy_loss=sums.policy_loss / tokens,
            kl=sums.kl / tokens,
            clip_fraction=sums.clipped_tokens / tokens,
            mean_reward=mean_reward,
            response_tokens=int(sums.tokens),
        )


def k3_kl(new_logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(new || ref): unbiased, non-negative, zero where they agree."""
    log_ratio = reference_logprobs - new_logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def grpo_token_losses(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    config: GRPOConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (total loss, policy loss, kl, clipped) for [batch, seq] inputs.

    ``advantages`` is [batch] (one per sequence) or already [batch, seq]. ``clipped`` marks the
    tokens where the clipped branch is the smaller objective: their policy gradient is zero.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(new_logprobs)
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped_objective = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
    policy = -torch.minimum(unclipped, clipped_objective)
    clipped = clipped_objective < unclipped
    kl = k3_kl(new_logprobs, reference_logprobs)
    total = policy + config.kl_coef * kl if config.kl_coef else policy
    return total, policy, kl, clipped


def grpo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: GRPOConfig,
    token_normaliser: float | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """The masked mean of the per-token loss, and the token sums behind its metrics.

    ``token_normaliser`` defaults to this batch's response-token count. A trainer that splits one
    batch into micro-batches passes the whole batch's count instead, so the micro-batch losses
    add up to the batch mean rather than to a mean of means.
    """
    total, policy, kl, clipped = grpo_token_losses(
        new_logprobs, old_logprobs, reference_logprobs, advantages, config
    )
    mask = response_mask.to(total.dtype)
    tokens = float(mask.sum())
    normaliser = tokens if token_normaliser is None else token_normaliser
    loss = (total * mask).sum() / max(normaliser, 1.0)
    sums = LossSums(
        loss=float((total.detach() * mask).sum()),
        policy_loss=float((policy.detach() * mask).sum()),
        kl=float((kl.detach() * mask).sum()),
        clipped_tokens=float((clipped.to(mask.dtype) * mask).sum()),
        tokens=tokens,
    )
    return loss, sums
