"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from ...schemas import FailingClose, Health, Readiness
from ..deps import RuntimeDep

router = APIRouter(tags=["ops"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Health}})
def readyz(rt: RuntimeDep) -> Response:
    """Readiness: the database answers and the model store is writable (503 otherwise);
    `degraded` (200) lists the tasks whose round close is failing and when it is retried."""
    try:
        with rt.engine.connect() as c:
            c.execute(text("SELECT 1"))
        probe = rt.store.root / ".ready"
        probe.write_bytes(b"ok")
        probe.unlink()
    except Exception as e:  # any failure means "do not send traffic here"
        return JSONResponse(Health(status="unavailable",
                                   detail=f"{type(e).__name__}: {e}").model_dump(),
                            status_code=503)
    failing = [FailingClose(task_id=t, round=f.round, attempts=f.attempts, error=f.error,
                            retry_at=f.retry_at) for t, f in sorted(rt.close_failures.items())]
    if failing:  # still ready: the other tasks are served, and the ticker retries these
        detail = f"{len(failing)} task(s) with a failing round close, retried with backoff"
        return JSONResponse(Readiness(status="degraded", detail=detail,
                                      failing_closes=failing).model_dump(mode="json"))
    return JSONResponse(Health(status="ok").model_dump())


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text exposition format",
    "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
def metrics(rt: RuntimeDep) -> Response:
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)
