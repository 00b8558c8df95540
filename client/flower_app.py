"""The device as a Flower ClientApp (Message API): catch up, train on private data, reply scalars.

The messages are `seedfed.shared.protocol.records` (TrainIns / TrainRes, SyncIns / SyncRes), the
classes the ServerApp strategy (`seedfed.server.flower_strategy`) writes and reads. The device
itself (catch-up, training, scoring) is `client.device.Device` on the torch backend, on the
CPU (`client.backends.torch`); this module is its Flower transport and its state store in the
node's Context.

A device that cannot reach the target (gap in the log, checksum mismatch) raises; Flower turns
that into an error reply and the strategy sends it a snapshot next time.

Node config (`flower-supernode --node-config`): `data`, `partition-id`, `num-partitions`,
`alpha`, `data-seed`, `local-eval`, `label-skew` (see DeviceData), `model`, the device's own
copy of the base model (default: the task's `model_path`), and `personal`, the device's
personal part (`residual`, `ditto`, `fedper` or `off`; client.personal), which lives in the
Context under `personal` and is never part of a reply: the sync reply carries its accuracy
(shared, personalized, local-only) as metrics only.

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
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from seedfed.client import data as data_mod
from seedfed.client.backends.base import BackendConfig, DeviceStateError, StoredState, SyncResult
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.personal import PersonalConfig
from seedfed.shared.model.features import FeatureStore
from seedfed.shared.protocol.records import CatchUp, SyncIns, SyncRes, TrainIns, TrainRes
from seedfed.shared.protocol.task import TaskSpec

#: Key of the device's persistent state in `Context.state`.
STATE = "seedfed.device"

T = TypeVar("T")

__all__ = ["STATE", "ContextStore", "DeviceRuntime", "DeviceStateError", "make_client_app"]


class ContextStore:
    """A device's StoredState in its node's Context (one ConfigRecord under `STATE`), with
    the task definition it was built from (a device is sent the task only once)."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.task_json: str | None = None  # the task being served (written with the state)

    def _record(self) -> ConfigRecord | None:
        return self.context.state.config_records.get(STATE)

    def stored_task(self) -> tuple[str, str] | None:
        """(task id, TaskSpec JSON) of the stored state, if any."""
        rec = self._record()
        if rec is None:
            return None
        return str(rec["task-id"]), str(rec["task"])

    def load(self) -> StoredState | None:
        rec = self._record()
        if rec is None:
            return None
        snap = rec.get("ternary-snapshot")
        return StoredState(
            str(rec["task-id"]), _typed(rec, "version", int), str(rec["checksum"]),
            _typed(rec, "state", bytes),
            None if snap is None else _typed(rec, "ternary-snapshot", bytes),
            None if snap is None else _typed(rec, "ternary-snapshot-version", int),
            str(rec.get("ternary-snapshot-checksum", "")),
            _typed(rec, "personal", bytes) if "personal" in rec else None)

    def save(self, state: StoredState) -> None:
        assert self.task_json is not None
        fields: dict[str, Any] = {"task-id": state.task_id, "task": self.task_json,
                                  "version": state.version, "checksum": state.checksum,
                                  "state": state.state}
        if state.snapshot is not None:
            fields.update({"ternary-snapshot": state.snapshot,
                           "ternary-snapshot-version": int(state.snapshot_version or 0),
                           "ternary-snapshot-checksum": state.snapshot_checksum})
        if state.personal is not None:  # the node's own state: never part of a reply
            fields["personal"] = state.personal
        self.context.state[STATE] = ConfigRecord(fields)


def _typed(rec: ConfigRecord, key: str, kind: type[T]) -> T:
    value = rec[key]
    if not isinstance(value, kind):
        raise DeviceStateError(f"stored {key!r} is {type(value).__name__}, not "
                               f"{kind.__name__}")
    return value


class DeviceRuntime:
    """Per-process cache of the device (one task at a time) and data partitions."""

    def __init__(self) -> None:
        self._devices: dict[str, Device] = {}
        self._data: dict[DeviceData, tuple[data_mod.Examples, data_mod.Examples]] = {}

    def device(self, task_id: str, spec_json: str, local_model: str | None,
               personal: PersonalConfig | None = None,
               features: FeatureStore | None = None, torch_device: str = "cpu") -> Device:
        """The task's device; `local_model` is this node's own copy of the base weights
        (node_config `model`), used instead of the coordinator's `model_path`; `personal`
        its personal part (None: none); `features` a feature store shared beyond this
        process (a simulation's; None: none); `torch_device` where the torch backend runs
        (`BackendConfig.torch_device`)."""
        key = (task_id + ":" + hashlib.sha256(spec_json.encode()).hexdigest()[:16] + ":"
               + (local_model or "") + ":" + repr(personal) + ":" + torch_device)
        if key not in self._devices:
            spec = TaskSpec.from_dict(json.loads(spec_json))
            if local_model:
                spec = replace(spec, model_path=local_model)
            # one task per device at a time
            self._devices = {key: Device(spec, task_id, personal=personal, features=features,
                                         backend=BackendConfig(torch_device=torch_device))}
        return self._devices[key]

    def examples(self, data: DeviceData) -> tuple[data_mod.Examples, data_mod.Examples]:
        if data not in self._data:
            self._data[data] = load_device_examples(data)
        return self._data[data]


