"""/generate through the client: SGLang's answer shape, log-probs, batching, stops, errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.engine.client import EngineError
from tests.runtime.engine.conftest import Served, greedy_reference, make_model

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_single_generate_returns_sglang_meta_info_and_the_exact_greedy_tokens(
    serve: Callable[..., Served],
) -> None:
    served = serve()
    result = served.client.generate(
        PROMPT, {"max_new_tokens": 12, "temperature": 0.0}, rid="single.", return_logprob=True
    )
    expected_tokens, expected_logprobs = greedy_reference(make_model(0), PROMPT, 12)
    assert result.rid == "single."
    assert result.output_ids == expected_tokens
    assert result.output_logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert result.finish_reason == {"type": "length", "length": 12}
    assert (result.prompt_tokens, result.completion_tokens) == (len(PROMPT), 12)
    rows = result.meta_info["output_token_logprobs"]
    assert [row[1] for row in rows] == result.output_ids and all(row[2] is None for row in rows)
    assert result.weight_version == "default"
    assert result.token_weight_versions() == ["default"] * 12


def test_sampling_is_reproducible_with_sampling_seed_and_logprobs_are_of_the_sampled_tokens(
    serve: Callable[..., Served],
) -> None:
    served = serve()
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 7}
    first = served.client.generate(PROMPT, params, return_logprob=True)
    again = served.client.generate(PROMPT, params, return_logprob=True)
    other = served.client.generate(PROMPT, {**params, "sampling_seed": 8}, return_logprob=True)
    assert first.output_ids == again.output_ids
    assert first.output_logprobs == pytest.approx(again.output_logprobs, abs=1e-5)  # again: cached prefix
    assert first.output_ids != other.output_ids
    assert all(logprob <= 0.0 for logprob in first.output_logprobs)
    assert len(first.output_logprobs) == len(first.output_ids) == 16


def test_a_batch_runs_ragged_lengths_together_and_matches_each_request_alone(
    serve: Callable[..., Served],
) -> None:
    served = serve(max_running_requests=3)
    prompts = [PROMPT, [7, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 2, 8], [5]]
    lengths = [9, 4, 14, 6, 11]
    params = [{"max_new_tokens": n, "temperature": 0.0} for n in lengths]
    rids = [f"batch-{index}." for index in range(len(prompts))]
    results = served.client.generate_batch(prompts, params, rids=rids, return_logprob=True)
    assert [result.rid for result in results] == rids
    reference = make_model(0)
    for prompt, length, result in zip(prompts, lengths, results, strict=True):
        assert result.output_ids == greedy_reference(reference, prompt, length)[0]
        assert len(result.output_logprobs) == length
    # More requests than slots: some waited, and decode steps carried several at once.
    state = served.engine.state()
    assert state["decode_steps"] < sum(lengths)
    assert state["prefills"] == len(prompts)


def test_a_batch_with_one_string_rid_gets_sglang_indexed_rids(serve: Callable[..., Served]) -> None:
    served = serve()
    response = served.client._request(
        "POST",
        "/generate",
        {"input_ids": [[1, 2], [3, 4]], "rid": "job", "sampling_params": {"max_new_tokens": 2}},
    )
    assert [item["meta_info"]["id"] for item in response.json()] == ["job_0", "job_1"]


def test_stop_token_ids_and_eos_finish_with_a_stop_reason(serve: Callable[..., Served]) -> None:
    expected, _ = greedy_reference(make_model(0), PROMPT, 6)
    served = serve(eos_token_id=expected[3])
    by_stop_id = served.client.generate(
        PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [expected[1]]}
    )
    assert by_stop_id.output_ids == expected[: expected.index(expected[1]) + 1]
    assert by_stop_id.finish_reason == {"type": "stop", "matched": expected[1]}
    by_eos = served.client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0})
    assert by_eos.output_ids == expected[: expected.index(expected[3]) + 1]
    assert by_eos.finish_reason == {"type": "stop", "matched": expected[3]}
    ignoring = served.client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    assert ignoring.output_ids == expected and ignoring.finish_type == "length"


def test_refused_requests_name_the_route_status_and_reason(serve: Callable[..., Served]) -> None:
    served = serve()
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*outside the vocabulary"):
        served.client.generate([99], {"max_new_tokens": 1})
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*frequency_penalty"):
        served.client.generate([1], {"frequency_penalty": 0.5})
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*input_ids only"):
        served.client._request("POST", "/generate", {"text": "hello"})
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*longer than the model's context"):
        served.client.generate(list(range(8)) * 40, {"max_new_tokens": 1})
    assert served.client.health() and served.client.health_generate()
