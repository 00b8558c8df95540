"""The device as a Flower ClientApp (Message API): catch up, train on private data, reply scalars.

Wire contract with the ServerApp strategy (`seedfed.server.flower_strategy`), one ConfigRecord
under the key "seedfed" in each direction:

- TRAIN message: `plan` (RoundPlan JSON); `entries` (JSON list of LogEntryWire) to catch up from
  the device's last known version, or `snapshot` (safetensors bytes) with `snapshot-version`,
  `snapshot-checksum` and `snapshot-format` ("fp32" trainable state, or "ternary": the
  published packed snapshot, which is what a ternary task's devices get); `task` (TaskSpec
  JSON) only when the device is new or re-syncing.
- TRAIN reply: `g` (the scalar matrix, `shared.wire.pack_binary`), `n` (example count), `loss`.
  Nothing else leaves the device.
- EVALUATE message ("sync"): the same catch-up keys plus `version` and `checksum` of the target.
- EVALUATE reply: `version` and `checksum` the device now holds, and a MetricRecord with its
  local held-out `accuracy`, `loss` and `num-examples`.

A device that cannot reach the target (gap in the log, checksum mismatch) raises; Flower turns
that into an error reply and the strategy sends it a snapshot next time.

Node config (`flower-supernode --node-config`): `data`, `partition-id`, `num-partitions`,
`alpha`, `data-seed`, `local-eval` (see DeviceData) and `model`, the device's own copy of the
base model (default: the task's `model_path`).

State: the device's own trainable state, version and checksum live in the node's Context
(Flower keeps it between rounds, in simulation and on a SuperNode). A ternary task's device
(`client.ternary.PackedTernary`) also keeps there the published ternary snapshot it last loaded
(`ternary-snapshot`, `-version`, `-checksum`): the masked latents in `state` cannot rebuild the
packed model alone, and a SuperNode's fresh process per message must rebuild it each time.
The frozen base model, tokenizer and data partition are cached per process: a simulation's
Ray actor loads them once and only swaps the small trainable state between the virtual
devices it serves. A SuperNode of flwr 1.42 starts a fresh `flwr-clientapp` process per
message, so there the model is loaded per message and only the Context persists.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from seedfed.client import data as data_mod
from seedfed.client.device_data import DeviceData, load_device_examples, local_accuracy
from seedfed.client.sync import SyncResult, catch_up, load_state, state_bytes
from seedfed.client.ternary import SNAPSHOT_FORMAT, PackedTernary, is_ternary
from seedfed.client.trainer import LocalTrainer, classification_loss
from seedfed.shared.errors import SeedfedError
from seedfed.shared.models import ModelBundle, build_model
from seedfed.shared.replay import checksum
from seedfed.shared.task import TaskSpec
from seedfed.shared.wire import LogEntryWire, RoundPlan, pack_binary

log = logging.getLogger(__name__)

#: Key of the ConfigRecord carrying seedfed's payload in every message and reply.
RECORD = "seedfed"
#: Key of the device's persistent state in `Context.state`.
STATE = "seedfed.device"


class DeviceStateError(SeedfedError, RuntimeError):
    """The device cannot reach the requested version with what it holds and was sent."""


@dataclass
class _Loaded:
    """A model of one task in this process and the device state it currently holds."""

    bundle: ModelBundle
    trainer: LocalTrainer
    version: int = -1
    checksum: str = ""
    packed: PackedTernary | None = None  # a ternary task's packed model (bundle is its view)

    def invalidate(self) -> None:
        """The process copy is no longer trusted: the next message reloads the stored state."""
        self.version, self.checksum = -1, ""
        if self.packed is not None:
            self.packed.forget()


class DeviceRuntime:
    """Per-process cache of models (by task) and data partitions (by configuration)."""

    def __init__(self) -> None:
        self._models: dict[str, _Loaded] = {}
        self._ternary: dict[str, PackedTernary] = {}
        self._data: dict[DeviceData, tuple[data_mod.Examples, data_mod.Examples]] = {}

    @staticmethod
    def _key(task_id: str, spec_json: str, local_model: str | None) -> str:
        return (task_id + ":" + hashlib.sha256(spec_json.encode()).hexdigest()[:16] + ":"
                + (local_model or ""))

    @staticmethod
    def spec(spec_json: str, local_model: str | None = None) -> TaskSpec:
        spec = TaskSpec.from_dict(json.loads(spec_json))
        return replace(spec, model_path=local_model) if local_model else spec

    def ternary(self, task_id: str, spec_json: str, local_model: str | None = None,
                ) -> PackedTernary:
        """A ternary task's packed model (cached like `model`)."""
        key = self._key(task_id, spec_json, local_model)
        if key not in self._ternary:
            packed = PackedTernary(self.spec(spec_json, local_model))
            self._models, self._ternary = {}, {key: packed}  # one task per device at a time
        return self._ternary[key]

    def model(self, task_id: str, spec_json: str, local_model: str | None = None) -> _Loaded:
        """The task's model; `local_model` is this device's own copy of the base weights
        (node_config `model`), used instead of the coordinator's `model_path`."""
        key = self._key(task_id, spec_json, local_model)
        if key not in self._models:
            spec = self.spec(spec_json, local_model)
            if spec.model_kind != "seq_cls":
                raise DeviceStateError(f"the Flower device trains seq_cls tasks, task {task_id} "
                                       f"is {spec.model_kind}")
            bundle = build_model(spec, initialize=False)
            trainer = LocalTrainer(bundle.model, bundle.scope, classification_loss)
            self._models, self._ternary = {key: _Loaded(bundle, trainer)}, {}  # one task a time
        return self._models[key]

    def examples(self, data: DeviceData) -> tuple[data_mod.Examples, data_mod.Examples]:
        if data not in self._data:
            self._data[data] = load_device_examples(data)
        return self._data[data]


