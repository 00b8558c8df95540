"""The device without a transport: one task's model, its state store, catch-up, training, scoring.

Everything a device does is here; an adapter only moves messages and says where state lives:

- `client/flower_app.py`, the Flower ClientApp: entries or a snapshot arrive in the message,
  state persists in the node's Context;
- `client/http_device.py`, `seedfed device`: it fetches the log or a snapshot over REST, state
  persists in a directory.

A third transport is one more adapter: build a `Device`, give it a `StateStore`, and call
`resume`, `load_snapshot` / `sync`, `train` and `evaluate`.

The model is one of two backends with the same interface: `Fp32Model`, whose trainable state
is float32 values (every scope but ternary: full, LoRA, named, a quantized model's scales), and
`client.ternary.PackedTernary`, a ternary task's packed model. Either way a device ends every
sync on the checksum the coordinator published, or raises and stops trusting what it holds
(`invalidate`): the next sync then needs a snapshot.

A device may also keep a personal part (`client.personal`, `Device(personal=...)`): a small
head of its own, trained after each round's shared steps on its own data and stored with its
state (`StoredState.personal`), added on top of whatever shared version it syncs to. It is
never part of an upload; a stored one that does not fit is rebuilt, the shared state untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
from seedfed.client import data as data_mod
from seedfed.client.device_data import DeviceData, local_accuracy
from seedfed.client.personal import PersonalConfig, PersonalPart, PersonalScores
from seedfed.client.sync import SyncResult, catch_up, load_state, state_bytes
from seedfed.client.ternary import SNAPSHOT_FORMAT, PackedTernary, is_ternary
from seedfed.client.trainer import LocalTrainer, classification_loss
from seedfed.shared.model.models import (
    FeatureStore,
    ModelBundle,
    build_model,
    expect_texts,
    share_features,
)
from seedfed.shared.model.replay import LogEntry, checksum
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    ScopeError,
    SeedfedError,
)
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

log = logging.getLogger(__name__)

#: A snapshot download: () -> (file bytes, the state checksum the coordinator published).
Fetch = Callable[[], tuple[bytes, str]]
#: The `snapshot-format` / `?format=` of an fp32 trainable-state snapshot.
FP32 = "fp32"


class DeviceStateError(SeedfedError, RuntimeError):
    """The device cannot reach the requested version with what it holds and was sent."""


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


@dataclass(frozen=True)
class Trained:
    """A round's upload: the scalar matrix (steps x P), the aggregation weight, the loss."""

    scalars: np.ndarray
    num_examples: int
    loss: float


class Fp32Model:
    """A task's model whose trainable state is float32 values: every scope but ternary."""

    snapshot_format = FP32

    def __init__(self, spec: TaskSpec) -> None:
        if spec.model_kind != "seq_cls":
            raise DeviceStateError(f"a device trains seq_cls tasks (and ternary causal LMs), "
                                   f"not {spec.model_kind}")
        self.bundle: ModelBundle = build_model(spec, initialize=False)
        self.trainer = LocalTrainer(self.bundle.model, self.bundle.scope, classification_loss,
                                    max_copies=spec.hyper.probe_copies,
                                    budget_mb=spec.hyper.probe_memory_mb)
        self.version: int | None = None
        self.checksum = ""

    def forget(self) -> None:
        self.version, self.checksum = None, ""

    def load_snapshot(self, data: bytes, version: int, checksum: str) -> None:
        self.checksum = load_state(self.bundle.scope, data, checksum)
        self.version = version

    def restore(self, stored: StoredState) -> None:
        if stored.state is None:
            raise DeviceStateError(f"no stored state of v{stored.version}")
        self.load_snapshot(stored.state, stored.version, stored.checksum)

    def sync(self, *, task_id: str, target: int, entries: Sequence[LogEntry],
             fetch: Fetch) -> SyncResult:
        """Replay `entries` when they reach `target` from here, else load `fetch()`'s."""
        if self.version is not None and self.version <= target and entries:
            try:
                result = catch_up(self.bundle.scope, task_id=task_id, version=self.version,
                                  entries=entries, target=target)
            except (ChecksumMismatchError, LogEntryMismatchError) as e:
                log.warning("replay failed (%s); loading a snapshot", e)
            else:
                self.version, self.checksum = result.version, result.checksum
                return result
        data, chk = fetch()
        self.load_snapshot(data, target, chk)
        return SyncResult(target, self.checksum, "snapshot")

    def stored(self, task_id: str) -> StoredState:
        assert self.version is not None
        return StoredState(task_id, self.version, self.checksum, state_bytes(self.bundle.scope))


