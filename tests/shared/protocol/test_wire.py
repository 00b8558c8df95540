import numpy as np
import pytest
from pydantic import ValidationError
from seedfed.shared.protocol.errors import NonFiniteScalarError, WireFormatError
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.wire import (
    LogEntryWire,
    RoundPlan,
    Upload,
    decode_scalars,
    encode_scalars,
    pack_binary,
    unpack_binary,
)

PLAN = RoundPlan(task_id="t", round=2, version=5, seeds=[[1, 2], [3, 4], [5, 6]], lr=1e-3,
                 eps=1e-3, batch_size=8)


def test_upload_round_trip_and_size_is_four_bytes_per_scalar_plus_small_header():
    g = np.arange(6, dtype=np.float32).reshape(3, 2)
    up = Upload.build(PLAN, g, num_examples=24, loss=0.7)
    again = Upload.model_validate_json(up.model_dump_json())
    assert np.array_equal(again.matrix(), g)
    assert len(pack_binary(g)) == 16 + 4 * g.size
    assert len(up.model_dump_json()) <= 4 * g.size * 4 / 3 + 256


def test_binary_round_trip_and_refusals():
    g = np.array([[1.5, -2.0]], dtype=np.float32)
    assert np.array_equal(unpack_binary(pack_binary(g)), g)
    with pytest.raises(WireFormatError, match="header"):
        unpack_binary(b"SF")
    with pytest.raises(WireFormatError, match="expected"):
        unpack_binary(b"XXXX" + pack_binary(g)[4:])
    with pytest.raises(WireFormatError, match="need 8 bytes"):
        unpack_binary(pack_binary(g)[:-1])
    with pytest.raises(NonFiniteScalarError):
        unpack_binary(pack_binary(np.array([[np.nan]])))


def test_decode_refuses_bad_base64_wrong_length_and_nan():
    with pytest.raises(WireFormatError, match="base64"):
        decode_scalars("***", (1,))
    with pytest.raises(WireFormatError, match="needs 8"):
        decode_scalars(encode_scalars(np.zeros(3)), (2,))
    with pytest.raises(NonFiniteScalarError):
        decode_scalars(encode_scalars(np.array([np.inf])), (1,))


def test_plan_validation():
    assert PLAN.steps == 3 and PLAN.perturbations == 2 and PLAN.flat_seeds == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValidationError, match="rectangular|steps x perturbations"):
        RoundPlan(task_id="t", round=0, version=0, seeds=[[1], [2, 3]], lr=1, eps=1, batch_size=1)
    with pytest.raises(ValidationError):
        RoundPlan(task_id="t", round=0, version=0, seeds=[[2**60]], lr=1, eps=1, batch_size=1)
    with pytest.raises(ValidationError, match="schema_version"):
        RoundPlan(schema_version=9, task_id="t", round=0, version=0, seeds=[[1]], lr=1, eps=1,
                  batch_size=1)


def test_upload_refuses_extra_fields_and_nan_loss():
    with pytest.raises(ValidationError):
        Upload(task_id="t", round=0, version=0, shape=(1, 1), scalars="AAAAAA==", num_examples=1,
               loss=float("nan"))
    with pytest.raises(ValidationError):
        Upload.model_validate({"task_id": "t", "round": 0, "version": 0, "shape": [1, 1],
                               "scalars": "AAAAAA==", "num_examples": 1, "loss": 0.1, "x": 1})


def test_log_entry_wire_round_trip_keeps_float32_coefficients():
    e = LogEntry("t", 3, (1, 2), (float(np.float32(0.1)), float(np.float32(-2e-7))), "ab" * 32)
    assert LogEntryWire.from_entry(e).to_entry() == e


def test_mask_epoch_is_optional_and_absent_from_the_json_when_unset():
    # Arrange / Act
    plain = PLAN.model_dump_json()
    ternary = PLAN.model_copy(update={"mask_epoch": 3})
    e = LogEntry("t", 3, (1,), (0.5,), "ab" * 32)
    wire = LogEntryWire.from_entry(e, mask_epoch=2)
    # Assert: messages of tasks without epochs are unchanged; with one, it round-trips
    assert "mask_epoch" not in plain and "mask_epoch" not in LogEntryWire.from_entry(
        e).model_dump_json()
    assert RoundPlan.model_validate_json(ternary.model_dump_json()).mask_epoch == 3
    again = LogEntryWire.model_validate_json(wire.model_dump_json())
    assert again.mask_epoch == 2 and again.to_entry().mask_epoch == 2
    assert LogEntryWire.from_entry(again.to_entry()).mask_epoch == 2
    with pytest.raises(ValidationError):
        RoundPlan.model_validate({**PLAN.model_dump(), "mask_epoch": -1})
