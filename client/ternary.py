"""A device on a ternary (TerMeZO) task: the packed model, its sync and what a restart needs.

It is a model kind of the torch backend (`client.backends.torch`). A ternary device never
holds the fp32 model, not even while it starts: `shared.ternary.build_packed_model` builds the
task's model from its config with the ternary layers (those the coordinator converts, Linear
-> BitLinear) as empty packed modules and reads only the other tensors (embeddings, norms, LM
head) from the base model's safetensors; codes, gammas, masks and masked latents then come from
the coordinator's published ternary snapshot (`?format=ternary`, never the fp32 master file,
which for ternary holds every latent). Until the first snapshot loads the model holds no codes
and must not run (`bundle` and `trainer` refuse; a forward raises). z covers the masked
latents only (and, with `train_head`, a classifier's float head). A `seq_cls` task's model is
the mean-pooled encoder + head of `shared.model.classifier`; its head comes with every snapshot.

Sync follows `client.sync.replayable_in_epoch`'s rule (`replay` here, the snapshot in
`client.device.Device`): replay inside a mask epoch, the published snapshot of the target
across an epoch start (checksum verified either way).

Restart state. The masked latents alone cannot rebuild the packed model (the codes of the
other weights and gamma come from the snapshot), so a device keeps two things:

- `snapshot`: the bytes of the last published snapshot it loaded (version `snapshot_version`,
  checksum `snapshot_checksum`). Within a mask epoch the codes outside the mask, gamma and
  the mask never change, so this file stays valid for the whole epoch; it is replaced at the
  next epoch start, when the device downloads a new one anyway.
- the scope state of its current version (`client.sync.state_bytes`: the masked latents).

`restore` loads the snapshot, then the latents, verifying both checksums; anything that does
not verify raises, and the caller downloads a fresh snapshot instead. Storage is the packed
model's size (about 2 bits per weight plus the mask), the same as what the device holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from seedfed.client.backends.base import DeviceStateError, SyncResult
from seedfed.client.sync import catch_up, load_state, read_snapshot, replayable_in_epoch
from seedfed.client.trainer import LocalTrainer
from seedfed.shared.model.factory import ModelBundle
from seedfed.shared.model.hf import load_tokenizer, set_pad_token_id
from seedfed.shared.model.objectives import task_losses
from seedfed.shared.model.ternary import (
    MaskConfig,
    TernaryScope,
    build_packed_model,
    load_published_ternary,
)
from seedfed.shared.protocol.errors import LogEntryMismatchError
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.scope_options import TernaryOptions
from seedfed.shared.protocol.task import TaskSpec

#: The `?format=` of the snapshot a ternary device downloads (the task's published format).
SNAPSHOT_FORMAT = "ternary"


def is_ternary(spec: TaskSpec) -> bool:
    return spec.scope == "ternary"


class PackedTernary:
    """A ternary task's model held packed on a device, and the version it stands at.

    `scope` is None until the first snapshot is loaded: a fresh model's BitLinear layers hold
    no codes, gamma or latents, so `bundle` and `trainer` refuse until then and `model` must
    not be run. A snapshot rebuilds the layers and so replaces the scope; `trainer` follows it.
    """

    @staticmethod
    def options(spec: TaskSpec) -> TernaryOptions:
        """The ternary scope options of the task (TaskSpec types them by its scope)."""
        assert isinstance(spec.scope_options, TernaryOptions)
        return spec.scope_options

    snapshot_format = SNAPSHOT_FORMAT

    def __init__(self, spec: TaskSpec) -> None:
        if not is_ternary(spec):
            raise ValueError(f"task scope is {spec.scope!r}, not 'ternary'")
        tokenizer = load_tokenizer(Path(spec.model_path))
        if tokenizer is None:
            raise DeviceStateError(f"{spec.model_path} has no tokenizer; a device needs one "
                                     "to turn its texts into tokens")
        # The layers the coordinator's scope converts, with its act_bits, as empty packed
        # BitLinear modules; no fp32 ternary matrix is ever read.
        # A classifier's float head arrives with the snapshot as well.
        self.model = build_packed_model(spec.model_path, act_bits=self.options(spec).act_bits,
                                        model_kind=spec.model_kind, num_labels=spec.num_labels)
        set_pad_token_id(self.model, tokenizer)
        self.tokenizer, self.spec = tokenizer, spec
        self.config: MaskConfig = self.options(spec).mask
        self.loss, self.copy_losses = task_losses(spec, tokenizer)
        self.scope: TernaryScope | None = None
        self.version: int | None = None
        self.checksum = ""
        self.snapshot: bytes | None = None
        self.snapshot_version: int | None = None
        self.snapshot_checksum = ""
        self._trainer: LocalTrainer | None = None

    # -- what the rest of the device uses -------------------------------------------------------
    @property
    def bundle(self) -> ModelBundle:
        """The model as a ModelBundle (for batches and local scoring); needs a loaded scope."""
        if self.scope is None:
            raise DeviceStateError("the packed model holds no snapshot yet")
        return ModelBundle(model=self.model, tokenizer=self.tokenizer, scope=self.scope,
                           spec=self.spec)

    @property
    def trainer(self) -> LocalTrainer:
        if self.scope is None:
            raise DeviceStateError("the packed model holds no snapshot yet")
        if self._trainer is None or self._trainer.scope is not self.scope:
            self._trainer = LocalTrainer(self.model, self.scope, self.loss,
                                         copy_losses=self.copy_losses)
        return self._trainer

    def forget(self) -> None:
        """Stop trusting the in-memory state (after a failure): the next sync reloads."""
        self.version, self.checksum = None, ""

    # -- catching up ----------------------------------------------------------------------------
    def load_snapshot(self, data: bytes, version: int, checksum: str) -> SyncResult:
        """Load a published ternary snapshot of `version` (bytes), verified against
        `checksum`; on a refusal the model stays as it was."""
        self.scope = self._adopt(load_published_ternary(
            self.model, read_snapshot(data), config=self.config,
            epoch=self.config.epoch_of(version), expected_checksum=checksum))
        self.version, self.checksum = version, checksum
        self.snapshot, self.snapshot_version, self.snapshot_checksum = data, version, checksum
        return SyncResult(version, checksum, "snapshot")

    def replay(self, *, task_id: str, entries: Sequence[LogEntry], target: int) -> SyncResult:
        """Replay `entries` to `target` inside the mask epoch it stands in; across an epoch
        start (or an entry announcing another epoch) LogEntryMismatchError: the published
        snapshot of `target` settles it (`client.sync.replayable_in_epoch`)."""
        if self.scope is None or self.version is None:
            raise LogEntryMismatchError(f"task {task_id}: no ternary state to replay into")
        if not replayable_in_epoch(self.scope, version=self.version, target=target,
                                   config=self.config, entries=entries):
            raise LogEntryMismatchError(f"task {task_id}: v{self.version} -> v{target} leaves "
                                        "the mask epoch; load the published snapshot")
        result = catch_up(self.scope, task_id=task_id, version=self.version, entries=entries,
                          target=target)
        self.version, self.checksum = result.version, result.checksum
        return result

    def _adopt(self, scope: TernaryScope) -> TernaryScope:
        """A scope rebuilt from a snapshot, with the task's step scales (`TaskSpec.step_scales`):
        the coordinator's scope carries them, so without them this device's probes and replay
        would move its tensors by c = 1 where the coordinator moves them by c_t, and every
        replay would end on another checksum."""
        if self.spec.step_scales:
            scope.set_step_scales(self.spec.step_scales)
        return scope

    def restore(self, *, snapshot: bytes, snapshot_version: int, snapshot_checksum: str,
                state: bytes | None, version: int, checksum: str) -> None:
        """Rebuild the stored version: the epoch's snapshot, then the version's latents.

        Raises (and leaves the device needing a snapshot) when the two lie in different mask
        epochs or either fails its checksum."""
        if self.config.epoch_of(snapshot_version) != self.config.epoch_of(version) or \
                snapshot_version > version:
            raise DeviceStateError(f"stored snapshot v{snapshot_version} cannot restore "
                                     f"v{version} (another mask epoch)")
        self.forget()
        self.load_snapshot(snapshot, snapshot_version, snapshot_checksum)
        self.version = None  # until the latents of `version` verify
        if version != snapshot_version or checksum != snapshot_checksum:
            if state is None:
                raise DeviceStateError(f"no stored latents of v{version}")
            assert self.scope is not None
            load_state(self.scope, state, checksum)
        self.version, self.checksum = version, checksum
