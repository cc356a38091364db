"""OpenAI-compatible HTTP server: ``create_app`` (FastAPI) and ``run_server`` (uvicorn)."""

from specdec.server.app import ServerConfig, create_app, run_server

__all__ = ["ServerConfig", "create_app", "run_server"]
