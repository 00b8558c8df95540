"""The device without a transport: one task's state, catch-up, personal part and round, over
any backend.

Everything a device does is here; a backend (`client.backends.base.Backend`) runs the model,
an adapter only moves messages and says where state lives:

- `client/flower_app.py`, the Flower ClientApp: entries or a snapshot arrive in the message,
  state persists in the node's Context;
- `client/http_device.py`, `seedfed device`: it fetches the log or a snapshot over REST, state
  persists in a directory.

A third transport is one more adapter: build a `Device`, give it a `StateStore`, and call
`resume`, `load_snapshot` / `sync`, `train` and `evaluate`. A new engine is one more backend.

Either way a device ends every sync on the checksum the coordinator published, or raises and
stops trusting what it holds (`invalidate`): the next sync then needs a snapshot.

A device may also keep a personal part (`client.personal`, `Device(personal=...)`, a torch
backend's fp32 classifier): a small head of its own, trained after each round's shared steps
on its own data and stored with its state (`StoredState.personal`), added on top of whatever
shared version it syncs to. It is never part of an upload; a stored one that does not fit is
rebuilt, the shared state untouched.

This module imports no torch (the ONNX Runtime device runs it); the torch backend loads only
when a device asks for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
from seedfed.client.backends.base import (
    FP32,
    Backend,
    BackendConfig,
    DeviceStateError,
    Fetch,
    PersonalHead,
    StoredState,
    SyncResult,
    Trained,
)
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    ScopeError,
    SeedfedError,
)
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

if TYPE_CHECKING:
    from seedfed.client.data import Examples
    from seedfed.client.device_data import DeviceData
    from seedfed.client.personal import PersonalConfig, PersonalScores
    from seedfed.shared.model.features import FeatureStore

log = logging.getLogger(__name__)


class StateStore(Protocol):
    """Where an adapter keeps a device's StoredState (a Flower Context, a directory, ...)."""

    def load(self) -> StoredState | None: ...

    def save(self, state: StoredState) -> None: ...


class MemoryStore:
    """A StateStore that forgets on exit (tests, one-shot tools)."""

    def __init__(self, state: StoredState | None = None) -> None:
        self.state = state

    def load(self) -> StoredState | None:
        return self.state

    def save(self, state: StoredState) -> None:
        self.state = state


