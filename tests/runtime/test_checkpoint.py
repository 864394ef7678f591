"""Checkpoints in the Hugging Face layout: what SGLang's loader reads is our model, exactly.

transformers' ``OPTForCausalLM`` is the reference SGLang's OPT follows (and SGLang reads its
``config.json`` through transformers' OPTConfig), so a checkpoint that transformers loads with
no missing or unexpected tensors, and whose logits equal ours, is one SGLang serves as our model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from runtime.engine.model import init_random_gpt
from runtime.model.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
    engine_to_hf,
    hf_to_engine,
    hf_to_engine_slices,
    load_checkpoint,
    save_checkpoint,
)
from runtime.model.config import GPTConfig
from runtime.model.reference import reference_logits
from runtime.task.tokenizer import BOS_ID, EOS_ID, PAD_ID

torch.set_num_threads(1)

CONFIG = GPTConfig(
    vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, max_positions=48
)
TOKEN_IDS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def engine_weights(seed: int) -> dict[str, torch.Tensor]:
    # Random biases and norms too, so that a misplaced one cannot hide behind zeros and ones.
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(tensor.shape, generator=generator) * 0.3
        for name, tensor in init_random_gpt(CONFIG, seed=seed).state_dict().items()
    }


def test_transformers_loads_the_checkpoint_as_our_model_with_the_same_logits(tmp_path: Path) -> None:
    weights = engine_weights(seed=3)
    directory = save_checkpoint(tmp_path / "ckpt", weights, CONFIG, **TOKEN_IDS)

    model, info = OPTForCausalLM.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model.eval()
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, CONFIG.max_positions), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
    ours = reference_logits(weights, CONFIG, tokens)
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)
    config = OPTConfig.from_pretrained(directory)
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (EOS_ID, BOS_ID, PAD_ID)


def test_a_checkpoint_round_trips_and_partial_updates_land_in_the_fused_rows(tmp_path: Path) -> None:
    weights = engine_weights(seed=4)
    config, tensors = load_checkpoint(save_checkpoint(tmp_path / "ckpt", weights, CONFIG, **TOKEN_IDS))
    assert config == CONFIG
    back = hf_to_engine(tensors, CONFIG)
    assert back.keys() == weights.keys() and all(torch.equal(back[n], weights[n]) for n in weights)
    # A pushed update may carry only k of one layer: it goes to the middle third of the fused qkv.
    k = engine_to_hf(weights)["model.decoder.layers.1.self_attn.k_proj.weight"]
    (part,) = hf_to_engine_slices({"model.decoder.layers.1.self_attn.k_proj.weight": k}, CONFIG)
    assert (part.name, part.start, part.stop) == ("layers.1.attn.qkv.weight", 32, 64)
    assert torch.equal(weights["layers.1.attn.qkv.weight"][32:64], part.tensor)


def test_a_checkpoint_of_another_architecture_or_missing_tensors_is_refused(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path / "ckpt", engine_weights(seed=5), CONFIG, **TOKEN_IDS)
    data = json.loads((directory / CONFIG_FILE).read_text())
    (directory / CONFIG_FILE).write_text(json.dumps({**data, "activation_function": "relu"}))
    with pytest.raises(CheckpointError, match="activation_function is 'relu'"):
        load_checkpoint(directory)
    (directory / CONFIG_FILE).write_text(json.dumps({**data, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type is 'gpt2'"):
        load_checkpoint(directory)
    with pytest.raises(CheckpointError, match="unknown parameter"):
        hf_to_engine_slices({"model.decoder.layers.7.fc1.weight": torch.zeros(1)}, CONFIG)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "absent")
