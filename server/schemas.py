"""API schemas of the coordinator (requests and responses beyond the shared wire schemas;
`TaskStatus` and `CatchupPlan`, which clients read, live in `seedfed.shared.messages`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from seedfed.shared.messages import CatchupPlan as CatchupPlan  # the schemas devices read too
from seedfed.shared.messages import TaskStatus as TaskStatus
from seedfed.shared.wire import MAX_INT32

#: A round's deadline is at most a year after it opens.
MAX_ROUND_TIMEOUT_S = 365 * 24 * 3600.0


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
    """POST /v1/tasks. `spec` is a `seedfed.shared.task.TaskSpec` as a dict (`to_dict`)."""

    spec: dict[str, Any]
    name: str | None = Field(default=None, max_length=200)
    # Ranges: counts fit the 32-bit columns; a deadline must stay a representable datetime.
    quorum: int = Field(default=1, ge=1, le=MAX_INT32)
    round_timeout_s: float = Field(default=600.0, gt=0, le=MAX_ROUND_TIMEOUT_S,
                                   allow_inf_nan=False)
    devices_per_round: int | None = Field(default=None, ge=1, le=MAX_INT32)
    #: Devices the task's first join token may enroll (None: the coordinator's
    #: max_devices_per_join_token setting).
    max_devices_per_token: int | None = Field(default=None, ge=1, le=MAX_INT32)


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
    # The devices' held-out accuracies reported for the round (`DeviceMetrics`; issue 12):
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
    """One device in the stats (added for the dashboard, issue 3 item 6): who the
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
    """A task whose round close keeps failing (retried with backoff until it succeeds)."""

    task_id: str
    round: int | None
    attempts: int
    error: str
    retry_at: datetime


class Health(_Model):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


class Readiness(_Model):
    """GET /readyz. `degraded` (still ready, 200): the database and the store answer, but
    some task's round close is failing; it is retried with backoff and listed here."""

    status: Literal["ok", "degraded", "unavailable"]
    detail: str | None = None
    failing_closes: list[FailingClose] = Field(default_factory=list)
