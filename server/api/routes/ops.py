"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from seedfed.server import service
from seedfed.server.api.deps import RuntimeDep
from seedfed.server.schemas import Health, Readiness

router = APIRouter(tags=["ops"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Health}})
def readyz(rt: RuntimeDep) -> Response:
    """Readiness: the database answers and the model store is writable (503 otherwise);
    `degraded` (200) lists the tasks whose round close is failing and when it is retried."""
    state = service.readiness(rt)
    if state.status == "unavailable":
        return JSONResponse(state.model_dump(), status_code=503)
    if isinstance(state, Readiness):  # degraded: still ready, the ticker retries the closes
        return JSONResponse(state.model_dump(mode="json"))
    return JSONResponse(state.model_dump())


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text exposition format",
    "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
def metrics(rt: RuntimeDep) -> Response:
    return Response(service.metrics_text(rt), media_type=CONTENT_TYPE_LATEST)
