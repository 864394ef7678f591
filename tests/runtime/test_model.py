"""The policy model: config, megatron-core build on CPU, weight conversion, reference forward."""

from __future__ import annotations

import pytest
import torch

from runtime.model.config import GPTConfig
from runtime.model.megatron_compat import cpu_shims_active, initialize_megatron
from runtime.model.megatron_gpt import build_gpt_model, forward_logits, token_logprobs
from runtime.model.reference import reference_logits
from runtime.model.weights import (
    WeightConversionError,
    engine_parameter_names,
    engine_to_megatron,
    megatron_to_engine,
)
from runtime.task.tokenizer import CharTokenizer

torch.set_num_threads(1)

CONFIG = GPTConfig(vocab_size=CharTokenizer().vocab_size)


def perturbed_model(seed: int) -> torch.nn.Module:
    """A built model whose LayerNorms and biases are far from their init (ones / zeros), so a
    conversion that drops or misplaces one of them cannot pass unnoticed."""
    model = build_gpt_model(CONFIG, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model


def random_tokens(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (batch, seq_len), generator=generator)


def test_config_round_trips_through_json_and_rejects_bad_shapes() -> None:
    config = GPTConfig(vocab_size=20, hidden_size=32, num_layers=3, num_heads=2)
    assert GPTConfig.from_json(config.to_json()) == config
    assert config.head_dim == 16
    assert GPTConfig(vocab_size=20) == GPTConfig(
        vocab_size=20, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256, max_positions=256
    )
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=20, hidden_size=30, num_heads=4)
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=0)
    with pytest.raises(ValueError):
        GPTConfig.from_json('{"vocab_size": 20, "rotary": true}')


def test_megatron_builds_on_cpu_with_the_expected_parameters() -> None:
    assert cpu_shims_active() == (not torch.cuda.is_available())
    model = build_gpt_model(CONFIG, seed=0)
    parameters = dict(model.named_parameters())
    assert parameters["embedding.word_embeddings.weight"].shape == (CONFIG.vocab_size, 64)
    assert parameters["embedding.position_embeddings.weight"].shape == (256, 64)
    assert parameters["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (192, 64)
    assert parameters["output_layer.weight"].shape == (CONFIG.vocab_size, 64)
    assert all(p.dtype == torch.float32 for p in parameters.values())
    if cpu_shims_active():
        assert all(p.device.type == "cpu" for p in parameters.values())
    logits = forward_logits(model, random_tokens(3, 17, seed=0))
    assert logits.shape == (3, 17, CONFIG.vocab_size)
    assert torch.isfinite(logits).all()


def test_the_same_seed_builds_the_same_weights() -> None:
    first = build_gpt_model(CONFIG, seed=11).state_dict()
    second = build_gpt_model(CONFIG, seed=11).state_dict()
    other = build_gpt_model(CONFIG, seed=12).state_dict()
    tensors = [name for name, value in first.items() if isinstance(value, torch.Tensor)]
    assert all(torch.equal(first[name], second[name]) for name in tensors)
    assert not torch.equal(first["output_layer.weight"], other["output_layer.weight"])


def test_megatron_logits_equal_the_reference_forward_after_conversion() -> None:
    model = perturbed_model(seed=1)
    tokens = random_tokens(4, 48, seed=1)
    with torch.no_grad():
        megatron = forward_logits(model, tokens)
        weights = megatron_to_engine(model.state_dict(), CONFIG)
        reference = reference_logits(weights, CONFIG, tokens)
    assert sorted(weights) == sorted(engine_parameter_names(CONFIG))
    assert weights["layers.0.attn.qkv.weight"].shape == (192, 64)
    assert weights["layers.0.mlp.fc1.weight"].shape == (256, 64)
    torch.testing.assert_close(megatron, reference, atol=1e-5, rtol=0)


def test_positions_only_see_their_past() -> None:
    model = build_gpt_model(CONFIG, seed=2)
    tokens = random_tokens(1, 20, seed=2)
    changed = tokens.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % CONFIG.vocab_size
    with torch.no_grad():
        before, after = forward_logits(model, tokens), forward_logits(model, changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], atol=0, rtol=0)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_qkv_rows_are_regrouped_into_q_k_v_blocks_by_head() -> None:
    model = build_gpt_model(CONFIG, seed=3)
    state = model.state_dict()
    fused = state["decoder.layers.0.self_attention.linear_qkv.weight"]
    head_dim = CONFIG.head_dim
    weights = megatron_to_engine(state, CONFIG)
    engine = weights["layers.0.attn.qkv.weight"]
    hidden = CONFIG.hidden_size
    for head in range(CONFIG.num_heads):
        megatron_rows = fused[head * 3 * head_dim : (head + 1) * 3 * head_dim]
        for block, name in enumerate(("q", "k", "v")):
            rows = engine[block * hidden + head * head_dim : block * hidden + (head + 1) * head_dim]
            assert torch.equal(rows, megatron_rows[block * head_dim : (block + 1) * head_dim]), (head, name)


