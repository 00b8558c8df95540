"""Wire schemas (versioned pydantic models) and the compact binary form of scalar matrices.

JSON carries scalar matrices as base64 of float32 little-endian, row-major (steps x P), which
is exactly 4 bytes per scalar before base64. The raw binary form, for `application/octet-stream`
uploads, is a 16-byte header (magic b"SFS1", uint32 rows, uint32 cols, uint32 reserved = 0)
followed by the float32 LE values. Seeds are JSON integers below 2**53 so that clients in any
language (JavaScript included) read them exactly; the stream itself accepts any uint64.

Every number a device sends has a documented range (docs/protocol.md section 4), checked here,
before any arithmetic or storage: bounded inputs are what make aggregation unable to overflow
(|scalar| * weight * devices stays far inside float64, and every count fits a 32-bit column).
Integers are strict: the JSON string "10" is not the number 10.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from datetime import datetime
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from seedfed.shared.protocol.errors import NonFiniteScalarError, WireFormatError
from seedfed.shared.protocol.npzo import LogEntry

SCHEMA_VERSION = 1
MAX_SEED = (1 << 53) - 1
MAGIC = b"SFS1"
_HEADER = struct.Struct("<4sIII")

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]

#: Bounds of the numbers on the wire (docs/protocol.md section 4). Rounds, versions and counts
#: are stored in 32-bit integer columns; a loss or scalar beyond 1e6 is a broken or hostile
#: device, and the bound keeps every weighted sum of a round exactly representable.
MAX_INT32 = (1 << 31) - 1
MAX_ROUND = MAX_INT32
MAX_VERSION = MAX_INT32
MAX_NUM_EXAMPLES = MAX_INT32
MAX_ABS_LOSS = 1e6
MAX_ABS_SCALAR = 1e6
#: Most steps (rows) or perturbations (columns) of a scalar matrix.
MAX_DIM = 1 << 16
RoundNumber = Annotated[int, Field(strict=True, ge=0, le=MAX_ROUND)]
VersionNumber = Annotated[int, Field(strict=True, ge=0, le=MAX_VERSION)]
Dim = Annotated[int, Field(strict=True, ge=1, le=MAX_DIM)]
#: A share of a device's held-out examples (what it reports as accuracy): a finite number in
#: [0, 1]. Strict, so `true` or `"0.5"` is not a number; an integer 0 or 1 is.
Accuracy = Annotated[float, Field(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)]
#: The mask epoch of a ternary task (None for scopes without epochs). Left out of the JSON when
#: None, so messages of other tasks stay byte-identical to what readers without it expect.
MaskEpoch = Annotated[int | None, Field(default=None, ge=0, exclude_if=lambda v: v is None)]


def encode_scalars(m: np.ndarray) -> str:
    """float32 LE row-major bytes of a matrix or vector, base64 encoded."""
    return base64.b64encode(np.ascontiguousarray(m, dtype="<f4").tobytes()).decode("ascii")


def decode_scalars(text: str, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of `encode_scalars`; refuses wrong lengths and non-finite values."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as e:
        raise WireFormatError(f"scalars are not valid base64: {e}") from e
    if any(not isinstance(d, int) or not 0 <= d <= MAX_INT32 for d in shape):
        raise WireFormatError(f"scalar shape {list(shape)} must be integers in 0..{MAX_INT32}")
    n = math.prod(shape)  # exact: numpy's product of large sides overflows int64
    if len(raw) != 4 * n:
        raise WireFormatError(f"scalars hold {len(raw)} bytes, shape {list(shape)} needs {4 * n}")
    out = np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
    if not np.isfinite(out).all():
        raise NonFiniteScalarError("scalars contain NaN or infinity")
    return out


def bounded_scalars(out: np.ndarray) -> np.ndarray:
    """`out` if every uploaded scalar is within the wire bound MAX_ABS_SCALAR (log entries'
    coefficients are the coordinator's own and are not held to it)."""
    if out.size and float(np.abs(out).max()) > MAX_ABS_SCALAR:
        raise WireFormatError(f"a scalar is above the wire bound |g| <= {MAX_ABS_SCALAR:g}")
    return out


def pack_binary(m: np.ndarray) -> bytes:
    m = np.atleast_2d(np.asarray(m, dtype="<f4"))
    if m.ndim != 2:
        raise WireFormatError(f"binary scalars must be a matrix, got {m.ndim} dimensions")
    return _HEADER.pack(MAGIC, m.shape[0], m.shape[1], 0) + m.tobytes()


def unpack_binary(data: bytes) -> np.ndarray:
    if len(data) < _HEADER.size:
        raise WireFormatError(
            f"binary scalars need a {_HEADER.size}-byte header, got {len(data)} bytes")
    magic, rows, cols, reserved = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireFormatError(f"binary scalars start with {magic!r}, expected {MAGIC!r}")
    if reserved != 0:
        # Reserved for a later header version: a reader that ignored it would misread one.
        raise WireFormatError(f"binary scalars' reserved header word is {reserved}, must be 0")
    if not (1 <= rows <= MAX_DIM and 1 <= cols <= MAX_DIM):
        raise WireFormatError(f"binary scalars are {rows}x{cols}; each side must be in "
                              f"1..{MAX_DIM}")
    body = data[_HEADER.size:]
    if len(body) != 4 * rows * cols:
        raise WireFormatError(
            f"{rows}x{cols} scalars need {4 * rows * cols} bytes, got {len(body)}")
    out = np.frombuffer(body, dtype="<f4").reshape(rows, cols).astype(np.float32)
    if not np.isfinite(out).all():
        raise NonFiniteScalarError("scalars contain NaN or infinity")
    return bounded_scalars(out)


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {v} is not supported (this side speaks {SCHEMA_VERSION})")
        return v


class RoundPlan(_Schema):
    """What a device needs to run its local steps of a round."""

    task_id: str
    round: int = Field(ge=0)
    version: int = Field(ge=0)
    seeds: list[list[Seed]]  # steps x perturbations, plan order
    lr: float = Field(gt=0)
    eps: float = Field(gt=0)
    batch_size: int = Field(gt=0)
    clip: float | None = Field(default=None, gt=0)
    one_sided: bool = False
    scope: str = "lora"
    deadline: datetime | None = None
    quorum: int = Field(default=1, ge=1)
    #: The mask epoch the device must hold to train this round (a ternary task): a device in
    #: another epoch loads the snapshot of `version` first.
    mask_epoch: MaskEpoch = None

    @field_validator("seeds")
    @classmethod
    def _rectangular(cls, v: list[list[int]]) -> list[list[int]]:
        if not v or len({len(r) for r in v}) != 1 or not v[0]:
            raise ValueError("seeds must be a non-empty steps x perturbations matrix")
        return v

    @property
    def steps(self) -> int:
        return len(self.seeds)

    @property
    def perturbations(self) -> int:
        return len(self.seeds[0])

    @property
    def flat_seeds(self) -> list[int]:
        return [s for row in self.seeds for s in row]


class Upload(_Schema):
    """A device's whole contribution to a round: scalars, example count, mean loss."""

    task_id: str
    round: RoundNumber
    version: VersionNumber
    shape: tuple[Dim, Dim]
    scalars: str  # base64 float32 LE, see encode_scalars; each |g| <= MAX_ABS_SCALAR
    #: The size of the device's local training set (FedAvg's n_k), a claim: the coordinator
    #: turns it into a weight by `shared.aggregate.round_weights` (capped for the mean, ignored
    #: by the robust rules).
    num_examples: int = Field(strict=True, ge=1, le=MAX_NUM_EXAMPLES)
    loss: float = Field(strict=True, ge=-MAX_ABS_LOSS, le=MAX_ABS_LOSS)

    @field_validator("loss", mode="before")
    @classmethod
    def _finite_loss(cls, v: object) -> object:
        # Before the range check, so that NaN is named as such, not as out of range.
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            raise ValueError("loss must be finite")
        return v

    def matrix(self) -> np.ndarray:
        return bounded_scalars(decode_scalars(self.scalars, self.shape))

    @classmethod
    def build(cls, plan: RoundPlan, g: np.ndarray, num_examples: int, loss: float) -> Upload:
        g = np.asarray(g, dtype=np.float32).reshape(plan.steps, plan.perturbations)
        return cls(task_id=plan.task_id, round=plan.round, version=plan.version,
                   shape=(plan.steps, plan.perturbations), scalars=encode_scalars(g),
                   num_examples=int(num_examples), loss=float(loss))


class DeviceMetrics(_Schema):
    """A device's held-out scores after its part in a round (`POST .../rounds/{n}/metrics`,
    or a Flower sync reply's metrics): numbers only, never an example.

    The scores are of the device's own held-out examples, with the shared model of `version`
    alone, with shared + its personal part, and with a head trained on its data alone (the
    last two None for a device without a personal part, or before a local-only head exists).
    """

    version: VersionNumber  # the shared version the device scored
    num_examples: int = Field(strict=True, ge=1, le=MAX_NUM_EXAMPLES)  # held-out examples
    shared_accuracy: Accuracy
    personal_accuracy: Accuracy | None = None
    local_accuracy: Accuracy | None = None


class LogEntryWire(_Schema):
    """A log entry on the wire: the update from `base_version` to `base_version + 1`."""

    task_id: str
    base_version: int = Field(ge=0)
    seeds: list[int]
    coefs: str  # base64 float32 LE
    checksum: str
    #: The mask epoch of version base_version + 1 (a ternary task). An entry whose epoch
    #: differs from its base version's started a new epoch: replay cannot cross it.
    mask_epoch: MaskEpoch = None

    def to_entry(self) -> LogEntry:
        coefs = decode_scalars(self.coefs, (len(self.seeds),))
        return LogEntry(self.task_id, self.base_version, tuple(self.seeds),
                        tuple(float(c) for c in coefs), self.checksum, self.mask_epoch)

    @classmethod
    def from_entry(cls, e: LogEntry, mask_epoch: int | None = None) -> LogEntryWire:
        """The wire form of `e`; `mask_epoch` defaults to `e.mask_epoch`."""
        if e.checksum is None:
            raise WireFormatError(f"entry v{e.version} has no checksum to publish")
        if mask_epoch is None:
            mask_epoch = e.mask_epoch
        return cls(task_id=e.task_id, base_version=e.base_version, seeds=list(e.seeds),
                   coefs=encode_scalars(np.asarray(e.coefs, dtype=np.float32)),
                   checksum=e.checksum, mask_epoch=mask_epoch)


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
