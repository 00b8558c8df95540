"""API schemas of the coordinator (requests and responses beyond the shared wire schemas;
`TaskStatus` and `CatchupPlan`, which clients read, live in `seedfed.shared.protocol.messages`)."""

from __future__ import annotations

import unicodedata
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from seedfed.shared.protocol.messages import (
    CatchupPlan as CatchupPlan,  # the schemas devices read too
)
from seedfed.shared.protocol.messages import TaskStatus as TaskStatus
from seedfed.shared.protocol.wire import MAX_INT32

#: A round's deadline is at most a year after it opens.
MAX_ROUND_TIMEOUT_S = 365 * 24 * 3600.0
#: ... and at least a second: the ticker checks deadlines once a second (`tick_interval_s`),
#: and a shorter one would end every round before any device could fetch its plan.
MIN_ROUND_TIMEOUT_S = 1.0


def printable_name(value: str | None) -> str | None:
    """`value` if it holds no control, format or separator character (ANSI escapes, newlines,
    bidirectional overrides, zero-width characters): a name is printed in terminals and on
    the dashboard, where such characters would rewrite what an operator sees."""
    if value is None:
        return None
    for ch in value:
        category = unicodedata.category(ch)
        if category[0] == "C" or category in ("Zl", "Zp"):
            raise ValueError(f"must be printable text: character U+{ord(ch):04X} "
                             f"({category}) is not allowed")
    return value
