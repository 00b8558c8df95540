"""What both REST device backends (torch and ONNX Runtime) share: the check of their
coordinator settings and the round-polling loop. One definition, importable without torch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from seedfed.shared.protocol.coordinator_client import (
    CoordinatorHttpError,
    CoordinatorUnreachableError,
)
from seedfed.shared.protocol.wire import RoundPlan

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def poll_rounds(*, current_plan: Callable[[], RoundPlan | None], meta: dict[str, Any],
                train: Callable[[RoundPlan], T], poll_s: float, rounds: int | None = None,
                deadline_s: float | None = None) -> list[T]:
    """A REST device's main loop: poll for an open round it has not taken part in
    (`meta["last_round"]`), train and upload it with `train`, until `rounds` are done (None:
    until stopped) or `deadline_s` passes. A 409 (the round closed or moved on meanwhile) skips
    that round; any other refusal is raised. A coordinator that stops answering while the
    device polls (a restart, a network outage) is waited for, with one warning per outage."""
    done: list[T] = []
    stop = None if deadline_s is None else time.monotonic() + deadline_s
    down: CoordinatorUnreachableError | None = None
    while rounds is None or len(done) < rounds:
        if stop is not None and time.monotonic() > stop:
            break
        try:
            plan = current_plan()
        except CoordinatorUnreachableError as e:
            if down is None:
                log.warning("%s; retrying every %g s", e.what, poll_s)
            down = e
            time.sleep(poll_s)
            continue
        if down is not None:
            log.warning("the coordinator at %s answers again", down.url)
            down = None
        if plan is None or plan.round <= int(meta.get("last_round", 0)):
            time.sleep(poll_s)
            continue
        try:
            done.append(train(plan))
        except CoordinatorHttpError as e:
            if e.status != 409:
                raise
            log.info("round %d: %s", plan.round, e.detail)
            meta["last_round"] = plan.round
    return done
