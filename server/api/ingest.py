"""The upload path, shared by the documented FastAPI route and an ASGI fast path.

Uploads are the one hot endpoint (every device, every round). FastAPI's routing and
dependency solving cost more CPU per request than the validation and the batched insert
together (measured with benchmarks/ingest.py), so `UploadFastPath` answers
`POST /v1/tasks/{task_id}/rounds/{round}/uploads` directly at the ASGI level with the same
function the route uses (`ingest`); the route stays for OpenAPI and as the fallback
(`Settings.upload_fast_path=False`). Both answer identically: same receipt, same typed errors.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping

from fastapi.concurrency import run_in_threadpool
from seedfed.shared.errors import SeedfedError
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import service
from ..errors import AuthenticationError, MalformedRequestError, PermissionDeniedError
from ..runtime import Runtime
from ..schemas import UploadReceipt
from ..service.uploads import UploadWriter

BINARY_HEADERS = ("X-Seedfed-Version", "X-Seedfed-Num-Examples", "X-Seedfed-Loss")
_PATH = re.compile(r"^/v1/tasks/([^/]+)/rounds/(\d+)/uploads/?$")


def device_from_token(rt: Runtime, task_id: str, authorization: str | None
                      ) -> tuple[str | None, str]:
    """(device id if the token is cached, token hash); uncached tokens are authenticated by
    the upload writer together with the rest of their batch."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("missing Authorization: Bearer <device token>")
    h = service.devices.hash_token(token.strip())
    hit = rt.token_cache.get(h)
    if hit is None:
        return None, h
    if hit[1] != task_id:
        raise PermissionDeniedError(f"device {hit[0]} is enrolled in another task, "
                                    f"not {task_id!r}")
    return hit[0], h


async def ingest(rt: Runtime, writer: UploadWriter, *, task_id: str, round_number: int,
                 device: tuple[str | None, str], headers: Mapping[str, str],
                 body: bytes) -> tuple[UploadReceipt, int | None]:
    """Parse, validate and store one upload; returns the receipt and, when the upload brought
    its round to quorum, the round id to close."""
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/octet-stream":
        missing = [k for k in BINARY_HEADERS if k not in headers]
        if missing:
            raise MalformedRequestError(f"binary upload needs the headers {missing}")
        try:
            version = int(headers["x-seedfed-version"])
            n = int(headers["x-seedfed-num-examples"])
            loss = float(headers["x-seedfed-loss"])
        except ValueError as e:
            raise MalformedRequestError(f"binary upload headers are not numbers: {e}") from e
        up = service.parse_binary_upload(body, task_id=task_id, round_number=round_number,
                                         version=version, num_examples=n, loss=loss)
    elif ctype in ("application/json", ""):
        up = service.parse_json_upload(body)
    else:
        raise MalformedRequestError(f"content type {ctype!r} is not accepted; send "
                                    "application/json or application/octet-stream")
    try:
        pending = service.check_upload(rt, task_id=task_id, round_number=round_number,
                                       device_id=device[0], token_hash=device[1], upload=up,
                                       wire_bytes=len(body))
    except Exception:
        rt.metrics.uploads.labels("rejected").inc()
        raise
    receipt = await asyncio.wrap_future(writer.submit(pending))
    assert isinstance(receipt, UploadReceipt)
    hit = rt.plan_cache.get(task_id)
    due = hit is not None and hit[0] == pending.round_id and \
        rt.upload_counts.get(pending.round_id, 0) >= hit[1].quorum
    return receipt, pending.round_id if due else None


class _Headers(dict[str, str]):
    """Lower-cased header names, looked up case-insensitively."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)


class UploadFastPath:
    """ASGI middleware answering the upload endpoint without FastAPI's per-request machinery."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = _PATH.match(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        state = getattr(scope.get("app"), "state", None)
        rt = getattr(state, "runtime", None)
        if m is None or rt is None:
            await self.app(scope, receive, send)
            return
        from ..app import status_of

        writer: UploadWriter = state.writer  # type: ignore[union-attr]
        headers = _Headers((k.decode("latin-1").lower(), v.decode("latin-1"))
                           for k, v in scope["headers"])
        task_id, round_number = m.group(1), int(m.group(2))
        due: int | None = None
        try:
            device = device_from_token(rt, task_id, headers.get("authorization"))
            chunks = []
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    break
            receipt, due = await ingest(rt, writer, task_id=task_id, round_number=round_number,
                                        device=device, headers=headers, body=b"".join(chunks))
            code, payload = 200, receipt.model_dump_json().encode()
        except SeedfedError as e:
            code = status_of(e)
            if code == 413:
                raise  # BodyLimit answers
            payload = json.dumps({"detail": str(e), "error": type(e).__name__}).encode()
        extra = [(b"www-authenticate", b"Bearer")] if code == 401 else []
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), *extra]})
        await send({"type": "http.response.body", "body": payload})
        if due is not None:  # like a background task: after the answer went out
            await run_in_threadpool(service.close_if_due, rt, task_id=task_id, round_id=due)
