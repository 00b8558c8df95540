"""The Flower record layouts both sides import: what `to_record` writes `from_record` reads."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict
from seedfed.shared.protocol.errors import WireFormatError
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.records import (
    METRICS,
    NUM_EXAMPLES,
    RECORD,
    CatchUp,
    SyncIns,
    SyncRes,
    TrainIns,
    TrainRes,
)
from seedfed.shared.protocol.wire import LogEntryWire, RoundPlan

PLAN = RoundPlan(task_id="t", round=3, version=2, seeds=[[1, 2], [3, 4]], lr=1e-3, eps=1e-2,
                 batch_size=8)
ENTRY = LogEntryWire.from_entry(LogEntry("t", 1, (5, 6), (0.5, -0.25), "c" * 64))


@pytest.mark.parametrize("catch_up", [
    CatchUp(),
    CatchUp(entries=(ENTRY,)),
    CatchUp(snapshot=b"\x01\x02", snapshot_version=2, snapshot_checksum="a" * 64, task="{}"),
    CatchUp(snapshot=b"\x03", snapshot_version=2, snapshot_checksum="b" * 64,
            snapshot_format="ternary", task="{}"),
], ids=["none", "entries", "fp32", "ternary"])
def test_instructions_round_trip(catch_up: CatchUp) -> None:
    train = TrainIns("t", PLAN, catch_up)
    sync = SyncIns("t", 2, "d" * 64, catch_up)

    assert TrainIns.from_record(train.to_record()) == train
    assert SyncIns.from_record(sync.to_record()) == sync


def test_an_fp32_snapshot_leaves_the_format_key_out_and_keys_keep_their_order() -> None:
    ins = TrainIns("t", PLAN, CatchUp(snapshot=b"x", snapshot_version=2,
                                      snapshot_checksum="a" * 64, task="{}"))

    keys = list(ins.to_record().config_records[RECORD].keys())

    assert keys == ["task-id", "plan", "snapshot", "snapshot-version", "snapshot-checksum",
                    "task"]


def test_replies_round_trip() -> None:
    g = np.arange(6, dtype=np.float32).reshape(2, 3)
    train = TrainRes.from_record(TrainRes(g, 40, 0.5).to_record())
    sync = SyncRes(2, "e" * 64, 0.75, 0.3, 12)

    assert np.array_equal(train.scalars, g) and (train.num_examples, train.loss) == (40, 0.5)
    assert SyncRes.from_record(sync.to_record()) == sync
    assert NUM_EXAMPLES in sync.to_record().metric_records[METRICS]  # one weight key, both replies


def test_a_missing_or_mistyped_value_is_a_wire_format_error() -> None:
    g = TrainRes(np.zeros((1, 1), np.float32), 1, 0.0).to_record().config_records[RECORD]["g"]
    missing = RecordDict({RECORD: ConfigRecord({"g": g, "loss": 0.1})})
    mistyped = RecordDict({RECORD: ConfigRecord({"version": "2", "checksum": "x"})})

    with pytest.raises(WireFormatError, match=NUM_EXAMPLES):
        TrainRes.from_record(missing)
    with pytest.raises(WireFormatError, match="version"):
        SyncRes.from_record(mistyped)
    with pytest.raises(WireFormatError, match="no 'seedfed' record"):
        SyncRes.from_record(RecordDict())