RUNTIME = DeviceRuntime()


def node_personal(context: Context, default: PersonalConfig | None) -> PersonalConfig | None:
    """The node's personal part: node_config `personal` (a method name) over the app's."""
    method = context.node_config.get("personal")
    if method is None:
        return default
    return replace(default or PersonalConfig(), method=str(method))


def sync_device(task_id: str, catch_up: CatchUp, context: Context, target: int,
                personal: PersonalConfig | None = None,
                features: FeatureStore | None = None,
                torch_device: str = "cpu") -> tuple[Device, SyncResult]:
    """Bring this node's device to `target` from the message's snapshot, or from its stored
    state plus the message's log entries, and remember the result in the node's Context.
    The torch device is node_config `torch-device` over `torch_device`."""
    store = ContextStore(context)
    stored = store.stored_task()
    spec_json = catch_up.task or (stored[1] if stored is not None else None)
    if spec_json is None:
        raise DeviceStateError(f"device knows nothing of task {task_id}; send the task and a "
                               "snapshot")
    local = context.node_config.get("model")
    device = RUNTIME.device(task_id, spec_json, str(local) if local else None,
                            node_personal(context, personal), features,
                            str(context.node_config.get("torch-device", torch_device)))
    store.task_json, device.store = spec_json, store  # this node's state, in this process
    loaded = None
    if catch_up.snapshot is not None:
        loaded = device.load_snapshot(catch_up.snapshot, catch_up.snapshot_version,
                                      catch_up.snapshot_checksum, catch_up.snapshot_format)
    else:
        device.resume()
    result = device.sync(target, entries=[e.to_entry() for e in catch_up.entries])
    return device, result if loaded is None or result.method != "none" else loaded


def train(message: Message, context: Context, data: DeviceData,
          personal: PersonalConfig | None = None,
          features: FeatureStore | None = None, torch_device: str = "cpu") -> Message:
    ins = TrainIns.from_record(message.content)
    device, _ = sync_device(ins.task_id, ins.catch_up, context, ins.plan.version, personal,
                            features, torch_device)
    mine = data.with_node_config(context.node_config)
    train_set, _ = RUNTIME.examples(mine)
    trained = device.train(ins.plan, train_set, mine)
    return Message(reply_content(trained.scalars, trained.num_examples, trained.loss),
                   reply_to=message)


def reply_content(scalars: np.ndarray, num_examples: int, loss: float) -> RecordDict:
    """A device's whole TRAIN reply (`shared.records.TrainRes`)."""
    return TrainRes(scalars, num_examples, loss).to_record()


def evaluate(message: Message, context: Context, data: DeviceData,
             personal: PersonalConfig | None = None,
             features: FeatureStore | None = None, torch_device: str = "cpu") -> Message:
    """The sync phase: catch up to the new version, verify it, score the local held-out set
    (with a personal part: shared alone, shared + personal, local-only; as metrics)."""
    ins = SyncIns.from_record(message.content)
    device, result = sync_device(ins.task_id, ins.catch_up, context, ins.version, personal,
                                 features, torch_device)
    if result.checksum != ins.checksum:
        raise DeviceStateError(f"device reached v{result.version} with checksum "
                               f"{result.checksum[:16]}..., coordinator has "
                               f"{ins.checksum[:16]}...")
    _, local_eval = RUNTIME.examples(data.with_node_config(context.node_config))
    if not len(local_eval):  # a small device of a large fleet holds no held-out example:
        # it reports where it stands, no accuracy (a 0 would read as a device scoring 0)
        return Message(SyncRes(result.version, result.checksum).to_record(), reply_to=message)
    acc, loss = device.evaluate(local_eval)
    scores = device.evaluate_personal(local_eval)
    reply = SyncRes(result.version, result.checksum, acc, loss, len(local_eval),
                    personal_accuracy=None if scores is None else scores.personal,
                    local_only_accuracy=None if scores is None else scores.local)
    return Message(reply.to_record(), reply_to=message)


def make_client_app(data: DeviceData | None = None,
                    personal: PersonalConfig | None = None,
                    features: FeatureStore | None = None,
                    torch_device: str = "cpu") -> ClientApp:
    """A ClientApp whose devices read their data per `data`, keep the personal part
    `personal` (None: none) and run the torch backend on `torch_device` (auto, cpu, cuda,
    cuda:N), each overridden by node_config (`torch-device` for the last). `features`: a
    feature store its processes share (a simulation's run directory: one encoding per run;
    it must pickle, it travels to the Ray actors with the app); None, every real device:
    none."""
    BackendConfig(torch_device=torch_device)  # refuse a bad name here, not in every actor
    defaults = data or DeviceData()
    app = ClientApp()

    @app.train()
    def _train(message: Message, context: Context) -> Message:
        return train(message, context, defaults, personal, features, torch_device)

    @app.evaluate()
    def _evaluate(message: Message, context: Context) -> Message:
        return evaluate(message, context, defaults, personal, features, torch_device)

    return app


#: The ClientApp a SuperNode loads (`seedfed.client.flower_app:app`); data from node_config.
app = make_client_app()
