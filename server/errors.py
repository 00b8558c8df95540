"""Typed domain errors of the coordinator, their HTTP statuses and the error body.

The in-process facade raises the errors as is; over HTTP every error is answered with the
status of `status_of` (one table, `STATUS`), the headers of `error_headers` and one JSON body,
`ErrorBody` (`error_payload`). This module sits below the app, the API layer and the service
layer alike, so the FastAPI handlers (`app.py`), the ASGI upload fast path (`api/ingest.py`)
and the OpenAPI document (`api/openapi.py`) all read the same table without importing each
other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict
from seedfed.shared.protocol.errors import (
    NonFiniteScalarError,
    SeedfedError,
    ShapeError,
    WireFormatError,
)


class CoordinatorError(SeedfedError):
    """Base of the coordinator's own errors."""


class NotFoundError(CoordinatorError, LookupError):
    """A task, device, round or version that does not exist."""


class AuthenticationError(CoordinatorError):
    """Missing, unknown or revoked credentials."""


class PermissionDeniedError(CoordinatorError):
    """Valid credentials that do not grant this action (e.g. a device of another task)."""


class ConflictError(CoordinatorError):
    """The request contradicts the current state (closed round, stale version, second upload)."""


class RoundClosedError(ConflictError):
    """The round is not open for uploads any more (aggregating, closed or expired)."""


class StaleVersionError(ConflictError):
    """An upload computed at a version other than the round's base version."""


class DuplicateUploadError(ConflictError):
    """A second, different upload from the same device in the same round."""


class RoundFullError(ConflictError):
    """An upload beyond the round's devices_per_round (the task's cap on participants)."""


class EmptyRoundError(ConflictError):
    """Closing a round that received no upload."""


class VersionAheadError(ConflictError):
    """A device names a version the task has not reached (`catchup?from=`, `log?since=`): its
    state is not one of the task's versions (e.g. the coordinator was restored from an older
    backup); it must load the current snapshot."""


class MalformedRequestError(CoordinatorError, ValueError):
    """A body that is not even syntactically valid (broken JSON, missing binary headers)."""


class FormatNotPublishedError(NotFoundError):
    """A snapshot asked for in a format the task does not publish (`?format=`): each version
    exists as fp32 and in the task's own format only."""


class InvalidUploadError(CoordinatorError, ValueError):
    """An upload that parses but breaks the round's rules (shape, bound, task, round)."""


class InvalidQueryError(CoordinatorError, ValueError):
    """A read whose parameters break a rule (a negative version, a rate that is not
    positive); over HTTP the routes' parameter bounds refuse these first."""


class InvalidMetricsError(CoordinatorError, ValueError):
    """Device metrics that parse but do not fit the round (a version the task never had, or
    one older than the round's base version)."""


class InvalidTaskError(CoordinatorError, ValueError):
    """A task definition that cannot be served (bad spec, unknown format, missing model)."""


class PayloadTooLargeError(CoordinatorError):
    """A request body above the configured limit."""


class RequestTimeoutError(CoordinatorError):
    """A request body that stopped arriving for the coordinator's body_timeout_s (answered by
    the connection guard, `server/connections.py`, which then closes the connection)."""


class StoreError(CoordinatorError):
    """A model store file is missing or does not match the checksum the database recorded."""


class UnavailableError(CoordinatorError):
    """A dependency failed in a way that passes (database down or locked, model store disk
    full): 503 with a Retry-After, nothing half-written, the same request works once it is back."""


class DatabaseUnavailableError(UnavailableError):
    """The database refused or lost the connection, or stayed locked past the busy timeout."""


class StoreUnavailableError(UnavailableError):
    """The model store could not write a file (disk full, read-only, I/O error)."""


#: The one mapping from errors to HTTP statuses (first match in MRO order wins).
STATUS: dict[type[BaseException], int] = {
    MalformedRequestError: 400,
    AuthenticationError: 401,
    PermissionDeniedError: 403,
    NotFoundError: 404,
    ConflictError: 409,
    RequestTimeoutError: 408,
    PayloadTooLargeError: 413,
    InvalidUploadError: 422,
    InvalidMetricsError: 422,
    InvalidQueryError: 422,
    InvalidTaskError: 422,
    WireFormatError: 422,
    ShapeError: 422,
    NonFiniteScalarError: 422,
    StoreError: 500,
    UnavailableError: 503,
    SeedfedError: 400,
}

#: Seconds a 503 (database or model store unavailable) asks the caller to wait.
RETRY_AFTER_S = 2


def fails_every_time(exc: BaseException) -> bool:
    """Whether a failed round close would fail the same way on every retry. A close is a
    function of stored rows (uploads, the task's spec and secret), so an error of that
    computation recurs: a protocol error (a non-finite update, a shape), arithmetic, a value or
    type error. An outage (database, model store) or a missing or damaged store file passes or
    can be repaired, and anything else unknown (e.g. a RuntimeError) keeps its retry."""
    if isinstance(exc, UnavailableError | StoreError | OSError):
        return False
    return isinstance(exc, SeedfedError | ArithmeticError | ValueError | TypeError)


def status_of(exc: BaseException) -> int:
    """The HTTP status of an error (500 for anything the table does not name)."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_headers(code: int) -> dict[str, str]:
    """The headers an error answer of status `code` carries besides its body."""
    if code == 401:
        return {"WWW-Authenticate": "Bearer"}
    if code == 503:
        return {"Retry-After": str(RETRY_AFTER_S)}
    return {}


class ValidationIssue(BaseModel):
    """One problem of a request that failed validation (422 `RequestValidationError`)."""

    model_config = ConfigDict(extra="forbid")
    loc: list[str | int]
    msg: str
    type: str


class ErrorBody(BaseModel):
    """The body of every error answer: what is wrong, and the error's type name (e.g.
    `NotFoundError`, `RequestValidationError`, `PayloadTooLargeError`)."""

    model_config = ConfigDict(extra="forbid")
    detail: str
    error: str
    #: Request validation only: each offending field (the input itself is not echoed).
    errors: list[ValidationIssue] | None = None


def _clean(text: str) -> str:
    # A lone surrogate (JSON allows "\ud800") cannot be encoded as UTF-8; an error message that
    # echoes one must not turn a 4xx into a 500 while it is rendered.
    return text.encode("utf-8", "replace").decode("utf-8")


def error_payload(detail: str, error: str,
                  issues: Sequence[Mapping[str, Any]] | None = None) -> bytes:
    """The UTF-8 JSON bytes of an ErrorBody (the app's handlers, the ASGI fast path and the
    body limit all answer with these)."""
    body: dict[str, Any] = {"detail": _clean(detail), "error": error}
    if issues is not None:
        body["errors"] = [{"loc": [_clean(p) if isinstance(p, str) else p
                                   for p in i.get("loc", ())],
                           "msg": _clean(str(i.get("msg", ""))),
                           "type": _clean(str(i.get("type", "")))} for i in issues]
    return json.dumps(body, ensure_ascii=False).encode("utf-8")
