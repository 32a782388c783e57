"""`rosechat serve`: the engine thread behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

The web framework lives here, never in engine/: requests become engine turns through the
engine's public API, engine events become JSON bodies or SSE chunks.
"""

from rosechat.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
