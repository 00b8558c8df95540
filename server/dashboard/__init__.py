"""The operator dashboard: an HTML page at `/` with its static assets (see `routes`)."""

from seedfed.server.dashboard.routes import STATIC_DIR, router

__all__ = ["STATIC_DIR", "router"]
