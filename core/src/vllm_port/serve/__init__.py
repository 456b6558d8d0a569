"""``vllm-port serve``: an OpenAI-compatible HTTP server over the engine (docs/serve.md).

``async_engine.py`` is the front end that never blocks: requests arrive on an asyncio loop, one
engine thread steps the batch through :class:`~vllm_port.engine.LLM`'s engine-core API
(``add_request``, ``step``, ``abort_request``), and each request's deltas stream back through its
own asyncio queue. ``protocol.py`` holds the OpenAI request schemas (pydantic) and their mapping to
``SamplingParams``; ``app.py`` the endpoints (FastAPI); ``metrics.py`` the Prometheus metrics;
``serve_command.py`` the command. FastAPI, uvicorn, pydantic and prometheus_client come with the
``serve`` extra (``pip install 'vllm-port[serve]'``); nothing here imports them but the server itself.
"""
