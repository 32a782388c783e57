"""`rosechat serve`: the engine thread behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

The web framework lives here, never in engine/: requests become engine turns through the
engine's public API, engine events become JSON bodies or SSE chunks. Modules: app (the ASGI app),
hub (engine thread <-> asyncio), protocol (request models), errors, guard (API key, body size),
metrics (Prometheus, vLLM's names), run (uvicorn), cli (`rosechat serve`). Nothing is imported
here, so `rosechat --help` does not load the web stack.
"""
