"""The coordinator's HTTP contract: the error body, the documented statuses of each route, and
the ranges of path and query parameters.

Every error the service answers, whatever raised it (a typed domain error, FastAPI's request
validation, Starlette's routing, the body limit), has one JSON body, `ErrorBody`, so a client
or a schema-driven fuzzer can rely on the OpenAPI document: each route lists the statuses it
can return with that schema (`responses=errors(...)` on the route decorators).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from fastapi import Path
from fastapi.responses import JSONResponse

# The error body and its encoding live below the API layer (the fast path, the app's handlers
# and this document share them); re-exported here, where the contract is described.
from seedfed.server.errors import ErrorBody, ValidationIssue, error_payload
from seedfed.shared.protocol.wire import MAX_ROUND, MAX_VERSION

__all__ = ["DeviceIdPath", "ErrorBody", "RoundPath", "TaskIdPath", "ValidationIssue",
           "VersionPath", "error_payload", "error_response", "errors", "install",
           "validation_issues"]

#: Rounds and versions have the wire's ranges (32-bit INTEGER columns): a larger number cannot
#: name a stored row, and refusing it here keeps it away from the database driver, which
#: raises on integers it cannot bind (>= 2**63 on SQLite).
MAX_INDEX = min(MAX_ROUND, MAX_VERSION)

#: Task and device ids are 16 hex digits (`secrets.token_hex(8)`); the pattern is looser (URL
#: unreserved characters) so that an unknown but well-formed id is a 404, while NUL and other
#: control bytes, which PostgreSQL text cannot hold, are a 422 before any query.
ID_PATTERN = r"^[A-Za-z0-9._~-]{1,64}$"

TaskIdPath = Annotated[str, Path(pattern=ID_PATTERN, description="task id (16 hex digits)")]
DeviceIdPath = Annotated[str, Path(pattern=ID_PATTERN, description="device id")]
RoundPath = Annotated[int, Path(ge=0, le=MAX_ROUND, description="round number")]
VersionPath = Annotated[int, Path(ge=0, le=MAX_VERSION, description="model version")]


_WHAT = {
    400: "Malformed request: broken JSON or binary upload headers, unreadable body",
    401: "Missing, unknown or revoked token (admin token, device token or join token)",
    403: "A device token of another task, or a join token that has enrolled its limit",
    404: "Unknown task, device, round or version (or a pruned snapshot)",
    409: "Conflicts with the current state: closed or aggregating round, stale version, a "
         "different second upload, an empty round, a round at its devices_per_round",
    413: "Request body above the coordinator's max_body_bytes",
    422: "Invalid request: a parameter or body outside its schema or range, or an upload that "
         "breaks the round's rules (shape, non-finite or too large scalars, task or round "
         "mismatch, bad task spec)",
    500: "Internal error: a model store file is missing or does not match the database",
    503: "The database or the model store is unavailable (down, locked, disk full); nothing "
         "was half-written, retry after the Retry-After seconds",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each status with the ErrorBody schema and what it means.
    503 is always included: every route that lists errors reads the database."""
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorBody, "description": _WHAT[code]} for code in (*codes, 503)}
    out[503]["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                           "description": "seconds to wait"}}
    return out


class ErrorResponse(JSONResponse):
    """A JSONResponse whose content is already the encoded ErrorBody."""

    def render(self, content: Any) -> bytes:
        assert isinstance(content, bytes)
        return content


def error_response(code: int, detail: str, error: str, *,
                   issues: Sequence[Mapping[str, Any]] | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return ErrorResponse(error_payload(detail, error, issues), status_code=code,
                         headers=dict(headers) if headers else None)


def validation_issues(errs: Sequence[Any]) -> tuple[str, list[dict[str, Any]]]:
    """(one-line summary, issues) of pydantic/FastAPI validation errors, at most 20 of them."""
    issues: list[dict[str, Any]] = []
    for e in errs:
        issue = {"loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())],
                 "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        # A path parameter that a dependency declares too is validated once per declaration;
        # the caller needs to read the problem once.
        if issue not in issues:
            issues.append(issue)
        if len(issues) == 20:
            break
    summary = "; ".join(f"{'.'.join(str(p) for p in i['loc']) or 'request'}: {i['msg']}"
                        for i in issues[:5])
    return summary or "invalid request", issues


def install(app: Any) -> None:
    """Make the app's OpenAPI document say what the app answers, for routes that did not list
    their errors: FastAPI adds a default 422 with its own `HTTPValidationError` body, but the
    app's handler answers an ErrorBody (seedfed.server.app); any such 422 is rewritten."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc: dict[str, Any] = build()
        ref = "#/components/schemas/ErrorBody"
        for ops in doc.get("paths", {}).values():
            for op in ops.values():
                resp = op.get("responses", {}).get("422")
                schema = (resp or {}).get("content", {}).get("application/json", {}) \
                    .get("schema", {})
                if schema.get("$ref", "").endswith("/HTTPValidationError"):
                    resp["content"]["application/json"]["schema"] = {"$ref": ref}
                    resp["description"] = _WHAT[422]
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        if "ErrorBody" not in schemas:
            body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            schemas["ErrorBody"] = body
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
