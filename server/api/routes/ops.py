"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from ...schemas import Health
from ..deps import RuntimeDep

router = APIRouter(tags=["ops"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
def readyz(rt: RuntimeDep) -> Response:
    """Readiness: the database answers and the model store is writable."""
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
    return JSONResponse(Health(status="ok").model_dump())


@router.get("/metrics", response_class=Response)
def metrics(rt: RuntimeDep) -> Response:
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)
