"""The Flower messages between the ServerApp strategy and the ClientApp, as typed classes.

Every message and reply carries one ConfigRecord under the key `RECORD`; `to_record()` writes
it and `from_record()` reads it back, refusing a missing or mistyped value with a
WireFormatError. Both sides import these classes, so no record key is spelled twice.

- TRAIN (`TrainIns`): the round plan (RoundPlan JSON) and how to reach its version.
- TRAIN reply (`TrainRes`): the scalar matrix (`wire.pack_binary`), the aggregation weight,
  the mean loss. Nothing else leaves the device.
- EVALUATE, the sync phase (`SyncIns`): the target version and checksum, how to reach it.
- EVALUATE reply (`SyncRes`): the version and checksum the device now holds, and a
  MetricRecord `METRICS` with its local held-out accuracy, loss and example count, and for a
  device with a personal part the same held-out set's accuracy personalized and local-only
  (numbers only: no personal parameter or example is ever in a message).

How to reach a version (`CatchUp`): nothing, `entries` (a JSON list of LogEntryWire JSON) from
the version the device last confirmed, or `snapshot` (safetensors bytes) with its version,
checksum and format ("fp32" trainable state, written as an absent key, or "ternary": the
published packed snapshot), plus `task` (TaskSpec JSON) for a device that is new or re-syncing.
Keys are written in a fixed order, so the bytes Flower moves stay the same message to message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from seedfed.shared.protocol.errors import WireFormatError
from seedfed.shared.protocol.wire import LogEntryWire, RoundPlan, pack_binary, unpack_binary

#: Key of the ConfigRecord carrying seedfed's payload in every message and reply.
RECORD = "seedfed"
#: Key of the EVALUATE reply's MetricRecord.
METRICS = "metrics"
#: Key of the aggregation weight in both replies (Flower's own name for it).
NUM_EXAMPLES = "num-examples"
#: Keys of a personalized device's extra held-out accuracies in the EVALUATE reply's metrics.
PERSONAL_ACCURACY = "personal-accuracy"
LOCAL_ONLY_ACCURACY = "local-only-accuracy"
#: The `snapshot-format` an absent key means.
FP32 = "fp32"


def _get(record: ConfigRecord | MetricRecord, key: str, kind: type) -> Any:
    try:
        value = record[key]
    except KeyError as e:
        raise WireFormatError(f"record lacks {key!r}") from e
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireFormatError(f"record value {key!r} is {type(value).__name__}, not "
                              f"{kind.__name__}")
    return value


def _payload(content: RecordDict) -> ConfigRecord:
    record = content.config_records.get(RECORD)
    if record is None:
        raise WireFormatError(f"message holds no {RECORD!r} record")
    return record


@dataclass(frozen=True)
class CatchUp:
    """How a device reaches a version: nothing, the log entries it missed, or a snapshot."""

    entries: tuple[LogEntryWire, ...] = ()
    snapshot: bytes | None = None
    snapshot_version: int = 0
    snapshot_checksum: str = ""
    snapshot_format: str = FP32
    task: str | None = None  # TaskSpec JSON, for a device that is new or re-syncing

    def items(self) -> dict[str, Any]:
        if self.snapshot is None:
            return {"entries": json.dumps([e.model_dump_json() for e in self.entries])} \
                if self.entries else {}
        out: dict[str, Any] = {"snapshot": self.snapshot,
                               "snapshot-version": self.snapshot_version,
                               "snapshot-checksum": self.snapshot_checksum}
        if self.snapshot_format != FP32:  # absent means fp32 (messages as before formats)
            out["snapshot-format"] = self.snapshot_format
        if self.task is not None:
            out["task"] = self.task
        return out

    @classmethod
    def parse(cls, record: ConfigRecord) -> CatchUp:
        entries = tuple(LogEntryWire.model_validate_json(e)
                        for e in json.loads(_get(record, "entries", str))) \
            if "entries" in record else ()
        task = _get(record, "task", str) if "task" in record else None
        if "snapshot" not in record:
            return cls(entries=entries, task=task)
        return cls(entries=entries, snapshot=_get(record, "snapshot", bytes),
                   snapshot_version=_get(record, "snapshot-version", int),
                   snapshot_checksum=_get(record, "snapshot-checksum", str),
                   snapshot_format=_get(record, "snapshot-format", str)
                   if "snapshot-format" in record else FP32, task=task)


@dataclass(frozen=True)
class TrainIns:
    """TRAIN: run the round `plan` at its version, reached by `catch_up`."""

    task_id: str
    plan: RoundPlan
    catch_up: CatchUp = field(default_factory=CatchUp)

    def to_record(self) -> RecordDict:
        return RecordDict({RECORD: ConfigRecord({
            "task-id": self.task_id, "plan": self.plan.model_dump_json(),
            **self.catch_up.items()})})

    @classmethod
    def from_record(cls, content: RecordDict) -> TrainIns:
        record = _payload(content)
        return cls(_get(record, "task-id", str),
                   RoundPlan.model_validate_json(_get(record, "plan", str)),
                   CatchUp.parse(record))


@dataclass(frozen=True)
class SyncIns:
    """EVALUATE: reach `version` (of state checksum `checksum`) by `catch_up`, score it."""

    task_id: str
    version: int
    checksum: str
    catch_up: CatchUp = field(default_factory=CatchUp)

    def to_record(self) -> RecordDict:
        return RecordDict({RECORD: ConfigRecord({
            "task-id": self.task_id, "version": self.version, "checksum": self.checksum,
            **self.catch_up.items()})})

    @classmethod
    def from_record(cls, content: RecordDict) -> SyncIns:
        record = _payload(content)
        return cls(_get(record, "task-id", str), _get(record, "version", int),
                   _get(record, "checksum", str), CatchUp.parse(record))


@dataclass(frozen=True)
class TrainRes:
    """TRAIN reply: the scalar matrix (steps x P), the aggregation weight, the mean loss."""

    scalars: np.ndarray
    num_examples: int
    loss: float

    def to_record(self) -> RecordDict:
        return RecordDict({RECORD: ConfigRecord({
            "g": pack_binary(self.scalars), NUM_EXAMPLES: int(self.num_examples),
            "loss": float(self.loss)})})

    @classmethod
    def from_record(cls, content: RecordDict) -> TrainRes:
        record = _payload(content)
        return cls(unpack_binary(_get(record, "g", bytes)), _get(record, NUM_EXAMPLES, int),
                   _get(record, "loss", float))


@dataclass(frozen=True)
class SyncRes:
    """EVALUATE reply: where the device stands and how its local held-out set scores."""

    version: int
    checksum: str
    accuracy: float | None = None
    loss: float | None = None
    num_examples: int = 0
    personal_accuracy: float | None = None  # shared + the device's personal part
    local_only_accuracy: float | None = None  # a head trained on the device's data alone

    def to_record(self) -> RecordDict:
        content = RecordDict({RECORD: ConfigRecord({"version": self.version,
                                                    "checksum": self.checksum})})
        if self.accuracy is not None and self.loss is not None:
            metrics = MetricRecord({"accuracy": self.accuracy, "loss": self.loss,
                                    NUM_EXAMPLES: self.num_examples})
            for key, value in ((PERSONAL_ACCURACY, self.personal_accuracy),
                               (LOCAL_ONLY_ACCURACY, self.local_only_accuracy)):
                if value is not None:
                    metrics[key] = float(value)
            content[METRICS] = metrics
        return content

    @classmethod
    def from_record(cls, content: RecordDict) -> SyncRes:
        record = _payload(content)
        version, chk = _get(record, "version", int), _get(record, "checksum", str)
        metrics = content.metric_records.get(METRICS)
        if metrics is None:
            return cls(version, chk)
        extra = {name: _get(metrics, key, float) if key in metrics else None
                 for name, key in (("personal_accuracy", PERSONAL_ACCURACY),
                                   ("local_only_accuracy", LOCAL_ONLY_ACCURACY))}
        return cls(version, chk, _get(metrics, "accuracy", float), _get(metrics, "loss", float),
                   _get(metrics, NUM_EXAMPLES, int), **extra)