RUNTIME = DeviceRuntime()


def _stored(context: Context) -> ConfigRecord | None:
    return context.state.config_records.get(STATE)


def sync_device(payload: ConfigRecord, context: Context, target: int) -> tuple[_Loaded, SyncResult]:
    """Bring this node's model to `target` from its stored state, a snapshot or log entries,
    and remember the result in the node's Context."""
    stored = _stored(context)
    task_id = str(payload["task-id"])
    spec_json = payload.get("task") or (stored.get("task") if stored is not None else None)
    if spec_json is None:
        raise DeviceStateError(f"device knows nothing of task {task_id}; send the task and a "
                               "snapshot")
    local_model = context.node_config.get("model")
    local = str(local_model) if local_model else None
    if is_ternary(RUNTIME.spec(str(spec_json))):
        return sync_ternary(payload, context, target,
                            RUNTIME.ternary(task_id, str(spec_json), local), str(spec_json))
    loaded = RUNTIME.model(task_id, str(spec_json), local)
    scope = loaded.bundle.scope
    method = "none"
    if "snapshot" in payload:
        version = int(payload["snapshot-version"])  # type: ignore[arg-type]
        got = load_state(scope, bytes(payload["snapshot"]),  # type: ignore[arg-type]
                         str(payload["snapshot-checksum"]))
        loaded.version, loaded.checksum, method = version, got, "snapshot"
    elif stored is not None and stored.get("task-id") == task_id:
        version = int(stored["version"])  # type: ignore[arg-type]
        if (loaded.version, loaded.checksum) != (version, stored["checksum"]):
            loaded.checksum = load_state(scope, bytes(stored["state"]),  # type: ignore[arg-type]
                                         str(stored["checksum"]))
            loaded.version = version
    else:
        raise DeviceStateError(f"device holds no state of task {task_id} and got no snapshot")
    entries = [LogEntryWire.model_validate_json(e).to_entry()
               for e in json.loads(str(payload.get("entries", "[]")))]
    try:
        result = catch_up(scope, task_id=task_id, version=loaded.version, entries=entries,
                          target=target)
    except SeedfedError:
        loaded.invalidate()
        raise
    if result.method == "none" and method == "snapshot":
        result = SyncResult(result.version, result.checksum, "snapshot")
    changed = stored is None or result.version != int(stored["version"])  # type: ignore[arg-type]
    loaded.version, loaded.checksum = result.version, result.checksum
    if changed or method == "snapshot":
        context.state[STATE] = ConfigRecord({
            "task-id": task_id, "task": str(spec_json), "version": result.version,
            "checksum": result.checksum, "state": state_bytes(scope)})
    return loaded, result


