"""Input-token log-probs (SGLang's logprob_start_len with max_new_tokens 0) through the client,
against a cache-free full forward of the engine's model."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from runtime.engine.client import EngineError
from runtime.engine.model import GPT
from tests.runtime.engine.conftest import WAIT_S, Served, greedy_reference, make_model

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
RESPONSE = [5, 3, 5, 8, 9, 7]
SEQUENCE = PROMPT + RESPONSE
TOLERANCE = 1e-5


def reference_logprobs(model: GPT, tokens: list[int], start: int) -> list[float]:
    """log p(tokens[j] | tokens[:j]) for j >= start (start >= 1), from one cache-free forward."""
    log_probs = torch.log_softmax(model.full_logits(tokens), dim=-1)
    return [float(log_probs[j - 1, tokens[j]]) for j in range(start, len(tokens))]


def test_scoring_a_response_equals_the_full_forward_and_generates_nothing(
    serve: Callable[..., Served],
) -> None:
    served = serve()
    scored = served.client.input_logprobs(SEQUENCE, start=len(PROMPT), rid="score.")
    assert scored.token_ids == RESPONSE
    assert scored.logprobs == pytest.approx(
        reference_logprobs(make_model(0), SEQUENCE, len(PROMPT)), abs=TOLERANCE
    )
    assert scored.weight_version == "default" and scored.cached_tokens == 0
    # The raw answer: no output token, a length finish at 0, SGLang's row shape.
    raw = served.client.generate(
        SEQUENCE, {"max_new_tokens": 0}, rid="raw.", return_logprob=True, logprob_start_len=len(PROMPT) - 1
    )
    assert raw.output_ids == [] and raw.output_logprobs == [] and raw.completion_tokens == 0
    assert raw.meta_info["output_token_logprobs"] == []
    assert raw.finish_reason == {"type": "length", "length": 0}
    rows = raw.meta_info["input_token_logprobs"]
    assert rows[0] == [None, PROMPT[-1], None]
    assert [row[1] for row in rows] == SEQUENCE[len(PROMPT) - 1 :] and all(row[2] is None for row in rows)
    assert served.engine.state()["generated_tokens"] == 0


def test_a_prefix_cache_hit_leaves_the_input_logprobs_unchanged(serve: Callable[..., Served]) -> None:
    served = serve(prefix_block_size=4)
    reference = make_model(0)
    # Fill the cache with the prompt's blocks (and more) through an ordinary generation.
    served.client.generate(SEQUENCE, {"max_new_tokens": 2, "temperature": 0.0})
    assert served.engine.state()["prefix_cache_tokens"] >= 12
    for start in (len(PROMPT), 3, 1, len(SEQUENCE)):
        scored = served.client.input_logprobs(SEQUENCE, start=start)
        # The cache serves whole blocks before start - 1 (the first returned row) and no more.
        assert scored.cached_tokens == (start - 1) // 4 * 4
        assert scored.logprobs == pytest.approx(reference_logprobs(reference, SEQUENCE, start), abs=TOLERANCE)
    # A generation that asks for input log-probs of a cached prompt: same values, same tokens.
    result = served.client.generate(
        SEQUENCE, {"max_new_tokens": 4, "temperature": 0.0}, return_logprob=True, logprob_start_len=5
    )
    assert result.cached_tokens == 4
    assert result.input_token_logprobs[1:] == pytest.approx(
        reference_logprobs(reference, SEQUENCE, 6), abs=TOLERANCE
    )
    expected_tokens, expected_logprobs = greedy_reference(reference, SEQUENCE, 4)
    assert result.output_ids == expected_tokens
    assert result.output_logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_a_batch_scores_ragged_sequences_each_as_alone(serve: Callable[..., Served]) -> None:
    served = serve(max_running_requests=2)
    reference = make_model(0)
    sequences = [SEQUENCE, [7, 7, 1], [*PROMPT, 30, 2, 8, 11, 12, 13, 14, 15, 16], [5, 4], SEQUENCE]
    starts = [len(PROMPT), 1, 4, 2, 13]
    rids = [f"batch-score-{index}." for index in range(len(sequences))]
    scored = served.client.input_logprobs_batch(sequences, starts, rids=rids)
    for sequence, start, item in zip(sequences, starts, scored, strict=True):
        assert item.token_ids == sequence[start:]
        assert item.logprobs == pytest.approx(reference_logprobs(reference, sequence, start), abs=TOLERANCE)
    assert served.engine.state()["prefills"] == len(sequences)
    # A later batch whose prompts share the cached blocks gives the same values.
    again = served.client.input_logprobs_batch(sequences, starts)
    assert sum(item.cached_tokens for item in again) > 0
    for first, second in zip(scored, again, strict=True):
        assert second.logprobs == pytest.approx(first.logprobs, abs=TOLERANCE)


def test_logprob_start_len_edges_follow_sglang(serve: Callable[..., Served]) -> None:
    served = serve()
    reference = make_model(0)
    client = served.client
    no_tokens = {"max_new_tokens": 0}
    # 0: a row for every prompt token, the first None (it has no context).
    whole = client.generate(SEQUENCE, no_tokens, return_logprob=True, logprob_start_len=0)
    assert whole.input_token_ids == SEQUENCE and whole.input_token_logprobs[0] is None
    assert whole.input_token_logprobs[1:] == pytest.approx(
        reference_logprobs(reference, SEQUENCE, 1), abs=TOLERANCE
    )
    # Inside: rows from that position, and its own row is None too, as SGLang pads it.
    inside = client.generate(SEQUENCE, no_tokens, return_logprob=True, logprob_start_len=6)
    assert inside.input_token_ids == SEQUENCE[6:] and inside.input_token_logprobs[0] is None
    assert inside.input_token_logprobs[1:] == pytest.approx(whole.input_token_logprobs[7:], abs=TOLERANCE)
    # -1 (the default) while generating: only the last prompt token's None row.
    generating = client.generate(SEQUENCE, {"max_new_tokens": 3, "temperature": 0.0}, return_logprob=True)
    assert generating.meta_info["input_token_logprobs"] == [[None, SEQUENCE[-1], None]]
    assert generating.output_ids == greedy_reference(reference, SEQUENCE, 3)[0]
    # -1 with max_new_tokens 0: no input rows, no output; so is starting at the prompt's end.
    for start in (-1, len(SEQUENCE)):
        empty = client.generate(SEQUENCE, no_tokens, return_logprob=True, logprob_start_len=start)
        assert empty.meta_info["input_token_logprobs"] == [] and empty.output_ids == []
    # Without return_logprob there are no log-prob fields at all.
    plain = client.generate(SEQUENCE, no_tokens, logprob_start_len=0)
    assert "input_token_logprobs" not in plain.meta_info and plain.output_ids == []


def test_bad_logprob_requests_are_refused_naming_the_field(serve: Callable[..., Served]) -> None:
    served = serve()
    client = served.client
    for bad in (-2, "3", True, 2.0):
        with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*logprob_start_len"):
            client._request(
                "POST",
                "/generate",
                {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": bad},
            )
    with pytest.raises(
        EngineError, match=r"HTTP 400: logprob_start_len=8 is higher than the number of input tokens"
    ):
        client.generate(PROMPT, {"max_new_tokens": 2}, return_logprob=True, logprob_start_len=len(PROMPT))
    with pytest.raises(EngineError, match=r"HTTP 400: logprob_start_len has 1 entries for a batch of 2"):
        client.generate_batch(
            [PROMPT, PROMPT], {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=[0]
        )
    with pytest.raises(EngineError, match=r"HTTP 400: max_new_tokens must be >= 0"):
        client.generate(PROMPT, {"max_new_tokens": -1}, return_logprob=True, logprob_start_len=0)
    with pytest.raises(ValueError, match="start must be in"):
        client.input_logprobs(PROMPT, start=0)
    # Nothing was left running by the refusals.
    assert served.engine.state()["num_running_reqs"] == 0
    assert client.input_logprobs(PROMPT, start=2).logprobs == pytest.approx(
        reference_logprobs(make_model(0), PROMPT, 2), abs=TOLERANCE
    )


def test_a_retracted_request_keeps_its_input_logprobs_and_reuses_the_cache(
    serve: Callable[..., Served],
) -> None:
    served = serve()
    served.client.slow_down(0.01)
    params = {"max_new_tokens": 30, "temperature": 0.0}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(served.client.generate, SEQUENCE, params, "retracted-scored.", True, None, 0)
        served.wait_tokens("retracted-scored.", 5)
        served.client.pause_generation("retract")
        served.client.continue_generation()
        result = future.result(WAIT_S)
    reference = make_model(0)
    assert result.meta_info["retraction_count"] == 1
    assert result.input_token_ids == SEQUENCE and result.input_token_logprobs[0] is None
    assert result.input_token_logprobs[1:] == pytest.approx(
        reference_logprobs(reference, SEQUENCE, 1), abs=TOLERANCE
    )
    # Computed once, so the re-admission was not capped at logprob_start_len=0.
    assert result.cached_tokens > 0
    assert result.output_ids == greedy_reference(reference, SEQUENCE, 30)[0]
