"""The REST messages both sides read beyond `wire.py`'s: task status, catch-up plan, the
`X-Seedfed-*` headers, the route paths and the catch-up cost model.

The coordinator serves these and devices (and the ServerApp's REST mode) read them, so each is
written once here: a renamed field or header cannot drift between the two sides.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: What a task waits for (`TaskStatus.waiting_for`; `waiting` says it in words):
#: devices: an automatic task whose first round opens when a device enrolls;
#: uploads: the open round, until its quorum or its deadline;
#: aggregation: its close is running; close_retry: its close failed and is retried;
#: operator: rounds run by hand (or a close that fails on every attempt: abandon the round);
#: round_limit: the automatic schedule reached `max_rounds`; schedule: the next round opens now.
Waiting = Literal["devices", "uploads", "aggregation", "close_retry", "operator", "round_limit",
                  "schedule"]


class TaskStatus(_Message):
    """GET /v1/tasks/{task_id}."""

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
    #: A failing round close: "TypeName: message" of the last attempt, how many attempts
    #: failed, and when the coordinator retries (None / 0 / None while nothing fails).
    close_error: str | None = None
    close_attempts: int = 0
    close_retry_at: datetime | None = None
    #: The failing close fails on every attempt (a deterministic error, e.g. a non-finite
    #: update): it is not retried; abandoning the round lets the task go on.
    close_permanent: bool = False
    #: Who opens rounds: "auto" (the coordinator, back to back, until version `max_rounds`)
    #: or "manual" (only `POST .../rounds`).
    schedule: Literal["auto", "manual"] = "manual"
    max_rounds: int | None = None
    #: The open round: uploads accepted so far and its deadline (0 / None when none is open).
    uploads: int = 0
    deadline: datetime | None = None
    #: What the task waits for, as a keyword (`Waiting`) and in words.
    waiting_for: Waiting | None = None
    waiting: str | None = None
    #: The latest abandoned round and why it was abandoned (None: none was).
    abandoned_round: int | None = None
    abandon_reason: str | None = None


class CatchupPlan(_Message):
    """GET /v1/tasks/{task_id}/catchup: replay the log or download a snapshot."""

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


# -- catch-up cost model -----------------------------------------------------------------------
#: Bytes a log entry costs on the wire per seed: a 16-digit seed and a base64 float32, with
#: separators.
ENTRY_BYTES_PER_SEED = 26
#: Bytes of a log entry besides its seeds and coefficients (ids, checksum, JSON keys).
ENTRY_OVERHEAD_BYTES = 200


def replay_bytes(entries: int, seeds: int) -> int:
    """Estimated download of `entries` log entries holding `seeds` seeds in all."""
    return entries * ENTRY_OVERHEAD_BYTES + seeds * ENTRY_BYTES_PER_SEED


# -- headers -----------------------------------------------------------------------------------
#: Binary upload: the model version the scalars were computed at.
HEADER_VERSION = "X-Seedfed-Version"
#: Binary upload: the aggregation weight (the device's training-set size).
HEADER_NUM_EXAMPLES = "X-Seedfed-Num-Examples"
#: Binary upload: the device's mean training loss (a float's repr).
HEADER_LOSS = "X-Seedfed-Loss"
#: Snapshot download: the state checksum of the version.
HEADER_CHECKSUM = "X-Seedfed-Checksum"
#: Snapshot download: SHA-256 of the file.
HEADER_SHA256 = "X-Seedfed-SHA256"
#: Snapshot download: the snapshot's format (fp32, or the task's published format).
HEADER_FORMAT = "X-Seedfed-Format"
#: The headers a binary upload needs besides its body.
UPLOAD_HEADERS = (HEADER_VERSION, HEADER_NUM_EXAMPLES, HEADER_LOSS)
#: Content type of the binary scalar form (`wire.pack_binary`).
BINARY_CONTENT_TYPE = "application/octet-stream"


# -- routes ------------------------------------------------------------------------------------
class Routes:
    """The coordinator's paths of one task, as a client calls them (the server's routes in
    `server/api/routes/` serve these)."""

    ROOT = "/v1/tasks"

    def __init__(self, task_id: str) -> None:
        task = f"{self.ROOT}/{task_id}"
        self.task = task
        self.devices = f"{task}/devices"  # POST: enroll with the join token
        self.spec = f"{task}/spec"
        self.catchup = f"{task}/catchup"
        self.log = f"{task}/log"
        self.rounds = f"{task}/rounds"  # POST: open a round (admin)
        self.current_round = f"{task}/rounds/current"
        self.schedule = f"{task}/schedule"  # PATCH: auto or manual rounds, the limit (admin)

    def device(self, device_id: str) -> str:
        return f"{self.devices}/{device_id}"  # DELETE: revoke (admin)

    def snapshot(self, version: int) -> str:
        return f"{self.task}/snapshots/{version}"

    def uploads(self, round_number: int) -> str:
        return f"{self.task}/rounds/{round_number}/uploads"

    def close(self, round_number: int) -> str:
        return f"{self.task}/rounds/{round_number}/close"

    def abandon(self, round_number: int) -> str:
        return f"{self.task}/rounds/{round_number}/abandon"  # POST: end it, no version (admin)

    def metrics(self, round_number: int) -> str:
        return f"{self.task}/rounds/{round_number}/metrics"  # POST: a device's held-out scores
