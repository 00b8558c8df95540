"""What both REST device backends (torch and ONNX Runtime) check about their coordinator
settings: one definition, importable without torch."""

from __future__ import annotations


def check_endpoint(url: str, task_id: str, **positive: float) -> None:
    """Refuse a URL that is not http(s), an empty task id, or any of `positive` (poll and
    timeout seconds, link bandwidth) that is not > 0."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"coordinator URL must start with http:// or https://, got {url!r}")
    if not task_id:
        raise ValueError("task_id must not be empty")
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
