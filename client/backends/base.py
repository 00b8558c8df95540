"""What a device backend does, and the types every backend and adapter share. numpy only.

A backend runs one task's model on one engine: it holds the trainable state of the version it
stands at, and it can

- load a snapshot of a version (verified against the coordinator's checksum),
- replay log entries from where it stands (each entry's checksum verified),
- restore / store what a restart needs (`StoredState`),
- run a round plan's probes and return the scalars, ending at the plan's version exactly,
- score labelled examples.

`client.device.Device` holds everything above that (the store, catch-up choice, the personal
part, the round's result) once, for every backend: PyTorch (`client.backends.torch`, every
scope, a ternary task's packed model as one of its model kinds) and ONNX Runtime
(`client.backends.ort`, numpy, no torch). A new engine is one more class with this interface.

This module, the core and the adapters import no torch: the ONNX Runtime device runs them
(tests/client/backends/ort/test_no_torch.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol

import numpy as np
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

if TYPE_CHECKING:  # torch-side types, named only in signatures
    from seedfed.client.data import Examples
    from seedfed.client.device_data import DeviceData
    from seedfed.client.personal import PersonalConfig, PersonalScores

#: A snapshot download: () -> (file bytes, the state checksum the coordinator published).
Fetch = Callable[[], tuple[bytes, str]]
#: The `snapshot-format` / `?format=` of an fp32 trainable-state snapshot.
FP32 = "fp32"
#: The backends a device can run (`BackendConfig.kind`).
KINDS: tuple[str, ...] = ("torch", "ort")


class DeviceStateError(SeedfedError, RuntimeError):
    """The device cannot reach the requested version with what it holds and was sent."""


@dataclass(frozen=True)
class SyncResult:
    """Where a catch-up left the device: its version, checksum and how it got there."""

    version: int
    checksum: str
    method: str  # "none" | "replay" | "snapshot"
    entries_applied: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("none", "replay", "snapshot"):
            raise ValueError(f"sync method must be none, replay or snapshot, got {self.method!r}")
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")


@dataclass(frozen=True)
class StoredState:
    """What a device keeps to survive a restart: the version it stands at and its trainable
    state, plus (a ternary task) the published snapshot its packed model came from, which the
    masked latents in `state` cannot rebuild the model without."""

    task_id: str
    version: int
    checksum: str
    state: bytes | None
    snapshot: bytes | None = None
    snapshot_version: int | None = None
    snapshot_checksum: str = ""
    #: The device's personal part (client.personal safetensors): kept on the device only.
    personal: bytes | None = None


@dataclass(frozen=True)
class Trained:
    """A round's upload: the scalar matrix (steps x P), the aggregation weight, the loss, and
    the model runs it took (forwards, or ORT top-graph runs: probes stacked per run)."""

    scalars: np.ndarray
    num_examples: int
    loss: float
    runs: int = 0


@dataclass(frozen=True)
class BackendConfig:
    """Which backend runs a device's model and where. Device-side settings, never part of the
    task."""

    kind: str = field(default="torch", metadata={
        "help": "torch (PyTorch eager, every scope) or ort (ONNX Runtime + numpy, no torch: "
                "the exported bundle of an fp32 task: a classifier's head, or a causal LM's LoRA)"})
    model: str | None = field(default=None, metadata={
        "help": "torch: this device's copy of the base model (None: the task's model_path); "
                "ort: the task's bundle directory (`seedfed ort-export`), required"})
    torch_device: str = field(default="cpu", metadata={
        "help": "torch: auto (cuda when torch sees one, else cpu), cpu, cuda or cuda:N"})
    threads: int | None = field(default=None, metadata={
        "help": "ort: ONNX Runtime intra-op threads (None: its own choice)"})

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"backend must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "ort" and not self.model:
            raise ValueError("the ort backend needs model= the task's ORT bundle directory "
                             "(`seedfed ort-export`)")
        name = self.torch_device
        if name not in ("auto", "cpu") and not (name == "cuda" or (
                name.startswith("cuda:") and name[5:].isdigit())):
            raise ValueError(f"torch_device must be auto, cpu, cuda or cuda:N, got {name!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each field's help text."""
        return {f.name: str(f.metadata.get("help", "")) for f in fields(cls)}


class PersonalHead(Protocol):
    """A device's personal part as the core uses it (`client.personal.PersonalPart`)."""

    def reset(self) -> None: ...

    def restore(self, data: bytes | None) -> None: ...

    def to_bytes(self) -> bytes: ...

    def train(self, examples: Examples, rng: np.random.Generator) -> float: ...

    def score(self, examples: Examples) -> PersonalScores | None: ...


class Backend(Protocol):
    """One task's model on one engine, and the version it stands at (None: nothing trusted)."""

    @property
    def spec(self) -> TaskSpec:
        """The task definition it runs."""
        ...

    @property
    def version(self) -> int | None:
        """The version it holds; None: nothing trusted."""
        ...

    @property
    def checksum(self) -> str:
        """The checksum of the version it holds ("" with none)."""
        ...

    @property
    def snapshot_format(self) -> str:
        """The snapshot format it loads (`FP32`, or a ternary task's packed one)."""
        ...

    def forget(self) -> None:
        """Stop trusting the state it holds: the next sync needs a snapshot."""

    def load_snapshot(self, data: bytes, version: int, checksum: str) -> None:
        """Load a snapshot of `version`; refused (ChecksumMismatchError, WireFormatError)
        unless it hashes to `checksum`."""

    def replay(self, *, task_id: str, entries: Sequence[LogEntry], target: int) -> SyncResult:
        """Replay the entries that take it from its version to `target` (version <= target);
        LogEntryMismatchError / ChecksumMismatchError, its state put back, when they cannot."""
        ...

    def restore(self, stored: StoredState) -> None:
        """Bring back a stored state (verified); raises SeedfedError when it does not verify."""

    def stored(self, task_id: str) -> StoredState:
        """What a restart needs of the version it holds."""
        ...

    def train(self, plan: RoundPlan, examples: Examples, data: DeviceData) -> Trained:
        """Run the plan's probes on the device's batches from the plan's version; the state
        is back at that version exactly afterwards (else DeviceStateError)."""
        ...

    def evaluate(self, examples: Examples) -> tuple[float, float]:
        """(accuracy, mean loss) of the state it holds on labelled examples."""
        ...

    def state_sizes(self) -> list[tuple[str, int]]:
        """(name, elements) of each trainable tensor; empty while it holds no state."""
        ...

    def calibrate_replay_rate(self) -> float:
        """Elements x seeds per second its replay runs at (`client.catchup`'s cost model)."""
        ...

    def personal_part(self, config: PersonalConfig, task_id: str) -> PersonalHead | None:
        """A personal part on this model (None: the model has none to personalize)."""
        ...
