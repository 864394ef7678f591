"""Rollout engines that speak SGLang's HTTP protocol, and the one client that drives them.

- ``client.EngineClient`` drives a real SGLang server on a GPU host and the CPU engine alike.
- ``cpu_engine.CpuEngine`` is the CPU stand-in for SGLang: a real engine over a tiny torch GPT
  (``model.py``) with continuous batching, a prefix KV cache (``prefix_cache.py``), aborts that
  return partial output, pause modes, versioned weight updates and memory release/resume.
- ``cpu_server`` serves a ``CpuEngine`` with SGLang's routes (FastAPI + uvicorn).
- ``weight_sync`` builds the trainer-to-engine weight-update process group (gloo on CPU).

Protocol source read: SGLang's own ``python/sglang/srt/entrypoints/http_server.py`` (0.5.x
line), ``entrypoints/v1_loads.py`` and ``managers/io_struct.py`` from its main branch after
0.5 (the one with ``PauseGenerationReqInput.mode`` and per-token ``weight_versions`` spans), plus
``managers/scheduler.py``/``tokenizer_manager.py`` for the abort rule and ``schedule_batch.py``
for finish reasons. Points a caller must know:

- ``/abort_request`` first requires ``rid`` to name a request in flight (otherwise it does
  nothing), then aborts every request whose rid *starts with* it; ``abort_all`` aborts all.
- A batch ``/generate`` with one string rid expands it to ``{rid}_{i}`` — ``x_1`` is then a
  prefix of ``x_10``; send a list of rids (see ``client.make_rid``).
- ``finish_reason`` is ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``
  or ``{"type": "abort", "message", "status_code", "err_type"}``; an aborted request's answer
  is a normal 200 with its partial ``output_ids`` and log-probs.
- ``meta_info.output_token_logprobs`` rows are ``[logprob, token_id, text-or-null]``.
- ``meta_info.weight_versions`` lists ``{"version", "start", "end"}`` spans over output-token
  indices (the weight version each token was generated under); ``meta_info.weight_version``
  is the version of the last span.
- ``/flush_cache`` answers 400 (not flushed) while requests are running.

Input-token log-probs (``return_logprob`` + ``logprob_start_len``, with ``max_new_tokens: 0`` for
scoring only). Read from SGLang's main branch as stored at these commits:
``managers/io_struct.py`` @001067ff (``GenerateReqInput``: ``logprob_start_len`` defaults to -1,
one value or one per batch item), ``managers/scheduler_output_processor_mixin.py`` @004ec010
(how the rows are built), and the ``handle_generate_request``, ``Req.is_prefill_only``,
``_compute_max_prefix_len``, ``set_finish_with_abort`` and tokenizer-manager abort handling
excerpts of ``scheduler.py``/``schedule_batch.py``/``tokenizer_manager.py``/``tp_worker.py``
found by search at several recent commits (they agree). What it says:

- ``meta_info.input_token_logprobs`` has one row ``[logprob, token_id, null]`` per prompt token
  from ``logprob_start_len`` on, and the *first row's logprob is always null* — also when
  ``logprob_start_len > 0``, so the token at ``logprob_start_len`` itself is never scored: ask
  from one position earlier (``EngineClient.input_logprobs`` does).
- -1 (or no ``return_logprob``) means ``len(prompt) - 1``: a generating request returns the one
  row ``[null, last_prompt_token, null]``; a prefill-only request (``max_new_tokens == 0``)
  uses ``len(prompt)``: no input rows.
- ``logprob_start_len >= len(prompt)`` aborts a generating request with status 400, which the
  tokenizer manager turns into an HTTP 400 (the message names ``logprob_start_len``); a
  prefill-only request may start at or past the end and gets no rows.
- The prefix-cache match is capped at ``logprob_start_len`` so that every scored position is
  computed; a retracted request keeps the input log-probs it already has.
- ``max_new_tokens == 0`` finishes with ``{"type": "length", "length": 0}`` and no
  ``output_ids``. SGLang samples nothing (a dummy token 0) and may still report that dummy's
  output log-prob row; the CPU engine reports none, and the client drops such rows.
- Values below -1 are not checked by SGLang; the CPU engine refuses them (400).
"""