#: Who opens a task's rounds (`orm.Schedule`).
Schedule = Literal["auto", "manual"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _storable_text(data: Any) -> Any:
    """Refuse strings the database cannot store or UTF-8 cannot encode, anywhere in a request
    body (nested `spec` included): NUL (PostgreSQL text) and lone surrogates (JSON can spell
    "\\ud800"). Iterative, so a deeply nested body cannot exhaust the stack."""
    stack = [data]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                raise ValueError("strings must not contain NUL characters")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return data


class _Request(_Model):
    """A request body: every string in it is storable text, and every field has the type its
    schema says (strict: `true` is not the integer 1, nor `"3"` the integer 3), so what the
    OpenAPI document calls invalid is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        return _storable_text(data)


class TaskCreate(_Request):
    """POST /v1/tasks. `spec` is a `seedfed.shared.protocol.task.TaskSpec` as a dict (`to_dict`)."""

    spec: dict[str, Any]
    name: str | None = Field(default=None, max_length=200,
                             description="printable text: no control, format or line "
                                         "separator characters")
    # Ranges: counts fit the 32-bit columns; a deadline must stay a representable datetime
    # and give devices time to answer.
    quorum: int = Field(default=1, ge=1, le=MAX_INT32)
    round_timeout_s: float = Field(default=600.0, ge=MIN_ROUND_TIMEOUT_S,
                                   le=MAX_ROUND_TIMEOUT_S, allow_inf_nan=False)
    devices_per_round: int | None = Field(default=None, ge=1, le=MAX_INT32)
    #: Devices the task's first join token may enroll (None: the coordinator's
    #: max_devices_per_join_token setting).
    max_devices_per_token: int | None = Field(default=None, ge=1, le=MAX_INT32)
    #: Who opens rounds: "auto" (the coordinator: the first once a device enrolled, then the
    #: next as soon as one ends) or "manual" (only `POST .../rounds`).
    schedule: Schedule = "auto"
    #: The automatic schedule stops once the task reached this version (None: no limit).
    max_rounds: int | None = Field(default=None, ge=1, le=MAX_INT32)

    @field_validator("name")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        return printable_name(value)


class ScheduleUpdate(_Request):
    """PATCH /v1/tasks/{id}/schedule: who opens the task's rounds from now on, and the
    schedule's limit. A field left out keeps its value; `max_rounds: null` removes the limit."""

    schedule: Schedule | None = None
    max_rounds: int | None = Field(default=None, ge=1, le=MAX_INT32)


class AbandonRequest(_Request):
    """POST /v1/tasks/{id}/rounds/{n}/abandon: why (kept with the round, shown in the task's
    status and on the dashboard)."""

    reason: str = Field(min_length=1, max_length=500)

    @field_validator("reason")
    @classmethod
    def _said(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the reason must say something (not only spaces)")
        return value.strip()


class AbandonedRound(_Model):
    """A round ended by an operator without a new version: its uploads are not aggregated, and
    the task goes on from its committed version."""

    task_id: str
    round: int
    base_version: int
    version: int  # the task's version, from which the next round starts
    uploads: int  # uploads the round had received (not aggregated)
    reason: str
    abandoned_at: datetime


class TaskCreated(_Model):
    task_id: str
    join_token: str  # shown once; devices enroll with it
    version: int
    checksum: str


class RoundMetrics(_Model):
    """Per-round figures. Bytes: `upload_bytes` is what devices sent (wire bytes), and
    `download_bytes` what participants must fetch to follow the round by replay (the plan plus
    the resulting log entry, as JSON); `fedavg_bytes` is what FedAvg would have moved for the
    same participants (each downloads and uploads the fp32 trainable tensors)."""

    round: int
    version: int | None  # the version the round produced (None: open, aggregating, expired)
    base_version: int
    state: str
    participants: int
    loss: float | None
    upload_bytes: int
    download_bytes: int
    fedavg_bytes: int
    opened_at: datetime
    closed_at: datetime | None
    aggregation_seconds: float | None
    #: Why an abandoned round ended (None for the other states).
    abandon_reason: str | None = None
    # The devices' held-out accuracies reported for the round (`DeviceMetrics`):
    # the mean and the worst decile (`shared.fleet_stats`) of the shared model's accuracy
    # over every reporting device, and of the personalized accuracy over those with a
    # personal part. Additive: None (0 devices) when no device reported.
    metric_devices: int = 0
    personal_devices: int = 0
    shared_accuracy_mean: float | None = None
    shared_accuracy_worst_decile: float | None = None
    personal_accuracy_mean: float | None = None
    personal_accuracy_worst_decile: float | None = None
    local_accuracy_mean: float | None = None  # the local-only reference heads


class DeviceSummary(_Model):
    """One device in the stats (the dashboard's device list): who the
    `devices_seen` count is, and which devices went quiet."""

    device_id: str
    enrolled_at: datetime
    last_seen_at: datetime | None
    uploads: int  # uploads accepted from this device, all rounds
    last_round: int | None  # the latest round it uploaded to
    revoked_at: datetime | None


class TaskStats(_Model):
    task_id: str
    name: str
    version: int
    scope_numel: int
    devices_enrolled: int
    devices_revoked: int
    devices_seen: int
    fedavg_bytes_per_participant: int
    epsilon: float | None
    rounds: list[RoundMetrics]
    # Added for the dashboard: the most recently seen devices (at most DEVICE_LIST_LIMIT in
    # service/log.py; the counts above cover all of them). Additive, defaults to empty.
    devices: list[DeviceSummary] = Field(default_factory=list)


class JoinTokenCreate(_Request):
    """POST /v1/tasks/{id}/join-tokens: a new join token; by default the others are revoked
    (rotation). Devices already enrolled stay enrolled either way."""

    max_devices: int | None = Field(default=None, ge=1, le=MAX_INT32)
    revoke_others: bool = True


class JoinTokenCreated(_Model):
    token_id: str
    join_token: str  # shown once; stored hashed
    max_devices: int
    revoked: list[str]  # ids of the tokens this rotation revoked


class JoinTokenInfo(_Model):
    token_id: str
    max_devices: int  # the limit in force (the setting's default when none was given)
    enrolled: int
    created_at: datetime
    revoked_at: datetime | None


class EnrollRequest(_Request):
    join_token: str = Field(max_length=1024)


class Enrollment(_Model):
    task_id: str
    device_id: str
    token: str  # shown once; stored hashed


class UploadReceipt(_Model):
    task_id: str
    round: int
    device_id: str
    digest: str  # SHA-256 of the upload's content (version, shape, scalars, count, loss)
    received_at: datetime


class MetricsReceipt(_Model):
    """POST /v1/tasks/{id}/rounds/{n}/metrics: the report stored (it replaced any earlier
    report of the device for the round)."""

    task_id: str
    round: int
    device_id: str
    version: int
    received_at: datetime


class FailingClose(_Model):
    """A task whose round close keeps failing: retried with backoff until it succeeds, or, when
    it fails on every attempt (`permanent`: a deterministic error such as a non-finite update),
    not retried (`retry_at` None) until an operator abandons the round."""

    task_id: str
    round: int | None
    attempts: int
    error: str
    retry_at: datetime | None
    permanent: bool = False


class Health(_Model):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


class Readiness(_Model):
    """GET /readyz. `degraded` (still ready, 200): the database and the store answer, but
    some task's round close is failing; each is listed here, retried with backoff or, when it
    fails on every attempt, waiting for an operator to abandon the round."""

    status: Literal["ok", "degraded", "unavailable"]
    detail: str | None = None
    failing_closes: list[FailingClose] = Field(default_factory=list)
