"""Liveness and readiness of the coordinator, and its Prometheus metrics."""

from __future__ import annotations

from prometheus_client import generate_latest
from seedfed.server.runtime import Runtime
from seedfed.server.schemas import FailingClose, Health, Readiness
from sqlalchemy import text


def readiness(rt: Runtime) -> Health | Readiness:
    """`unavailable` when the database does not answer or the model store is not writable;
    `degraded` when some task's round close is failing (still ready: the other tasks are
    served; the ticker retries transient failures, and a close that fails on every attempt
    waits for an operator to abandon its round); `ok` otherwise."""
    try:
        with rt.engine.connect() as c:
            c.execute(text("SELECT 1"))
        probe = rt.store.root / ".ready"
        probe.write_bytes(b"ok")
        probe.unlink()
    except Exception as e:  # any failure means "do not send traffic here"
        return Health(status="unavailable", detail=f"{type(e).__name__}: {e}")
    failing = [FailingClose(task_id=t, round=f.round, attempts=f.attempts, error=f.error,
                            retry_at=f.retry_at, permanent=f.permanent)
               for t, f in rt.close_failures.items()]
    if failing:
        stuck = [f for f in failing if f.permanent]
        parts = [f"{len(failing) - len(stuck)} task(s) with a failing round close, retried "
                 "with backoff"] if len(stuck) < len(failing) else []
        if stuck:
            parts.append(f"{len(stuck)} task(s) whose round close fails on every attempt and "
                         "is not retried: abandon the round (seedfed round abandon TASK N "
                         "--reason ...), e.g. task " + ", task ".join(
                             f"{f.task_id} round {f.round}" for f in stuck[:3]))
        return Readiness(status="degraded", detail="; ".join(parts), failing_closes=failing)
    return Health(status="ok")


def metrics_text(rt: Runtime) -> bytes:
    """The Prometheus text exposition of the coordinator's metrics."""
    return generate_latest(rt.metrics.registry)
