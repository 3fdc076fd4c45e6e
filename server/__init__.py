"""specrun's OpenAI-compatible HTTP server (`specrun serve`): FastAPI routes over an
AsyncEngine, Prometheus metrics. `build_app` makes the ASGI app for any AsyncEngine."""

from .app import build_app

__all__ = ["build_app"]
