"""A device without Flower: the coordinator's REST API over plain HTTP(S).

    enroll (join token -> device token) -> fetch the task definition -> catch up (the
    coordinator's catch-up plan: replay the log or download a snapshot, checksum verified) ->
    train the open round's plan on local data -> upload the scalars (binary form) -> repeat.

The device keeps what it must survive a restart in its state directory: its id and token
(file mode 0600), the version and checksum it stands at and its trainable state (safetensors).
It runs its own copy of the base model (`model`), so the coordinator's `model_path` never has to
exist on the device.

The device itself (catch-up, training, scoring) is `client.device.Device` over the configured
backend (`DeviceConfig.backend`: torch, or ort with `model` the task's ORT bundle and no
torch imported); this module is its REST transport and its state directory
(`DirectoryStore`). Before it enrolls (or, enrolled, before it polls) a device checks the
coordinator, its token, its data against the task and its model (`prepare`,
`client.preflight`): a device that cannot train never enrolls.

A ternary task (scope "ternary") holds its model packed (`client.ternary.PackedTernary`) and
downloads the published ternary snapshot (`?format=ternary`), never the fp32 master: at join
time and at every mask epoch start, replaying the log inside an epoch. Its state directory
also keeps the last snapshot it loaded (`ternary.safetensors`, with its version and checksum
in device.json): with the masked latents in `state.safetensors` that rebuilds the packed
model on a restart without a download, as long as the task is still in the same mask epoch.

With a personal part (`DeviceConfig.personal`, `seedfed device --personal`; client.personal)
the directory also keeps `personal.safetensors`, the device's own head: trained after each
round's upload is computed, never uploaded. Deleting the file (or `seedfed device
--reset-personal`) resets it; the shared state is not touched either way. After each round
such a device scores its held-out examples (shared model alone, shared + personal, local
only) and sends the three numbers for the round (`POST .../rounds/{n}/metrics`), never an
example.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from seedfed.client import data as data_mod
from seedfed.client import preflight
from seedfed.client.backends.base import (
    FP32,
    BackendConfig,
    DeviceStateError,
    StoredState,
    SyncResult,
)
from seedfed.client.backends.select import open_backend
from seedfed.client.catchup import CatchupMeters, sync_by_cost
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.endpoint import check_endpoint, poll_rounds
from seedfed.shared.protocol.coordinator_client import CoordinatorClient, CoordinatorHttpError
from seedfed.shared.protocol.errors import SeedfedError, UserError
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import DeviceMetrics, RoundPlan

if TYPE_CHECKING:  # the personal part is the torch backend's (client.personal loads torch)
    from seedfed.client.personal import PersonalConfig

log = logging.getLogger(__name__)

#: State-directory file of a ternary device: the published snapshot its packed model came from.
TERNARY_SNAPSHOT_FILE = "ternary.safetensors"
STATE_FILE = "state.safetensors"
#: State-directory file of the device's personal part (never uploaded).
PERSONAL_FILE = "personal.safetensors"
#: State-directory copy of the task definition (lets `seedfed evaluate --device` run offline).
TASK_FILE = "task.json"
META_FILE = "device.json"

#: The coordinator refused a request (`.status`, `.detail`): the shared client's error.
DeviceHttpError = CoordinatorHttpError


@dataclass(frozen=True)
class DeviceConfig:
    """A REST device: where the coordinator is, which task, where its state lives, its data,
    and the backend that runs its model."""

    url: str = field(metadata={"help": "the coordinator's base URL (http:// or https://)"})
    task_id: str = field(metadata={"help": "the task this device takes part in"})
    state_dir: Path = field(metadata={"help": "where the device keeps its token and state"})
    join_token: str | None = field(default=None, metadata={
        "help": "the task's join token (first run only: the device keeps its own token)"})
    model: str | None = field(default=None, metadata={
        "help": "torch: local base model directory (None: the task's model_path); "
                "ort: the task's ORT bundle (`seedfed ort-export`), required"})
    data: DeviceData = field(default_factory=DeviceData, metadata={
        "help": "the device's private examples and its share of them"})
    poll_s: float = field(default=2.0, metadata={"help": "seconds between polls for a round"})
    timeout_s: float = field(default=60.0, metadata={"help": "HTTP timeout in seconds"})
    bandwidth: float = field(default=2e6, metadata={
        "help": "bytes/s assumed until the device has measured its own link"})
    personal: PersonalConfig | None = field(default=None, metadata={
        "help": "the device's personal part (torch backend; None: none)"})
    backend: str = field(default="torch", metadata={"help": BackendConfig.help()["kind"]})
    torch_device: str = field(default="cpu", metadata={
        "help": BackendConfig.help()["torch_device"]})
    threads: int | None = field(default=None, metadata={"help": BackendConfig.help()["threads"]})

    def __post_init__(self) -> None:
        check_endpoint(self.url, self.task_id, poll_s=self.poll_s, timeout_s=self.timeout_s,
                       bandwidth=self.bandwidth)
        self.backend_config()  # validates backend, model, torch_device, threads

    def backend_config(self) -> BackendConfig:
        return BackendConfig(kind=self.backend, model=self.model,
                             torch_device=self.torch_device, threads=self.threads)

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each field's help text."""
        return {f.name: str(f.metadata.get("help", "")) for f in fields(cls)}