def _restore_packed(packed: PackedTernary, stored: StoredState) -> None:
    if stored.snapshot is None or stored.snapshot_version is None:
        raise DeviceStateError(f"stored state of task {stored.task_id} holds no ternary "
                               "snapshot; send one")
    packed.restore(snapshot=stored.snapshot, snapshot_version=stored.snapshot_version,
                   snapshot_checksum=stored.snapshot_checksum, state=stored.state,
                   version=stored.version, checksum=stored.checksum)


def _stored_packed(packed: PackedTernary, task_id: str) -> StoredState:
    assert packed.version is not None and packed.scope is not None
    return StoredState(task_id, packed.version, packed.checksum, state_bytes(packed.scope),
                       packed.snapshot, packed.snapshot_version, packed.snapshot_checksum)


class Device:
    """One device of one task: its model, where its state persists, and what it does."""

    def __init__(self, spec: TaskSpec, task_id: str, store: StateStore | None = None,
                 personal: PersonalConfig | None = None,
                 features: FeatureStore | None = None) -> None:
        """`features`: a feature store shared with other processes (a simulation's run
        directory, seedfed/features.py); None, every real device: its own cache only. Either
        way the cached rows are the same bits (shared.models.FEATURE_GROUP)."""
        self.spec, self.task_id = spec, task_id
        self.model: Fp32Model | PackedTernary = (
            PackedTernary(spec) if is_ternary(spec) else Fp32Model(spec))
        if isinstance(self.model, Fp32Model):
            share_features(self.model.bundle.model, features)
        self._warm = features is not None
        # Example sets already named to the feature cache (`expect_texts`), by identity.
        self._expected: dict[int, data_mod.Examples] = {}
        self.store: StateStore = store or MemoryStore()
        # Built now, before any snapshot: it keeps the prototype head as the local-only start.
        # A ternary task (a causal LM) has no class head to personalize.
        self.personal: PersonalPart | None = None
        if personal is not None and personal.enabled and isinstance(self.model, Fp32Model):
            try:
                self.personal = PersonalPart(personal, self.model.bundle, task_id)
            except ScopeError as e:  # a model without a class head: nothing to personalize
                log.warning("task %s: no personal part (%s)", task_id, e)
        # The store the personal part was last read from: an adapter that serves several
        # virtual devices with one Device (a simulation's Flower actor) swaps the store per
        # message, and the personal part must follow it like the shared state does.
        self._personal_from: StateStore | None = None

    @property
    def version(self) -> int | None:
        """The version the model holds; None: nothing trusted (the next sync needs a
        snapshot)."""
        return self.model.version

    @property
    def checksum(self) -> str:
        return self.model.checksum

    @property
    def snapshot_format(self) -> str:
        """The snapshot this device loads: fp32 state, or a ternary task's packed one."""
        return SNAPSHOT_FORMAT if isinstance(self.model, PackedTernary) else FP32

    @property
    def bundle(self) -> ModelBundle:
        return self.model.bundle

    def invalidate(self) -> None:
        """Stop trusting the model's state (after a failure)."""
        self.model.forget()

    @contextmanager
    def _trusted_only(self) -> Iterator[None]:
        """A failure inside leaves the model half-known: trust nothing, so the next sync
        takes a snapshot."""
        try:
            yield
        except SeedfedError:
            self.invalidate()
            raise

    # -- catching up ---------------------------------------------------------------------------
    def resume(self) -> bool:
        """Bring back the store's state unless the model holds it already; False when the
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
            if isinstance(self.model, PackedTernary):
                _restore_packed(self.model, stored)
            else:
                self.model.restore(stored)
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
            self.model.load_snapshot(data, version, checksum)
        self._save()
        return SyncResult(version, checksum, "snapshot")

    def sync(self, target: int, *, entries: Sequence[LogEntry] = (),
             fetch: Fetch | None = None) -> SyncResult:
        """Reach `target`: nothing to do, replay `entries` (inside a mask epoch, for a ternary
        task), else load the snapshot `fetch()` downloads; without `fetch` that raises."""
        self._follow_store(read=True)
        if self.version == target:
            return SyncResult(target, self.checksum, "none")
        with self._trusted_only():
            result = self.model.sync(task_id=self.task_id, target=target, entries=entries,
                                     fetch=fetch or self._no_snapshot(target))
        self._save()
        return result

    def _no_snapshot(self, target: int) -> Fetch:
        def refuse() -> tuple[bytes, str]:
            if self.version is None:
                raise DeviceStateError(f"device holds no state of task {self.task_id} and got "
                                       "no snapshot")
            raise DeviceStateError(f"task {self.task_id}: v{self.version} -> v{target} cannot "
                                   "be replayed from what was sent; send a snapshot")
        return refuse

    def _save(self) -> None:
        if isinstance(self.model, PackedTernary):
            self.store.save(_stored_packed(self.model, self.task_id))
            return
        stored = self.model.stored(self.task_id)
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
    def train(self, plan: RoundPlan, examples: data_mod.Examples, data: DeviceData) -> Trained:
        """Run the plan's steps on the device's training set from the plan's version (synced
        first) and return to that version exactly."""
        if self.version != plan.version:
            raise DeviceStateError(f"device is at v{self.version}, the plan at v{plan.version}")
        self._follow_store(read=True)
        bundle = self.bundle
        self._expect(examples)
        rng = np.random.default_rng([data.seed, data.partition_id, plan.round])
        batches = data_mod.batches_for(bundle.spec.model_kind, examples, bundle.tokenizer,
                                       plan.batch_size, bundle.spec.max_seq_len, rng)
        result = self.model.trainer.run(plan, batches)
        if checksum(bundle.scope) != self.checksum:  # the trainer must have put v back
            self.invalidate()
            raise DeviceStateError(f"local steps did not restore v{plan.version} exactly")
        if self.personal is not None:
            # after the shared steps, at the plan's version: nothing here reaches the upload
            self.personal.train(examples, np.random.default_rng(
                [data.seed, data.partition_id, plan.round, 0x9E75]))
            self._save()
        # The aggregation weight is the size of the local training set (FedAvg's n_k, Flower's
        # num-examples), not the examples of this round's batches: every device probes the
        # same batch size, so weighting by batch would weigh a 14-example device like a
        # 1,400-example one, and with Dirichlet label skew the fleet would then train a
        # different objective than the union of its data (2 points of SST-2 accuracy;
        # docs/accuracy.md).
        return Trained(result.scalars, len(examples), result.loss)

    def _expect(self, examples: data_mod.Examples) -> None:
        """Name the device's own examples to the feature cache once: the canonical groups it
        encodes are then filled with sentences it will need, not repeats. With a shared
        feature store (a simulation, whose processes serve every device's data) they are
        cached at once, in full groups or from the store. Speed only, never a bit."""
        if id(examples) not in self._expected and isinstance(self.model, Fp32Model):
            self._expected[id(examples)] = examples  # held: the id stays this object's
            expect_texts(self.bundle.model, self.bundle.tokenizer, examples.texts,
                         self.spec.max_seq_len, now=self._warm)

    def evaluate(self, examples: data_mod.Examples) -> tuple[float, float]:
        """(accuracy, mean loss) of the model it holds on a local held-out set."""
        self._expect(examples)
        return local_accuracy(self.bundle, examples)

    def evaluate_personal(self, examples: data_mod.Examples) -> PersonalScores | None:
        """Held-out accuracy of the shared model alone, shared + personal, and the local-only
        reference; None without a personal part or examples."""
        if self.personal is None:
            return None
        self._follow_store(read=True)
        return self.personal.score(examples)
