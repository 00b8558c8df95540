"""The ranges of a task definition's numbers, checked when a task is defined.

Every number an operator sets in a task (`TaskSpec` and the option classes in it) has a range,
declared once beside its field (`bounded(...)` in the field's metadata) and checked in the
class's `__post_init__` (`check_fields`), so a bad value fails at task creation with one line
naming the field and its range (the API answers 422). The ranges are sized so that no accepted
task can overflow float32 in a round's coefficient (`shared.npzo.update_coefficients`), nor ask
a device or the coordinator for more memory than the budgets below, while staying far outside
what real tasks use (the recipes in `shared/protocol/recipes.py` sit well inside every one).

Why the coefficients stay finite: a coefficient is -(lr / P) * AGG, rounded to float32 once,
then multiplied by a step scale c_t. AGG is a combination of uploaded scalars, each within the
wire bound 1e6 (`wire.MAX_ABS_SCALAR`), plus, with client-level DP, Gaussian noise of standard
deviation at most dp_noise_multiplier * dp_clip = 1e3 * 1e6 (a draw beyond 40 standard
deviations has probability below 1e-300). So |coefficient * c_t| <= MAX_LR * (1e6 + 4e10) *
MAX_STEP_SCALE = 4e17, twenty orders of magnitude below float32's 3.4e38; a probe's step
eps * c_t is at least 1e-14, a normal float32.

Memory budgets: a device's step reads batch_size x max_seq_len <= MAX_BATCH_TOKENS tokens; a
round plans steps x perturbations <= MAX_SEEDS_PER_ROUND seeds (the log entry, the upload and
the replay are proportional to it); LoRA adds r x (d_in + d_out) values per targeted matrix, so
MAX_LORA_RANK keeps the adapters of a matrix with d_in, d_out >= 512 no larger than the
matrix itself; a classification head holds num_labels x hidden values.

Specs a coordinator stored before a range existed are read back without these checks
(`TaskSpec.from_dict(..., stored=True)` runs inside `unchecked()`): a task that was accepted
stays loadable, listable and abandonable.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any

MAX_LR = 1e4
MIN_LR = 1e-12
MIN_EPS, MAX_EPS = 1e-8, 100.0
MIN_STEP_SCALE, MAX_STEP_SCALE = 1e-6, 1e3
MAX_STEPS = 1024
MAX_PERTURBATIONS = 1 << 16
MAX_SEEDS_PER_ROUND = 1 << 16
MAX_BATCH_SIZE = 4096
MAX_SEQ_LEN = 32768
MAX_BATCH_TOKENS = 1 << 18
MAX_LORA_RANK = 256
MAX_LORA_ALPHA = 4096
MAX_NUM_LABELS = 4096
MAX_ABS_SCALAR = 1e6  # = wire.MAX_ABS_SCALAR (tests keep them equal)
MAX_DP_NOISE_MULTIPLIER = 1e3
MAX_PROBE_MEMORY_MB = 65536.0
MAX_INT32 = (1 << 31) - 1
MAX_NAMES = 256  # patterns, target modules, step scales, label texts
MAX_NAME_LEN = 1024
MAX_PATH_LEN = 4096

_CHECKING: ContextVar[bool] = ContextVar("seedfed_check_ranges", default=True)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Build task definitions without their range checks (specs read back from storage)."""
    token = _CHECKING.set(False)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def checking() -> bool:
    return _CHECKING.get()


@dataclass(frozen=True)
class Range:
    """A range from `lo` to `hi` (either None: unbounded; `lo_open`/`hi_open`: that end
    excluded), of integers when `integer`."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def __str__(self) -> str:
        def num(v: float | None) -> str:
            if v is None:
                return ""
            return str(int(v)) if self.integer else f"{v:g}"
        if self.integer:
            return f"an integer in {num(self.lo)}..{num(self.hi)}"
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        return f"{'<' if self.hi_open else '<='} {num(self.hi)}"

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)


def bounded(rng: Range, help_text: str = "", **more: Any) -> dict[str, Any]:
    """Field metadata: its range and help text (`field(default=..., metadata=bounded(...))`)."""
    return {"range": rng, "help": help_text, **more}


def out_of_range(path: str, rng: Range, value: Any) -> ValueError:
    return ValueError(f"{path} must be {rng}, got {value!r}")


def check_value(path: str, rng: Range, value: Any) -> None:
    """Raise `out_of_range` unless `value` is in `rng` (nothing while `unchecked`)."""
    if checking() and not rng.holds(value):
        raise out_of_range(path, rng, value)


def check_fields(obj: Any, prefix: str) -> None:
    """Check every field of dataclass `obj` that declares a range (None values are "unset"
    and pass): the error names `prefix.field` and the range."""
    if not checking():
        return
    for f in fields(obj):
        rng = f.metadata.get("range")
        value = getattr(obj, f.name)
        if rng is not None and value is not None and not rng.holds(value):
            raise out_of_range(f"{prefix}{f.name}", rng, value)


def check_names(path: str, names: Any, *, at_least: int = 0) -> None:
    """A list of names (patterns, modules, texts): how many, and how long each."""
    if not checking():
        return
    if not at_least <= len(names) <= MAX_NAMES:
        raise ValueError(f"{path} must hold {at_least}..{MAX_NAMES} entries, got {len(names)}")
    for name in names:
        if isinstance(name, str) and len(name) > MAX_NAME_LEN:
            raise ValueError(f"{path} entries must be at most {MAX_NAME_LEN} characters, got "
                             f"one of {len(name)}")


def ranges_of(cls: type, prefix: str) -> Mapping[str, tuple[Range, str]]:
    """`prefix.field` -> (range, help) of every bounded field of dataclass `cls` (the table
    server/README.md documents)."""
    return {f"{prefix}{f.name}": (f.metadata["range"], f.metadata.get("help", ""))
            for f in fields(cls) if "range" in f.metadata}


def help_of(cls: type) -> dict[str, str]:
    """Field name -> its help text, with its range where it has one (the `help()` of every
    class of a task definition)."""
    out = {}
    for f in fields(cls):
        text = f.metadata.get("help", "")
        rng = f.metadata.get("range")
        out[f.name] = f"{text} ({rng})" if rng is not None else text
    return out