def test_engine_weights_load_back_into_megatron_unchanged() -> None:
    source = perturbed_model(seed=4)
    weights = megatron_to_engine(source.state_dict(), CONFIG)
    target = build_gpt_model(CONFIG, seed=5)
    result = target.load_state_dict(engine_to_megatron(weights, CONFIG), strict=False)
    assert not result.unexpected_keys
    assert all(key.endswith("._extra_state") for key in result.missing_keys)
    tokens = random_tokens(2, 30, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(
            forward_logits(target, tokens), forward_logits(source, tokens), atol=0, rtol=0
        )


def test_conversion_refuses_unknown_or_missing_parameters() -> None:
    state = dict(build_gpt_model(CONFIG, seed=6).state_dict())
    with pytest.raises(WeightConversionError, match="no engine name"):
        megatron_to_engine({**state, "decoder.layers.0.mystery.weight": torch.zeros(1)}, CONFIG)
    del state["decoder.final_layernorm.bias"]
    with pytest.raises(WeightConversionError, match=r"ln_f\.bias"):
        megatron_to_engine(state, CONFIG)
    with pytest.raises(WeightConversionError):
        engine_to_megatron({"tok_emb.weight": torch.zeros(1)}, CONFIG)


def test_converted_weights_do_not_alias_the_trainers_parameters() -> None:
    model = build_gpt_model(CONFIG, seed=7)
    weights = megatron_to_engine(model.state_dict(), CONFIG)
    snapshot = weights["lm_head.weight"].clone()
    with torch.no_grad():
        model.output_layer.weight.add_(1.0)
    assert torch.equal(weights["lm_head.weight"], snapshot)


def test_token_logprobs_score_targets_and_carry_gradients() -> None:
    model = build_gpt_model(CONFIG, seed=8)
    tokens = random_tokens(2, 16, seed=8)
    targets = torch.roll(tokens, shifts=-1, dims=1)
    logprobs = token_logprobs(model, tokens, targets)
    assert logprobs.shape == (2, 16)
    expected = torch.log_softmax(forward_logits(model, tokens), dim=-1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(logprobs, expected)
    assert (logprobs <= 0).all()
    torch.autograd.backward(logprobs.sum())
    gradient = model.embedding.word_embeddings.weight.grad
    assert gradient is not None and gradient.abs().sum() > 0


@pytest.mark.skipif(
    not cpu_shims_active(), reason="the CPU RNG tracker replaces megatron's only without CUDA"
)
def test_megatron_rng_fork_draws_from_its_own_stream_and_restores_the_callers() -> None:
    from megatron.core import tensor_parallel

    initialize_megatron(seed=9)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(123)
    expected_outside = torch.rand(3)
    torch.manual_seed(123)
    with tracker.fork():
        inside_first = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_outside)
    with tracker.fork():
        inside_second = torch.rand(3)
    # The tracked stream advanced instead of restarting.
    assert not torch.equal(inside_first, inside_second)
    initialize_megatron(seed=9)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), inside_first)
