"""Every number an upload carries has a range, checked by the wire schema."""

import json
import struct

import numpy as np
import pytest
from pydantic import ValidationError
from seedfed.shared.protocol.errors import WireFormatError
from seedfed.shared.protocol.wire import (
    MAX_ABS_LOSS,
    MAX_DIM,
    MAX_NUM_EXAMPLES,
    DeviceMetrics,
    RoundPlan,
    Upload,
    encode_scalars,
    pack_binary,
    unpack_binary,
)

PLAN = RoundPlan(task_id="t", round=2, version=5, seeds=[[1, 2]], lr=1e-3, eps=1e-3,
                 batch_size=8)


def body(**update: object) -> str:
    d = json.loads(Upload.build(PLAN, np.ones((1, 2)), 10, 0.5).model_dump_json())
    d.update(update)
    return json.dumps(d)


@pytest.mark.parametrize("update", [
    {"loss": 1e308}, {"loss": -1e308}, {"loss": MAX_ABS_LOSS * 1.5},
    {"num_examples": MAX_NUM_EXAMPLES + 1}, {"num_examples": 0}, {"num_examples": 2**63},
    {"num_examples": "10"}, {"num_examples": 10.0}, {"loss": "0.5"},
    {"round": 2**31}, {"version": 2**63}, {"round": "2"},
    {"shape": [MAX_DIM + 1, 2]}, {"shape": [0, 2]}, {"shape": ["1", 2]},
], ids=str)
def test_out_of_range_or_non_strict_numbers_are_refused(update: dict[str, object]):
    with pytest.raises(ValidationError):
        Upload.model_validate_json(body(**update))


def test_in_range_extremes_are_accepted():
    up = Upload.model_validate_json(body(loss=-MAX_ABS_LOSS, num_examples=MAX_NUM_EXAMPLES))

    assert up.loss == -MAX_ABS_LOSS and up.num_examples == MAX_NUM_EXAMPLES


def test_scalars_above_the_wire_bound_are_refused_in_both_forms():
    big = np.array([[1.0, 2e6]], dtype=np.float32)
    up = Upload.model_validate_json(body(scalars=encode_scalars(big)))

    with pytest.raises(WireFormatError, match="wire bound"):
        up.matrix()
    with pytest.raises(WireFormatError, match="wire bound"):
        unpack_binary(pack_binary(big))


def test_binary_header_reserved_word_must_be_zero():
    data = bytearray(pack_binary(np.ones((1, 2))))
    struct.pack_into("<I", data, 12, 7)

    with pytest.raises(WireFormatError, match="reserved"):
        unpack_binary(bytes(data))


def test_binary_header_dimensions_are_bounded():
    data = struct.pack("<4sIII", b"SFS1", 0, 5, 0)

    with pytest.raises(WireFormatError, match="1..65536"):
        unpack_binary(data)


# -- device metrics: a device's held-out accuracies, numbers only ---------------------------
def metrics_body(**update: object) -> str:
    d: dict[str, object] = {"version": 3, "num_examples": 48, "shared_accuracy": 0.5,
                            "personal_accuracy": 0.75, "local_accuracy": 0.625}
    d.update(update)
    return json.dumps(d)


@pytest.mark.parametrize("update", [
    {"shared_accuracy": 1.0000001}, {"shared_accuracy": -0.1}, {"personal_accuracy": 2},
    {"local_accuracy": -1e-9}, {"shared_accuracy": "0.5"}, {"shared_accuracy": True},
    {"shared_accuracy": None}, {"num_examples": 0}, {"num_examples": MAX_NUM_EXAMPLES + 1},
    {"num_examples": 4.0}, {"version": -1}, {"version": 2**31}, {"version": "3"},
    {"examples": ["a sentence"]}, {"schema_version": 2},
], ids=str)
def test_device_metrics_out_of_range_non_strict_or_extra_are_refused(update: dict[str, object]):
    with pytest.raises(ValidationError):
        DeviceMetrics.model_validate_json(metrics_body(**update))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_device_metrics_refuse_non_finite_accuracies(value: float):
    with pytest.raises(ValidationError):
        DeviceMetrics(version=0, num_examples=1, shared_accuracy=value)


def test_device_metrics_accept_the_bounds_and_leave_the_personal_scores_optional():
    edge = DeviceMetrics.model_validate_json(metrics_body(shared_accuracy=0, personal_accuracy=1,
                                                          num_examples=MAX_NUM_EXAMPLES))
    plain = DeviceMetrics.model_validate_json(json.dumps(
        {"version": 0, "num_examples": 1, "shared_accuracy": 0.25}))

    assert (edge.shared_accuracy, edge.personal_accuracy) == (0.0, 1.0)
    assert (plain.personal_accuracy, plain.local_accuracy) == (None, None)
