"""Property tests of the wire decoders: whatever bytes or JSON arrive, a decoder returns a
well-formed value or raises one of its typed errors (never IndexError, OverflowError, a numpy
error or anything else a caller would see as a crash)."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from seedfed.shared.protocol.errors import NonFiniteScalarError, SeedfedError, WireFormatError
from seedfed.shared.protocol.wire import (
    MAGIC,
    LogEntryWire,
    RoundPlan,
    Upload,
    decode_scalars,
    encode_scalars,
    pack_binary,
    unpack_binary,
)

from tests.strategies import json_values, mutate_fields

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
DECODE_ERRORS = (WireFormatError, NonFiniteScalarError)

# Headers that are mostly valid, so the body checks behind the header checks are reached too.
header = st.builds(lambda rows, cols, reserved: struct.pack("<4sIII", MAGIC, rows, cols,
                                                           reserved),
                   st.integers(0, 6) | st.integers(0, 2**32 - 1), st.integers(0, 6),
                   st.just(0) | st.integers(0, 2**32 - 1))
binary = st.binary(max_size=64) | st.builds(lambda h, b: h + b, header, st.binary(max_size=200))
shapes = st.tuples(st.integers(-3, 6) | st.integers(-2**70, 2**70),
                   st.integers(-3, 6) | st.integers(-2**70, 2**70))
base64ish = st.text(alphabet="ABCDEFGHabcdefgh0123456789+/=\n -_\u00e9\ud800", max_size=64) | \
    st.binary(max_size=48).map(lambda b: base64.b64encode(b).decode())


@FUZZ
@given(binary)
@example(struct.pack("<4sIII", MAGIC, 2**32 - 1, 2**32 - 1, 0))  # 4 * rows * cols is huge
@example(pack_binary(np.array([[np.nan]])))
def test_unpack_binary_returns_a_finite_matrix_or_a_typed_error(data: bytes) -> None:
    try:
        m = unpack_binary(data)
    except DECODE_ERRORS:
        return

    assert m.dtype == np.float32 and m.ndim == 2 and np.isfinite(m).all()
    assert len(data) == 16 + 4 * m.size


@FUZZ
@given(base64ish, shapes)
@example("AAAAAAAAAAA=", (-1, -2))  # 8 bytes, a product of 2 with negative sides
@example("", (2**64, 0))
@example("AAAA", (2**40, 2**40))  # the element count overflows int64
def test_decode_scalars_returns_the_shape_or_a_typed_error(text: str,
                                                          shape: tuple[int, int]) -> None:
    try:
        m = decode_scalars(text, shape)
    except DECODE_ERRORS:
        return

    assert m.shape == shape and m.dtype == np.float32 and np.isfinite(m).all()


def upload_like(draw: st.DrawFn) -> bytes:
    """A JSON document near a valid Upload: each field kept, dropped or replaced."""
    fields: dict[str, object] = {"task_id": "t", "round": 1, "version": 0, "shape": [1, 2],
                                 "scalars": encode_scalars(np.zeros((1, 2))),
                                 "num_examples": 3, "loss": 0.5}
    mutate_fields(draw, fields, one_in=4)
    if draw(st.booleans()):
        fields[draw(st.text(max_size=6))] = draw(json_values)
    text = json.dumps(fields)
    cut = draw(st.integers(0, len(text)))
    return (text if draw(st.integers(0, 4)) else text[:cut]).encode("utf-8", "surrogatepass")


@FUZZ
@given(st.composite(upload_like)() | st.binary(max_size=80))
@example(b'{"task_id": "\\ud800"}')
@example(b'{"task_id":"t","round":1,"version":0,"shape":[1,2],"scalars":"AAAAAAAAAAA=",'
         b'"num_examples":1e400,"loss":0.5}')
def test_upload_json_validates_or_raises_validation_error(body: bytes) -> None:
    try:
        up = Upload.model_validate_json(body)
    except ValidationError:
        return
    try:
        m = up.matrix()
    except SeedfedError:
        return

    assert m.shape == tuple(up.shape) and np.isfinite(m).all()


@FUZZ
@given(st.lists(st.integers(-2, 2**64), max_size=4), base64ish)
def test_log_entry_decodes_or_raises_a_typed_error(seeds: list[int], coefs: str) -> None:
    try:
        wire = LogEntryWire(task_id="t", base_version=0, seeds=seeds, coefs=coefs,
                            checksum="c")
    except ValidationError:
        return
    try:
        entry = wire.to_entry()
    except DECODE_ERRORS:
        return

    assert len(entry.coefs) == len(seeds)


@FUZZ
@given(st.integers(1, 4), st.integers(1, 5), st.data())
def test_finite_matrices_round_trip_through_both_forms(rows: int, cols: int,
                                                       data: st.DataObject) -> None:
    g = np.array(data.draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=rows * cols,
                                    max_size=rows * cols)), dtype=np.float32)
    g = g.reshape(rows, cols)
    plan = RoundPlan(task_id="t", round=1, version=0, seeds=[[1] * cols] * rows, lr=0.1,
                     eps=0.1, batch_size=1)

    from_json = Upload.model_validate_json(Upload.build(plan, g, 3, 0.5).model_dump_json())
    from_binary = unpack_binary(pack_binary(g))

    assert np.array_equal(from_json.matrix(), g) and np.array_equal(from_binary, g)
