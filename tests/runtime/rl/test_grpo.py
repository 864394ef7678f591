"""GRPO's maths: group-normalised advantages, packing, the clipped policy loss and the k3 KL."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.rl.grpo import (
    GRPOConfig,
    Trajectory,
    group_advantages,
    grpo_loss,
    k3_kl,
    pack_trajectories,
    trajectory_advantages,
)

torch.set_num_threads(1)

NO_KL = GRPOConfig(kl_coef=0.0)


def trajectory(prompt: list[int], response: list[int], reward: float, group: str) -> Trajectory:
    return Trajectory(
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
        sampling_logprobs=tuple(-0.1 * (i + 1) for i in range(len(response))),
        weight_versions=("0",) * len(response),
        reward=reward,
        group_id=group,
        reference_logprobs=tuple(-0.2 * (i + 1) for i in range(len(response))),
    )


def test_advantages_are_normalised_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 2.0])
    groups = ["a", "a", "b", "b", "b", "c"]
    advantages = group_advantages(rewards, groups, eps=1e-6)
    assert advantages.shape == (6,)
    # Group a: mean 0.5, population std 0.5.
    assert advantages[:2].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    # Group b: mean 4/3, population std sqrt(14/9 - ...) -> check the normalisation itself.
    group_b = advantages[2:5]
    assert float(group_b.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(group_b.std(correction=0)) == pytest.approx(1.0, abs=1e-5)
    expected_b = (torch.tensor([0.0, 1.0, 3.0]) - 4 / 3) / (math.sqrt(14 / 9) + 1e-6)
    assert torch.allclose(group_b, expected_b, atol=1e-6)
    # A group of one has nothing to compare with.
    assert float(advantages[5]) == 0.0


def test_groups_whose_rewards_are_all_equal_get_exactly_zero_advantages() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    advantages = group_advantages(rewards, [7, 7, 7, 8, 8, 9, 9], eps=1e-6)
    assert advantages[:5].tolist() == [0.0] * 5
    assert advantages[5] > 0 > advantages[6]


def test_advantages_reject_a_mismatched_group_list() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 0.0]), ["a"])
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([[1.0, 0.0]]), ["a", "a"])


def test_trajectory_rejects_per_token_fields_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="sampling_logprobs"):
        Trajectory((1,), (5, 6), (-0.1,), ("0", "0"), 1.0, "g")
    with pytest.raises(ValueError, match="reference_logprobs"):
        Trajectory((1,), (5, 6), (-0.1, -0.2), ("0", "0"), 1.0, "g", reference_logprobs=(-0.1,))
    with pytest.raises(ValueError):
        Trajectory((1,), (), (), (), 1.0, "g")


def test_packing_aligns_response_tokens_with_their_log_probs() -> None:
    samples = [trajectory([1, 4, 5], [6, 7, 2], 1.0, "g"), trajectory([1, 4], [8, 2], 0.0, "g")]
    advantages = trajectory_advantages(samples)
    batch = pack_trajectories(samples, advantages, pad_id=0, need_reference=True)
    assert batch.input_ids.shape == (2, 5)
    assert batch.targets[0][batch.response_mask[0]].tolist() == [6, 7, 2]
    assert batch.targets[1][batch.response_mask[1]].tolist() == [8, 2]
    assert batch.sampling_logprobs[0][batch.response_mask[0]].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.reference_logprobs[1][batch.response_mask[1]].tolist() == pytest.approx([-0.2, -0.4])
    # The first response token is predicted from the last prompt token.
    assert batch.input_ids[0, 2] == 5 and batch.response_mask[0, 2]
    assert not batch.response_mask[0, :2].any()
    assert batch.response_tokens == 5
    assert batch.advantages.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    without_reference = [Trajectory((1,), (5,), (-0.1,), ("0",), 1.0, "g")]
    with pytest.raises(ValueError, match="reference"):
        pack_trajectories(without_reference, torch.zeros(1), pad_id=0, need_reference=True)


def test_a_tools_tokens_in_a_response_are_context_but_not_trained() -> None:
    """An agentic response "6 7 | 8 9 | 2" where 8 9 is a tool's answer: the tool's tokens stay
    in the input (later tokens are predicted from them) but are no target of the loss."""
    tool_answer = Trajectory(
        prompt_ids=(1, 4),
        response_ids=(6, 7, 8, 9, 2),
        sampling_logprobs=(-0.1, -0.2, 0.0, 0.0, -0.5),
        weight_versions=("0", "0", None, None, "0"),
        reward=1.0,
        group_id="g",
        trained=(True, True, False, False, True),
    )
    assert tool_answer.trained_tokens == 3
    batch = pack_trajectories([tool_answer], torch.ones(1), pad_id=0, need_reference=False)
    assert batch.input_ids[0].tolist() == [1, 4, 6, 7, 8, 9]
    assert batch.targets[0][batch.response_mask[0]].tolist() == [6, 7, 2]
    assert batch.response_tokens == 3
    with pytest.raises(ValueError, match="trained"):
        Trajectory((1,), (5, 6), (-0.1, -0.2), ("0", "0"), 1.0, "g", trained=(True,))


def test_loss_at_ratio_one_with_zero_kl_is_minus_the_token_mean_advantage() -> None:
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 6, generator=generator)
    advantages = torch.tensor([1.5, -0.5, 0.25])
    mask = torch.tensor(
        [[0, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
        dtype=torch.bool,
    )
    loss, sums = grpo_loss(logprobs, logprobs, logprobs, advantages, mask, GRPOConfig(kl_coef=0.5))
    expected = -(advantages[:, None] * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    assert sums.tokens == 11 and sums.clipped_tokens == 0 and sums.kl == pytest.approx(0.0, abs=1e-6)
    # A normaliser from a larger batch scales the same sum.
    scaled, _ = grpo_loss(logprobs, logprobs, logprobs, advantages, mask, NO_KL, token_normaliser=22.0)
    assert float(scaled) == pytest.approx(float(expected) / 2, abs=1e-6)


def test_clipping_engages_beyond_epsilon_and_zeroes_those_tokens_gradient() -> None:
    # One token per row: (ratio, advantage) and whether the clipped branch should win.
    cases = [
        (1.5, 1.0, True),  # above 1 + eps with a positive advantage
        (1.1, 1.0, False),  # inside the trust region
        (0.5, -1.0, True),  # below 1 - eps with a negative advantage
        (0.5, 1.0, False),  # below 1 - eps but the advantage is positive: unclipped is smaller
        (1.5, -1.0, False),  # above 1 + eps but the advantage is negative: unclipped is smaller
        (1.25, 1.0, False),  # inside the asymmetric upper bound of 1.28
        (0.79, -1.0, True),  # just below the lower bound of 0.8
    ]
    config = GRPOConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    ratios = torch.tensor([[r] for r, _, _ in cases])
    advantages = torch.tensor([a for _, a, _ in cases])
    old = torch.full((len(cases), 1), -1.0)
    new = (old + torch.log(ratios)).requires_grad_(True)
    mask = torch.ones(len(cases), 1, dtype=torch.bool)
    loss, sums = grpo_loss(new, old, old, advantages, mask, config)
    torch.autograd.backward(loss)
    assert new.grad is not None
    expected_clipped = [clipped for _, _, clipped in cases]
    assert [float(g) == 0.0 for g in new.grad[:, 0]] == expected_clipped
    assert sums.clipped_tokens == sum(expected_clipped)
    # Unclipped tokens: d(-ratio * A)/d new_logp = -ratio * A / n.
    for row, (ratio, advantage, clipped) in enumerate(cases):
        if not clipped:
            assert float(new.grad[row, 0]) == pytest.approx(-ratio * advantage / len(cases), rel=1e-5)


def test_k3_kl_is_zero_when_new_equals_reference_and_positive_otherwise() -> None:
    reference = torch.tensor([-0.5, -1.0, -2.0, -0.1])
    assert torch.equal(k3_kl(reference, reference), torch.zeros(4))
    new = torch.tensor([-0.6, -0.4, -2.5, -0.12])
    kl = k3_kl(new, reference)
    assert bool((kl > 0).all())
    difference = reference - new
    assert torch.allclose(kl, torch.exp(difference) - difference - 1)


def test_kl_penalty_adds_beta_times_kl_and_pulls_towards_the_reference() -> None:
    old = torch.tensor([[-1.0, -1.0]])
    reference = torch.tensor([[-1.2, -0.8]])
    new = old.clone().requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    zero_advantage = torch.zeros(1)
    loss, sums = grpo_loss(new, old, reference, zero_advantage, mask, GRPOConfig(kl_coef=0.1))
    expected_kl = k3_kl(old, reference).mean()
    assert float(loss.detach()) == pytest.approx(0.1 * float(expected_kl), rel=1e-5)
    assert sums.kl / sums.tokens == pytest.approx(float(expected_kl), rel=1e-5)
    torch.autograd.backward(loss)
    assert new.grad is not None
    # Descending the loss moves each log-prob towards the reference's.
    assert float(new.grad[0, 0]) > 0 > float(new.grad[0, 1])