class Device:
    """One device of one task: its backend, where its state persists, and what it does."""

    def __init__(self, spec: TaskSpec, task_id: str, store: StateStore | None = None,
                 personal: PersonalConfig | None = None,
                 features: FeatureStore | None = None, *,
                 backend: Backend | BackendConfig | None = None) -> None:
        """`backend`: a built backend, or the config of one (None: torch on the CPU).
        `features` (torch backend): a feature store shared with other processes (a
        simulation's run directory, seedfed/features.py); None, every real device: its own
        cache only. Either way the cached rows are the same bits."""
        self.spec, self.task_id = spec, task_id
        if backend is None or isinstance(backend, BackendConfig):
            from seedfed.client.backends.select import open_backend

            backend = open_backend(spec, backend or BackendConfig(), features=features)
        elif features is not None:
            raise ValueError("features= goes to the backend when it is built; give a "
                             "BackendConfig, or build the backend with it")
        self.backend: Backend = backend
        self.store: StateStore = store or MemoryStore()
        # Built now, before any snapshot: it keeps the prototype head as the local-only start.
        self.personal: PersonalHead | None = None
        if personal is not None and personal.enabled:
            try:
                self.personal = backend.personal_part(personal, task_id)
            except ScopeError as e:  # a model without a class head: nothing to personalize
                log.warning("task %s: no personal part (%s)", task_id, e)
            if self.personal is None:
                log.warning("task %s: this model has no personal part", task_id)
        # The store the personal part was last read from: an adapter that serves several
        # virtual devices with one Device (a simulation's Flower actor) swaps the store per
        # message, and the personal part must follow it like the shared state does.
        self._personal_from: StateStore | None = None

    @property
    def version(self) -> int | None:
        """The version the backend holds; None: nothing trusted (the next sync needs a
        snapshot)."""
        return self.backend.version

    @property
    def checksum(self) -> str:
        return self.backend.checksum

    @property
    def snapshot_format(self) -> str:
        """The snapshot this device loads: fp32 state, or a ternary task's packed one."""
        return self.backend.snapshot_format

    def invalidate(self) -> None:
        """Stop trusting the backend's state (after a failure)."""
        self.backend.forget()

    @contextmanager
    def _trusted_only(self) -> Iterator[None]:
        """A failure inside leaves the state half-known: trust nothing, so the next sync
        takes a snapshot."""
        try:
            yield
        except SeedfedError:
            self.invalidate()
            raise

    # -- catching up ---------------------------------------------------------------------------
    def resume(self) -> bool:
        """Bring back the store's state unless the backend holds it already; False when the
        store holds none of this task. A stored state that does not verify invalidates the
        device and raises DeviceStateError (a snapshot settles it)."""
        try:
            stored = self.store.load()
        except (SeedfedError, OSError, KeyError, ValueError) as e:  # unreadable, not stale
            self.invalidate()
            raise DeviceStateError(f"stored state of task {self.task_id} is unreadable: "
                                   f"{e}") from e
        if stored is None or stored.task_id != self.task_id:
            return False
        self._follow_store(stored)
        if (self.version, self.checksum) == (stored.version, stored.checksum):
            return True
        try:
            self.backend.restore(stored)
        except SeedfedError as e:
            self.invalidate()
            raise DeviceStateError(f"stored state of task {self.task_id} v{stored.version} "
                                   f"is unusable: {e}") from e
        return True

    def _follow_store(self, stored: StoredState | None = None, *, read: bool = False) -> None:
        """Bring the personal part of the current store in (once per store). It is checked
        on its own: a refused personal state is rebuilt, the shared state stays as it is."""
        if self.personal is None or self._personal_from is self.store:
            return
        if read:
            try:
                stored = self.store.load()
            except (SeedfedError, OSError, KeyError, ValueError):
                stored = None  # resume() reports an unreadable store; nothing personal here
        self.personal.reset()
        if stored is not None and stored.task_id == self.task_id:
            self.personal.restore(stored.personal)
        self._personal_from = self.store

    def load_snapshot(self, data: bytes, version: int, checksum: str,
                      fmt: str = FP32) -> SyncResult:
        """Load a snapshot of `version` (verified against `checksum`) and store the result;
        the personal part is kept (it applies on top of any shared version)."""
        self._follow_store(read=True)
        if fmt != self.snapshot_format:
            raise DeviceStateError(f"task {self.task_id} devices load {self.snapshot_format} "
                                   f"snapshots, not {fmt}")
        with self._trusted_only():
            self.backend.load_snapshot(data, version, checksum)
        self._save()
        return SyncResult(version, checksum, "snapshot")

    def sync(self, target: int, *, entries: Sequence[LogEntry] = (),
             fetch: Fetch | None = None) -> SyncResult:
        """Reach `target`: nothing to do, replay `entries` when they reach it from here (a
        ternary task: inside a mask epoch), else load the snapshot `fetch()` downloads;
        without `fetch` that raises."""
        self._follow_store(read=True)
        if self.version == target:
            return SyncResult(target, self.checksum, "none")
        with self._trusted_only():
            result = self._reach(target, entries, fetch or self._no_snapshot(target))
        self._save()
        return result

    def _reach(self, target: int, entries: Sequence[LogEntry], fetch: Fetch) -> SyncResult:
        if self.version is not None and self.version <= target and entries:
            try:
                return self.backend.replay(task_id=self.task_id, entries=entries,
                                           target=target)
            except (ChecksumMismatchError, LogEntryMismatchError) as e:
                log.warning("replay failed (%s); loading a snapshot", e)
        data, chk = fetch()
        self.backend.load_snapshot(data, target, chk)
        return SyncResult(target, self.checksum, "snapshot")

    def _no_snapshot(self, target: int) -> Fetch:
        def refuse() -> tuple[bytes, str]:
            if self.version is None:
                raise DeviceStateError(f"device holds no state of task {self.task_id} and got "
                                       "no snapshot")
            raise DeviceStateError(f"task {self.task_id}: v{self.version} -> v{target} cannot "
                                   "be replayed from what was sent; send a snapshot")
        return refuse

    def _save(self) -> None:
        stored = self.backend.stored(self.task_id)
        if self.personal is not None:
            stored = replace(stored, personal=self.personal.to_bytes())
        self.store.save(stored)

    def reset_personal(self) -> None:
        """Forget the personal part (a device owner's reset); the shared state stays."""
        if self.personal is not None:
            self._follow_store(read=True)
            self.personal.reset()
            if self.version is not None:
                self._save()

    # -- a round ---------------------------------------------------------------------------------
    def train(self, plan: RoundPlan, examples: Examples, data: DeviceData) -> Trained:
        """Run the plan's steps on the device's training set from the plan's version (synced
        first) and return to that version exactly."""
        if self.version != plan.version:
            raise DeviceStateError(f"device is at v{self.version}, the plan at v{plan.version}")
        self._follow_store(read=True)
        trained = self.backend.train(plan, examples, data)  # DeviceStateError: it forgot
        if self.personal is not None:
            # after the shared steps, at the plan's version: nothing here reaches the upload
            self.personal.train(examples, np.random.default_rng(
                [data.seed, data.partition_id, plan.round, 0x9E75]))
            self._save()
        return trained

    def evaluate(self, examples: Examples) -> tuple[float, float]:
        """(accuracy, mean loss) of the model it holds on a local held-out set."""
        return self.backend.evaluate(examples)

    def evaluate_personal(self, examples: Examples) -> PersonalScores | None:
        """Held-out accuracy of the shared model alone, shared + personal, and the local-only
        reference; None without a personal part or examples."""
        if self.personal is None:
            return None
        self._follow_store(read=True)
        return self.personal.score(examples)
