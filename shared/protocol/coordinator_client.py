"""One HTTP client of the coordinator's REST API, for the REST device and the ServerApp.

Every call returns the shared schema of its response (`wire`, `messages`), and a refusal
raises CoordinatorHttpError with the status and the reason the coordinator gave (its JSON
`detail`); a coordinator that cannot be reached raises CoordinatorUnreachableError naming
its URL. Paths and headers come from `messages`, so both callers speak the routes the
coordinator serves. Every token the client sends or receives is remembered by
`shared.redact`, so no message or log line that passes through `redact` shows it.
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
from seedfed.shared.protocol.errors import SeedfedError, UserError
from seedfed.shared.protocol.messages import (
    BINARY_CONTENT_TYPE,
    HEADER_CHECKSUM,
    HEADER_LOSS,
    HEADER_NUM_EXAMPLES,
    HEADER_VERSION,
    CatchupPlan,
    Routes,
    TaskStatus,
)
from seedfed.shared.protocol.redact import redact, redact_url, remember
from seedfed.shared.protocol.wire import DeviceMetrics, LogEntryWire, RoundPlan, pack_binary


class CoordinatorHttpError(SeedfedError, RuntimeError):
    """The coordinator refused a request; carries its status and the reason it gave."""

    def __init__(self, status: int, method: str, path: str, detail: str,
                 error: str | None = None, url: str = "") -> None:
        super().__init__(f"{method} {path} -> {status}: {detail}")
        self.status = status
        self.detail = detail
        #: The error's type name from the body (`NotFoundError`, ...); None if it had none.
        self.error = error
        #: The coordinator's base URL (no password, no query), "" when unknown.
        self.url = url


class CoordinatorUnreachableError(UserError, ConnectionError):
    """No HTTP answer from the coordinator (refused, timed out, unknown host, broken
    connection); names its URL, never a header."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach the coordinator at {url} ({reason})",
                         "check that it is running and that the URL (--url) is right")
        self.url = url


def _reason(e: httpx.TransportError) -> str:
    """A transport error in a few words (httpx's own text, or its kind when it has none)."""
    if isinstance(e, httpx.TimeoutException):
        return "no answer in time"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return redact(text) or type(e).__name__


class CoordinatorClient:
    """The coordinator's REST API for one caller; `token` is its bearer token (a device's, or
    the admin's), None for the calls that need none (enrolling with a join token)."""

    def __init__(self, http: httpx.Client, token: str | None = None) -> None:
        self.http = http
        self.token = token
        remember(token)

    @property
    def url(self) -> str:
        """The coordinator's base URL, fit for a message (no password, no query)."""
        return redact_url(str(self.http.base_url)).rstrip("/")

    def request(self, method: str, path: str, *, token: str | None = None, auth: bool = True,
                **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        bearer = token or self.token
        remember(bearer)
        if auth and bearer is not None:
            headers["Authorization"] = f"Bearer {bearer}"
        try:
            resp = self.http.request(method, path, headers=headers, **kwargs)
        except httpx.TransportError as e:
            # httpx's exception holds the request and its headers: keep it out of the chain
            raise CoordinatorUnreachableError(self.url, _reason(e)) from None
        if resp.status_code >= 400:
            error = None
            try:
                body = resp.json()
                detail = str(body.get("detail", resp.text))
                error = str(body["error"]) if "error" in body else None
            except (ValueError, AttributeError):
                detail = resp.text
            raise CoordinatorHttpError(resp.status_code, method, path, redact(detail), error,
                                       self.url)
        return resp

    # -- reading a task --------------------------------------------------------------------------
    def status(self, task_id: str) -> TaskStatus:
        return TaskStatus.model_validate(self.request("GET", Routes(task_id).task).json())

    def spec(self, task_id: str) -> dict[str, Any]:
        """The task definition as TaskSpec's dict (`TaskSpec.from_dict`)."""
        return dict(self.request("GET", Routes(task_id).spec).json())

    def catchup(self, task_id: str, from_version: int, bandwidth: float | None = None,
                regen_rate: float | None = None) -> CatchupPlan:
        """The catch-up plan from `from_version`; `bandwidth` (bytes/s) and `regen_rate`
        (elements x seeds per second) are the caller's own rates (the route's defaults when
        None)."""
        params: dict[str, Any] = {"from": from_version}
        if bandwidth is not None:
            params["bandwidth"] = bandwidth
        if regen_rate is not None:
            params["regen_rate"] = regen_rate
        return CatchupPlan.model_validate(
            self.request("GET", Routes(task_id).catchup, params=params).json())

    def log_since(self, task_id: str, since: int, limit: int | None = None,
                  ) -> list[LogEntryWire]:
        params: dict[str, Any] = {"since": since}
        if limit is not None:
            params["limit"] = limit
        return [LogEntryWire.model_validate(e)
                for e in self.request("GET", Routes(task_id).log, params=params).json()]

    def snapshot(self, task_id: str, version: int, fmt: str | None = None,
                 ) -> tuple[bytes, str]:
        """(the snapshot file of `version`, fp32 or the published `fmt`; its state checksum)."""
        resp = self.request("GET", Routes(task_id).snapshot(version),
                            params={} if fmt is None else {"format": fmt})
        return resp.content, resp.headers[HEADER_CHECKSUM]

    def current_plan(self, task_id: str) -> RoundPlan | None:
        """The open round's plan; None when no round is open."""
        try:
            return RoundPlan.model_validate(
                self.request("GET", Routes(task_id).current_round).json())
        except CoordinatorHttpError as e:
            if e.status == 404:
                return None
            raise

    # -- taking part -----------------------------------------------------------------------------
    def enroll(self, task_id: str, join_token: str) -> tuple[str, str]:
        """(device id, device token) for a new device of the task (the join token is its
        credential: no bearer token goes with it)."""
        remember(join_token)
        body = self.request("POST", Routes(task_id).devices, auth=False,
                            json={"join_token": join_token}).json()
        remember(str(body["token"]))
        return str(body["device_id"]), str(body["token"])

    def upload(self, task_id: str, round_number: int, version: int, scalars: np.ndarray,
               num_examples: int, loss: float, *, token: str | None = None) -> int:
        """Upload a round's scalars (computed at `version`) in the binary form; returns the
        bytes of the body, the upload's bytes on the wire."""
        body = pack_binary(scalars)
        self.request("POST", Routes(task_id).uploads(round_number), token=token, content=body,
                     headers={"Content-Type": BINARY_CONTENT_TYPE,
                              HEADER_VERSION: str(version),
                              HEADER_NUM_EXAMPLES: str(num_examples),
                              HEADER_LOSS: repr(float(loss))})
        return len(body)

    def report_metrics(self, task_id: str, round_number: int, metrics: DeviceMetrics, *,
                       token: str | None = None) -> None:
        """A device's held-out accuracies for a round (numbers only; a repeat replaces)."""
        self.request("POST", Routes(task_id).metrics(round_number), token=token,
                     content=metrics.model_dump_json(),
                     headers={"Content-Type": "application/json"})

    # -- running rounds (admin) ------------------------------------------------------------------
    def open_round(self, task_id: str) -> RoundPlan:
        return RoundPlan.model_validate(self.request("POST", Routes(task_id).rounds).json())

    def close_round(self, task_id: str, round_number: int) -> LogEntryWire:
        return LogEntryWire.model_validate(
            self.request("POST", Routes(task_id).close(round_number)).json())
