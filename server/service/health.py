"""Liveness and readiness of the coordinator, and its Prometheus metrics."""

from __future__ import annotations

from prometheus_client import generate_latest
from sqlalchemy import text

from ..runtime import Runtime
from ..schemas import FailingClose, Health, Readiness


def readiness(rt: Runtime) -> Health | Readiness:
    """`unavailable` when the database does not answer or the model store is not writable;
    `degraded` when some task's round close is failing (still ready: the other tasks are
    served, and the ticker retries those); `ok` otherwise."""
    try:
        with rt.engine.connect() as c:
            c.execute(text("SELECT 1"))
        probe = rt.store.root / ".ready"
        probe.write_bytes(b"ok")
        probe.unlink()
    except Exception as e:  # any failure means "do not send traffic here"
        return Health(status="unavailable", detail=f"{type(e).__name__}: {e}")
    failing = [FailingClose(task_id=t, round=f.round, attempts=f.attempts, error=f.error,
                            retry_at=f.retry_at) for t, f in rt.close_failures.items()]
    if failing:
        detail = f"{len(failing)} task(s) with a failing round close, retried with backoff"
        return Readiness(status="degraded", detail=detail, failing_closes=failing)
    return Health(status="ok")


def metrics_text(rt: Runtime) -> bytes:
    """The Prometheus text exposition of the coordinator's metrics."""
    return generate_latest(rt.metrics.registry)
