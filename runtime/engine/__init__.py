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
"""