@dataclass
class RoundOutcome:
    round: int
    version: int
    sync: str
    loss: float
    num_examples: int
    upload_bytes: int  # the upload's body on the wire
    metrics: DeviceMetrics | None = None  # the held-out scores it reported for the round


class DirectoryStore:
    """The device's state directory: `device.json` (id, token, version, checksum, the ternary
    snapshot's version and checksum; mode 0600, it holds the token), the trainable state and
    a ternary task's snapshot. Files are replaced atomically."""

    def __init__(self, path: Path, task_id: str) -> None:
        # made on the first write: a device that fails its checks leaves nothing behind
        self.path, self.task_id = path, task_id
        self.meta: dict[str, Any] = self._read_meta()

    def _read_meta(self) -> dict[str, Any]:
        path = self.path / META_FILE
        if not path.is_file():
            return {}
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise preflight.DeviceSetupError(f"{path} is unreadable ({e})",
                                             "move it away or use another --state-dir") from e
        if not isinstance(meta, dict) or meta.get("task_id") != self.task_id:
            raise ValueError(f"{self.path} belongs to task {meta.get('task_id')!r}, not "
                             f"{self.task_id!r}; use another --state-dir")
        return dict(meta)

    @staticmethod
    def read_task_id(path: Path) -> str:
        """The task a state directory belongs to (from its device.json)."""
        meta = json.loads((path / META_FILE).read_text())
        if not isinstance(meta, dict) or not meta.get("task_id"):
            raise ValueError(f"{path / META_FILE} names no task")
        return str(meta["task_id"])

    def write_meta(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.path / META_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the token
        with os.fdopen(fd, "w") as f:
            json.dump({**self.meta, "task_id": self.task_id}, f)
        os.replace(tmp, path)

    def _read(self, name: str) -> bytes | None:
        path = self.path / name
        return path.read_bytes() if path.is_file() else None

    def load(self) -> StoredState | None:
        m = self.meta
        if m.get("version") is None:
            return None
        has_snapshot = m.get("snapshot_version") is not None
        return StoredState(self.task_id, int(m["version"]), str(m["checksum"]),
                           self._read(STATE_FILE),
                           self._read(TERNARY_SNAPSHOT_FILE) if has_snapshot else None,
                           int(m["snapshot_version"]) if has_snapshot else None,
                           str(m.get("snapshot_checksum", "")), self._read(PERSONAL_FILE))

    def save(self, state: StoredState) -> None:
        if state.state is not None:
            _write_atomic(self.path / STATE_FILE, state.state)
        if state.personal is not None:  # None: a device without a personal part keeps it
            _write_atomic(self.path / PERSONAL_FILE, state.personal)
        known = (self.meta.get("snapshot_version"), self.meta.get("snapshot_checksum"))
        if state.snapshot is not None and known != (state.snapshot_version,
                                                    state.snapshot_checksum):
            _write_atomic(self.path / TERNARY_SNAPSHOT_FILE, state.snapshot)
            self.meta.update(snapshot_version=state.snapshot_version,
                             snapshot_checksum=state.snapshot_checksum)
        self.meta.update(version=state.version, checksum=state.checksum)
        self.write_meta()


class HttpDevice:
    """One device of one task, talking to the coordinator's REST API."""

    def __init__(self, config: DeviceConfig, client: httpx.Client | None = None) -> None:
        self.config = config
        self.http = client or httpx.Client(base_url=config.url, timeout=config.timeout_s)
        self.state_dir = config.state_dir
        self.store = DirectoryStore(config.state_dir, config.task_id)
        self.device: Device | None = None  # built by `prepare` or on the first sync
        #: The data bound to the task's labels (`prepare`); the configured data until then.
        self.data: DeviceData = config.data
        self._prepared = False
        self._split: tuple[data_mod.Examples, data_mod.Examples] | None = None
        #: The device's own link, replay and load rates: they choose replay or snapshot.
        self.meters = CatchupMeters(config.bandwidth)

    @property
    def meta(self) -> dict[str, Any]:
        return self.store.meta

    @property
    def api(self) -> CoordinatorClient:
        """The coordinator, as this enrolled device."""
        if "token" not in self.meta:
            raise SeedfedError("device is not enrolled; enroll with the task's join token")
        return CoordinatorClient(self.http, str(self.meta["token"]))

    @property
    def version(self) -> int | None:
        if self.device is not None:
            return self.device.version
        v = self.meta.get("version")
        return None if v is None else int(v)

    # -- lifecycle -----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check, before taking part, what a round needs: the data file, the coordinator and
        this device's token (its join token before it enrolls), the data against the task's
        labels, the model (loaded here). Raises DeviceSetupError or DataFormatError, having
        enrolled nothing (`client.preflight`)."""
        if self._prepared:
            return
        preflight.check_data_file(self.config.data)
        raw = preflight.read_task(self.http, self.config.task_id,
                                  device_token=self.meta.get("token"),
                                  join_token=self.config.join_token)
        self.data, self._split = preflight.task_examples(self.config.data,
                                                         TaskSpec.from_dict(raw))
        if self.device is None:
            self._build_device(raw)
        self._prepared = True

    def enroll(self) -> str:
        """Enroll once with the join token, after `prepare`; later runs reuse the stored
        device token."""
        if "token" in self.meta:
            return str(self.meta["device_id"])
        if not self.config.join_token:
            raise SeedfedError("this device has no token yet: pass the task's join token")
        self.prepare()
        device_id, token = CoordinatorClient(self.http).enroll(self.config.task_id,
                                                               self.config.join_token)
        self.meta.update(device_id=device_id, token=token)
        self.store.write_meta()
        return device_id

    def load_device(self) -> Device:
        """The task's model on this device's own copy of the base weights, with the state of
        the state directory when it verifies (else the next sync downloads a snapshot)."""
        if self.device is None:
            self._build_device(self.api.spec(self.config.task_id))
        assert self.device is not None
        return self.device

    def _build_device(self, raw: dict[str, Any]) -> None:
        spec = TaskSpec.from_dict(raw)
        config = self.config.backend_config()
        try:
            backend = open_backend(spec, config)
        except UserError:
            raise
        except (SeedfedError, OSError, ValueError, KeyError, RuntimeError, ImportError) as e:
            # onnxruntime's own load errors are RuntimeError subclasses
            raise self._model_error(e, spec) from e
        _write_atomic(self.state_dir / TASK_FILE, json.dumps(raw).encode())
        self.meta.update(backend=config.kind)
        if config.kind == "ort":  # `seedfed evaluate --device` scores on the same bundle
            self.meta.update(bundle=str(Path(str(config.model)).resolve()))
        self.device = Device(spec, self.config.task_id, self.store,
                             personal=self.config.personal, backend=backend)
        try:
            self.device.resume()
        except DeviceStateError as e:
            log.warning("%s; will download a snapshot", e)

    def _model_error(self, e: BaseException, spec: TaskSpec) -> preflight.DeviceSetupError:
        if self.config.backend == "ort":
            return preflight.model_error(
                e, str(self.config.model), option="--model", hint="export this task's bundle "
                "with `seedfed ort-export --task SPEC.json --out DIR` and give DIR as --model")
        return preflight.model_error(
            e, self.config.model or spec.model_path, option="--model" if self.config.model
            else "the task's model_path", hint="give --model this device's copy of the "
            "task's base model (a Hugging Face directory: config.json, tokenizer, weights)")

    def sync(self, target: int | None = None) -> SyncResult:
        """Catch up to `target` (default: the task's current version), verified: the log or
        the snapshot of `target` in the device's format, whichever this device's own measured
        rates make cheaper (`client.catchup.sync_by_cost`; a download across a mask epoch
        start whatever they are)."""
        device, api, task = self.load_device(), self.api, self.config.task_id
        target = api.status(task).version if target is None else target
        if device.version == target:
            return SyncResult(target, device.checksum, "none")
        fmt = None if device.snapshot_format == FP32 else device.snapshot_format
        return sync_by_cost(device, api, task, target, fmt, self.meters)

    def _examples(self) -> tuple[data_mod.Examples, data_mod.Examples]:
        if self._split is None:
            self._split = load_device_examples(self.data)
        return self._split

    def examples(self) -> data_mod.Examples:
        """The device's training examples."""
        return self._examples()[0]

    def held_out(self) -> data_mod.Examples:
        """The device's local held-out examples (scored, never trained on)."""
        return self._examples()[1]

    def current_plan(self) -> RoundPlan | None:
        return self.api.current_plan(self.config.task_id)

    def train_and_upload(self, plan: RoundPlan) -> RoundOutcome:
        """Catch up to the plan's version, run its steps, upload the scalars (binary form)."""
        sync = self.sync(plan.version)
        trained = self.load_device().train(plan, self.examples(), self.data)
        sent = self.api.upload(plan.task_id, plan.round, plan.version, trained.scalars,
                               trained.num_examples, trained.loss)
        self.meta["last_round"] = plan.round
        self.store.write_meta()
        return RoundOutcome(plan.round, plan.version, sync.method, trained.loss,
                            trained.num_examples, sent, self.report_metrics(plan))

    def report_metrics(self, plan: RoundPlan) -> DeviceMetrics | None:
        """Score the held-out examples after the round (the shared model of the plan's version
        alone, with the personal part the round trained, the local-only head) and send the
        numbers for the round. None without a personal part or held-out examples, or when the
        coordinator refused them: the scores are the operator's view of the fleet, not part
        of the round, so a refusal is logged and the device goes on."""
        scores = self.load_device().evaluate_personal(self.held_out())
        if scores is None:
            return None
        metrics = DeviceMetrics(version=plan.version, num_examples=scores.examples,
                                shared_accuracy=scores.shared,
                                personal_accuracy=scores.personal, local_accuracy=scores.local)
        try:
            self.api.report_metrics(plan.task_id, plan.round, metrics)
        except CoordinatorHttpError as e:
            log.warning("round %d: metrics refused: %s", plan.round, e.detail)
            return None
        return metrics

    def run(self, rounds: int | None = None, deadline_s: float | None = None,
            ) -> list[RoundOutcome]:
        """Take part in `rounds` rounds (None: until stopped), polling for open rounds. A
        refusal of the device's token (revoked meanwhile) raises DeviceSetupError."""
        self.prepare()
        self.enroll()
        try:
            return poll_rounds(current_plan=self.current_plan, meta=self.meta,
                               train=self.train_and_upload, poll_s=self.config.poll_s,
                               rounds=rounds, deadline_s=deadline_s)
        except CoordinatorHttpError as e:
            if e.status in (401, 403, 404):
                raise preflight.refusal(e, join=False) from None
            raise


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
