"""The reference engine: a small torch engine that speaks SGLang 0.5.23's HTTP API subset.

``headrace engine serve --model DIR`` runs it; ``rollout.engine.server.build_app(model_dir, ...)``
returns its FastAPI app and ``rollout.engine.server.serve(...)`` runs that app. Modules: ``model``
(batched Qwen2/Qwen3/Llama decoder on ``shared.hf_arch``), ``sampling`` (SGLang sampling params,
batched sampler), ``scheduler`` (continuous batching thread), ``server``, ``updates``,
``weight_routes`` and ``http`` (HTTP), ``session`` (the weight-update state machine every weight
endpoint calls) over ``receiver`` (its torch.distributed side), ``text`` (tokenizer, stop
strings), ``weights`` (a standalone receiver for tests and benchmarks). Importing this package
imports nothing heavy.
"""
