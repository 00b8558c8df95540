"""The upload path, shared by the documented FastAPI route and an ASGI fast path.

Uploads are the one hot endpoint (every device, every round). FastAPI's routing and
dependency solving cost more CPU per request than the validation and the batched insert
together (measured with `seedfed bench ingest`), so `UploadFastPath` answers
`POST /v1/tasks/{task_id}/rounds/{round}/uploads` directly at the ASGI level with the same
function the route uses (`ingest`); the route stays for OpenAPI and as the fallback
(`Settings.upload_fast_path=False`). Both answer identically: same receipt, same typed errors.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping

from fastapi.concurrency import run_in_threadpool
from seedfed.server import service
from seedfed.server.connections import trust
from seedfed.server.errors import MalformedRequestError, error_headers, error_payload, status_of
from seedfed.server.runtime import Runtime
from seedfed.server.schemas import UploadReceipt
from seedfed.server.service.uploads import UploadWriter
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.messages import UPLOAD_HEADERS
from seedfed.shared.protocol.wire import MAX_ROUND, Upload
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger("seedfed.server")

BINARY_HEADERS = UPLOAD_HEADERS  # X-Seedfed-Version, -Num-Examples, -Loss
# Only ids and round numbers inside their documented ranges take the fast path; anything else
# falls through to the route, whose parameter validation answers the 422.
_PATH = re.compile(r"^/v1/tasks/([A-Za-z0-9._~-]{1,64})/rounds/(\d{1,10})/uploads/?$")


_INT = re.compile(r"^[0-9]{1,10}$")
_FLOAT = re.compile(r"^-?[0-9]{1,20}(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?$")


def _binary_number(headers: Mapping[str, str], name: str, pattern: re.Pattern[str]) -> str:
    """A binary upload header's value, if it is spelled as a plain decimal number (strict, like
    JSON: no spaces, underscores, signs on counts, "nan" or "inf")."""
    value = headers[name]
    if not pattern.fullmatch(value):
        raise MalformedRequestError(f"binary upload header {name} is not a plain decimal "
                                    f"number: {value[:40]!r}")
    return value


def parse_upload(headers: Mapping[str, str], body: bytes, *, task_id: str,
                 round_number: int) -> Upload:
    """The upload in either form (JSON `Upload`, or the binary matrix plus headers)."""
    ctype = (headers.get("content-type") or "").split(";")[0].strip().lower()
    if ctype == "application/octet-stream":
        missing = [k for k in BINARY_HEADERS if k not in headers]
        if missing:
            raise MalformedRequestError(f"binary upload needs the headers {missing}")
        version = int(_binary_number(headers, "x-seedfed-version", _INT))
        n = int(_binary_number(headers, "x-seedfed-num-examples", _INT))
        loss = float(_binary_number(headers, "x-seedfed-loss", _FLOAT))
        return service.parse_binary_upload(body, task_id=task_id, round_number=round_number,
                                           version=version, num_examples=n, loss=loss)
    if ctype in ("application/json", ""):
        return service.parse_json_upload(body)
    raise MalformedRequestError(f"content type {ctype!r} is not accepted; send "
                                "application/json or application/octet-stream")


async def ingest(rt: Runtime, writer: UploadWriter, *, task_id: str, round_number: int,
                 device: tuple[str | None, str], headers: Mapping[str, str],
                 body: bytes) -> tuple[UploadReceipt, int | None]:
    """Parse, validate and store one upload; returns the receipt and, when the upload brought
    its round to quorum, the round id to close.

    Authentication comes first: a cached token is known here, an uncached one is checked
    with its write batch; but if the upload is refused before that, the token is checked
    now (one query, on the refusal path only), so a bogus token gets a 401 and learns
    nothing of the round's state, version or plan shape."""
    try:
        up = parse_upload(headers, body, task_id=task_id, round_number=round_number)
        pending = service.check_upload(rt, task_id=task_id, round_number=round_number,
                                       device_id=device[0], token_hash=device[1], upload=up,
                                       wire_bytes=len(body))
    except Exception:
        service.count_rejected(rt)
        if device[0] is None:
            await run_in_threadpool(service.authenticate_hash, rt, task_id=task_id,
                                    token_hash=device[1])
        raise
    if isinstance(pending, UploadReceipt):  # a retry of an upload to a round closed since
        return pending, None
    receipt = await asyncio.wrap_future(writer.submit(pending))
    assert isinstance(receipt, UploadReceipt)
    due = service.is_due(rt, task_id=task_id, round_id=pending.round_id)
    return receipt, pending.round_id if due else None


def close_after_answer(rt: Runtime, *, task_id: str, round_id: int) -> None:
    """Close a round an upload brought to quorum, after that upload's answer went out.

    Nobody is waiting for this close: if it fails (the database went away, a file could not
    be written), the log gets one line and the round stays for the ticker, which finds it
    due and retries with backoff (`service.tick`). A traceback here would be noise in an
    outage, printed once per upload."""
    try:
        service.close_if_due(rt, task_id=task_id, round_id=round_id)
    except Exception as e:  # noqa: BLE001 (every failure is the ticker's to retry)
        cause = str(e).strip().splitlines()
        logger.warning("closing round %d of task %s after an upload failed (%s: %s); the "
                       "ticker retries it", round_id, task_id, type(e).__name__,
                       cause[0][:200] if cause else "")


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
        if m is None or rt is None or int(m.group(2)) > MAX_ROUND:
            await self.app(scope, receive, send)
            return
        writer: UploadWriter = state.writer  # type: ignore[union-attr]
        headers = _Headers((k.decode("latin-1").lower(), v.decode("latin-1"))
                           for k, v in scope["headers"])
        task_id, round_number = m.group(1), int(m.group(2))
        due: int | None = None
        read = False  # whether the whole body was read
        try:
            device = service.bearer_device(rt, task_id=task_id,
                                           authorization=headers.get("authorization"))
            if device[0] is not None:  # a cached token: authenticated already
                trust(scope)
            chunks = []
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    break
            read = True
            receipt, due = await ingest(rt, writer, task_id=task_id, round_number=round_number,
                                        device=device, headers=headers, body=b"".join(chunks))
            trust(scope)  # the upload's token was accepted
            code, payload = 200, receipt.model_dump_json().encode()
        except SeedfedError as e:
            code = status_of(e)
            payload = error_payload(str(e), type(e).__name__)
        # The same headers as the app's handler (401: WWW-Authenticate, 503: Retry-After).
        extra = [(k.lower().encode(), v.encode()) for k, v in error_headers(code).items()]
        if not read:  # answered before the body (a bad token): do not read the rest of it
            extra.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), *extra]})
        await send({"type": "http.response.body", "body": payload})
        if due is not None:  # like a background task: after the answer went out
            await run_in_threadpool(close_after_answer, rt, task_id=task_id, round_id=due)
