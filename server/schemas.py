"""API schemas of the coordinator (requests and responses beyond the shared wire schemas)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskCreate(_Model):
    """POST /v1/tasks. `spec` is a `seedfed.shared.task.TaskSpec` as a dict (`to_dict`)."""

    spec: dict[str, Any]
    name: str | None = Field(default=None, max_length=200)
    quorum: int = Field(default=1, ge=1)
    round_timeout_s: float = Field(default=600.0, gt=0)
    devices_per_round: int | None = Field(default=None, ge=1)


class TaskCreated(_Model):
    task_id: str
    join_token: str  # shown once; devices enroll with it
    version: int
    checksum: str


class TaskStatus(_Model):
    task_id: str
    name: str
    version: int
    checksum: str
    round: int | None  # latest round number, None before the first
    state: Literal["idle", "open", "aggregating"]
    devices: int  # enrolled and not revoked
    devices_seen: int  # devices that uploaded at least once
    quorum: int
    round_timeout_s: float
    devices_per_round: int | None
    scope: str
    scope_numel: int
    format: str
    aggregation: str
    epsilon: float | None  # client-level DP epsilon so far (None: DP off)
    delta: float | None
    created_at: datetime


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


class EnrollRequest(_Model):
    join_token: str


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


class CatchupPlan(_Model):
    task_id: str
    from_version: int
    to_version: int
    action: Literal["none", "replay", "download"]
    replay_seeds: int
    replay_bytes: int
    replay_seconds: float
    download_bytes: int
    download_seconds: float
    #: Mask epoch of the target version (ternary tasks; None for scopes without epochs).
    mask_epoch: int | None = None
    #: Why the action is forced rather than the cheaper one (e.g. a mask epoch start).
    reason: str | None = None


class Health(_Model):
    status: Literal["ok", "unavailable"]
    detail: str | None = None