def sync_ternary(payload: ConfigRecord, context: Context, target: int, packed: PackedTernary,
                 spec_json: str) -> tuple[_Loaded, SyncResult]:
    """`sync_device` for a ternary task: the packed model from the message's published
    ternary snapshot, or from the Context (epoch snapshot + masked latents) when this process
    does not hold the stored version; then `catch_up_ternary` to `target` with the message's
    entries. Reaching `target` needs a snapshot the message lacks (a mask epoch start, a log
    gap): that raises, and the strategy sends one next time."""
    stored = _stored(context)
    task_id = str(payload["task-id"])
    method = "none"
    try:
        if "snapshot" in payload:
            fmt = str(payload.get("snapshot-format", "fp32"))
            if fmt != SNAPSHOT_FORMAT:
                raise DeviceStateError(f"task {task_id} is ternary: its devices load the "
                                       f"published {SNAPSHOT_FORMAT} snapshot, not {fmt}")
            packed.load_snapshot(bytes(payload["snapshot"]),  # type: ignore[arg-type]
                                 int(payload["snapshot-version"]),  # type: ignore[arg-type]
                                 str(payload["snapshot-checksum"]))
            method = "snapshot"
        elif stored is not None and stored.get("task-id") == task_id:
            version, chk = int(stored["version"]), str(stored["checksum"])  # type: ignore[arg-type]
            if (packed.version, packed.checksum) != (version, chk):
                if "ternary-snapshot" not in stored:
                    raise DeviceStateError(f"stored state of task {task_id} holds no ternary "
                                           "snapshot; send one")
                packed.restore(snapshot=bytes(stored["ternary-snapshot"]),  # type: ignore[arg-type]
                               snapshot_version=int(stored["ternary-snapshot-version"]),  # type: ignore[arg-type]
                               snapshot_checksum=str(stored["ternary-snapshot-checksum"]),
                               state=bytes(stored["state"]),  # type: ignore[arg-type]
                               version=version, checksum=chk)
        else:
            raise DeviceStateError(f"device holds no state of task {task_id} and got no "
                                   "snapshot")
        entries = [LogEntryWire.model_validate_json(e).to_entry()
                   for e in json.loads(str(payload.get("entries", "[]")))]
        known = {e.base_version + 1: e.checksum for e in entries}
        target_checksum = str(payload.get("checksum") or known.get(target) or packed.checksum)

        def no_snapshot() -> bytes:
            raise DeviceStateError(f"task {task_id}: v{packed.version} -> v{target} cannot be "
                                   "replayed (mask epoch start or log gap); send a snapshot")

        result = packed.sync(task_id=task_id, target=target, target_checksum=target_checksum,
                             entries=entries, fetch=no_snapshot)
    except SeedfedError:
        packed.forget()
        raise
    if result.method == "none" and method == "snapshot":
        result = SyncResult(result.version, result.checksum, "snapshot")
    assert packed.scope is not None and packed.snapshot is not None
    changed = stored is None or result.version != int(stored["version"])  # type: ignore[arg-type]
    if changed or method == "snapshot":
        context.state[STATE] = ConfigRecord({
            "task-id": task_id, "task": spec_json, "version": result.version,
            "checksum": result.checksum, "state": state_bytes(packed.scope),
            "ternary-snapshot": packed.snapshot,
            "ternary-snapshot-version": int(packed.snapshot_version or 0),
            "ternary-snapshot-checksum": packed.snapshot_checksum})
    return _Loaded(packed.bundle, packed.trainer, result.version, result.checksum,
                   packed=packed), result


def train(message: Message, context: Context, data: DeviceData) -> Message:
    payload = message.content.config_records[RECORD]
    plan = RoundPlan.model_validate_json(str(payload["plan"]))
    loaded, _ = sync_device(payload, context, plan.version)
    mine = data.with_node_config(context.node_config)
    train_set, _ = RUNTIME.examples(mine)
    spec = loaded.bundle.spec
    rng = np.random.default_rng([mine.seed, mine.partition_id, plan.round])
    batches = data_mod.batches_for(spec.model_kind, train_set, loaded.bundle.tokenizer,
                                   plan.batch_size, spec.max_seq_len, rng)
    result = loaded.trainer.run(plan, batches)
    if checksum(loaded.bundle.scope) != loaded.checksum:  # the trainer must have put v back
        loaded.invalidate()
        raise DeviceStateError(f"local steps did not restore v{plan.version} exactly")
    # The aggregation weight is the size of the local training set (FedAvg's n_k, Flower's
    # num-examples), not the examples of this round's batches: every device probes the same
    # batch size, so weighting by batch would weigh a 14-example device like a 1,400-example
    # one, and with Dirichlet label skew the fleet would then train a different objective than
    # the union of its data (2 points of SST-2 accuracy; docs/accuracy.md).
    return Message(reply_content(result.scalars, len(train_set), result.loss),
                   reply_to=message)


def reply_content(scalars: np.ndarray, num_examples: int, loss: float) -> RecordDict:
    """A device's whole TRAIN reply: the scalar matrix, its example count and mean loss."""
    return RecordDict({RECORD: ConfigRecord({"g": pack_binary(scalars), "n": int(num_examples),
                                             "loss": float(loss)})})


def evaluate(message: Message, context: Context, data: DeviceData) -> Message:
    """The sync phase: catch up to the new version, verify it, score the local held-out set."""
    payload = message.content.config_records[RECORD]
    loaded, result = sync_device(payload, context, int(payload["version"]))  # type: ignore[arg-type]
    if result.checksum != payload["checksum"]:
        raise DeviceStateError(f"device reached v{result.version} with checksum "
                               f"{result.checksum[:16]}..., coordinator has "
                               f"{str(payload['checksum'])[:16]}...")
    _, local_eval = RUNTIME.examples(data.with_node_config(context.node_config))
    acc, loss = local_accuracy(loaded.bundle, local_eval)
    content = RecordDict({
        RECORD: ConfigRecord({"version": result.version, "checksum": result.checksum}),
        "metrics": MetricRecord({"accuracy": acc, "loss": loss,
                                 "num-examples": max(len(local_eval), 1)}),
    })
    return Message(content, reply_to=message)


def make_client_app(data: DeviceData | None = None) -> ClientApp:
    """A ClientApp whose devices read their data per `data`, overridden by node_config."""
    defaults = data or DeviceData()
    app = ClientApp()

    @app.train()
    def _train(message: Message, context: Context) -> Message:
        return train(message, context, defaults)

    @app.evaluate()
    def _evaluate(message: Message, context: Context) -> Message:
        return evaluate(message, context, defaults)

    return app


#: The ClientApp a SuperNode loads (`seedfed.client.flower_app:app`); data from node_config.
app = make_client_app()
