"""`seedfed device --backend ort`: the ORT device over the coordinator's REST API, no torch.

The same protocol as `client.http_device` (enroll with the join token, fetch the task
definition, follow the coordinator's catch-up plan, train the open round, upload the scalars in
the binary form), with the same state directory layout: `device.json` (id, token, version,
checksum, the bundle's path; mode 0600), `state.safetensors` (the trainable state, flat float32)
and `task.json` (the task definition; `seedfed evaluate --device` scores offline), and the same
checks before it enrolls (`prepare`, `client.preflight`): coordinator, token, data against
the task, and the bundle loaded and matched to the task.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from safetensors import SafetensorError
from seedfed.client import data as data_mod
from seedfed.client import preflight
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.endpoint import check_endpoint, poll_rounds
from seedfed.client.ort.device import OrtDevice, OrtSync
from seedfed.client.ort.runtime import OrtModel
from seedfed.shared.protocol.coordinator_client import CoordinatorClient, CoordinatorHttpError
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

log = logging.getLogger(__name__)

STATE_FILE = "state.safetensors"
META_FILE = "device.json"
#: The task definition the device serves (as `client.http_device` keeps it).
TASK_FILE = "task.json"
#: `backend` in device.json, with `bundle` (the ORT bundle's path): how `seedfed evaluate
#: --device` tells an ORT device's directory from a torch device's.
BACKEND = "ort"


@dataclass(frozen=True)
class OrtDeviceConfig:
    url: str
    task_id: str
    state_dir: Path
    bundle: Path  # the task's ORT bundle (`seedfed ort-export`)
    join_token: str | None = None
    data: DeviceData = field(default_factory=DeviceData)
    poll_s: float = 2.0
    timeout_s: float = 60.0
    bandwidth: float = 2e6  # bytes/s, tells the coordinator's catch-up plan what is cheap
    threads: int | None = None  # ONNX Runtime intra-op threads (None: its default)

    def __post_init__(self) -> None:
        check_endpoint(self.url, self.task_id, poll_s=self.poll_s, timeout_s=self.timeout_s,
                       bandwidth=self.bandwidth)


@dataclass
class OrtRoundOutcome:
    round: int
    version: int
    sync: str
    loss: float
    num_examples: int
    upload_bytes: int


class OrtHttpDevice:
    """One ORT device of one task, talking to the coordinator's REST API."""

    def __init__(self, config: OrtDeviceConfig, client: httpx.Client | None = None) -> None:
        self.config = config
        self.http = client or httpx.Client(base_url=config.url, timeout=config.timeout_s)
        self.meta: dict[str, Any] = self._read_meta()
        self.device: OrtDevice | None = None
        #: The data bound to the task's labels (`prepare`); the configured data until then.
        self.data: DeviceData = config.data
        self._prepared = False
        self._examples: data_mod.Examples | None = None

    # -- state directory -----------------------------------------------------------------------
    def _read_meta(self) -> dict[str, Any]:
        path = self.config.state_dir / META_FILE
        if not path.is_file():
            return {}
        try:
            meta = dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise preflight.DeviceSetupError(f"{path} is unreadable ({e})",
                                             "move it away or use another --state-dir") from e
        if meta.get("task_id") != self.config.task_id:
            raise ValueError(f"{self.config.state_dir} belongs to task {meta.get('task_id')!r}, "
                             f"not {self.config.task_id!r}; use another --state-dir")
        return meta

    def _write_meta(self) -> None:
        # made on the first write: a device that fails its checks leaves nothing behind
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.config.state_dir / META_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the token
        with os.fdopen(fd, "w") as f:
            json.dump({**self.meta, "task_id": self.config.task_id}, f)
        os.replace(tmp, path)

    def _save(self) -> None:
        device = self.load_device()
        if device.version is None:
            return
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.config.state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(device.state_bytes())
        os.replace(tmp, path)
        # the task and the bundle beside the state: `seedfed evaluate --device` scores it offline
        task = self.config.state_dir / TASK_FILE
        if not task.is_file():
            task.with_suffix(".tmp").write_text(json.dumps(device.spec.to_dict()))
            os.replace(task.with_suffix(".tmp"), task)
        self.meta.update(version=device.version, checksum=device.checksum, backend=BACKEND,
                         bundle=str(self.config.bundle.resolve()))
        self._write_meta()

    @property
    def api(self) -> CoordinatorClient:
        if "token" not in self.meta:
            raise SeedfedError("device is not enrolled; enroll with the task's join token")
        return CoordinatorClient(self.http, str(self.meta["token"]))

    # -- lifecycle -----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check, before taking part, the data file, the coordinator and this device's token,
        the data against the task's labels and the bundle against the task (loaded here).
        Raises DeviceSetupError or DataFormatError, having enrolled nothing."""
        if self._prepared:
            return
        preflight.check_data_file(self.config.data)
        spec = TaskSpec.from_dict(preflight.read_task(
            self.http, self.config.task_id, device_token=self.meta.get("token"),
            join_token=self.config.join_token))
        self.data, split = preflight.task_examples(self.config.data, spec)
        self._examples = split[0]
        if self.device is None:
            self._build_device(spec)
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
        self._write_meta()
        return device_id

    def load_device(self) -> OrtDevice:
        """The task's device on the bundle, with the stored state when it verifies."""
        if self.device is None:
            self._build_device(TaskSpec.from_dict(self.api.spec(self.config.task_id)))
        assert self.device is not None
        return self.device

    def _build_device(self, spec: TaskSpec) -> None:
        try:
            device = OrtDevice(spec, self.config.task_id,
                               OrtModel(self.config.bundle, threads=self.config.threads))
        except (SeedfedError, OSError, ValueError, KeyError, RuntimeError) as e:
            # onnxruntime's own load errors are RuntimeError subclasses
            raise preflight.model_error(
                e, str(self.config.bundle), option="--model", hint="export this task's bundle "
                "with `seedfed ort-export --task SPEC.json --out DIR` and give DIR as "
                "--model") from e
        stored = self.config.state_dir / STATE_FILE
        if self.meta.get("version") is not None and stored.is_file():
            try:
                device.load_snapshot(stored.read_bytes(), int(self.meta["version"]),
                                     str(self.meta["checksum"]))
            except (SeedfedError, SafetensorError, OSError) as e:
                log.warning("stored state is unusable (%s); will download a snapshot", e)
        self.device = device

    def sync(self, target: int | None = None) -> OrtSync:
        """Catch up to `target` (default: the task's current version), verified."""
        device, api, task = self.load_device(), self.api, self.config.task_id
        target = api.status(task).version if target is None else target
        if device.version == target:
            return OrtSync(target, device.checksum, "none")
        entries: list[LogEntry] = []
        if device.version is not None and device.version < target:
            plan = api.catchup(task, device.version, self.config.bandwidth)
            if plan.action == "replay":
                entries = [e.to_entry() for e in api.log_since(task, device.version)]
        result = device.sync(target, entries=entries, fetch=lambda: api.snapshot(task, target))
        self._save()
        return result

    def examples(self) -> data_mod.Examples:
        if self._examples is None:
            self._examples = load_device_examples(self.data)[0]
        return self._examples

    def train_and_upload(self, plan: RoundPlan) -> OrtRoundOutcome:
        """Catch up to the plan's version, run its steps, upload the scalars (binary form)."""
        sync = self.sync(plan.version)
        trained = self.load_device().train(plan, self.examples(), self.data)
        sent = self.api.upload(plan.task_id, plan.round, plan.version, trained.scalars,
                               trained.num_examples, trained.loss)
        self.meta["last_round"] = plan.round
        self._write_meta()
        return OrtRoundOutcome(plan.round, plan.version, sync.method, trained.loss,
                               trained.num_examples, sent)

    def run(self, rounds: int | None = None) -> list[OrtRoundOutcome]:
        """Take part in `rounds` rounds (None: until stopped), polling for open rounds. A
        refusal of the device's token (revoked meanwhile) raises DeviceSetupError."""
        self.prepare()
        self.enroll()
        try:
            return poll_rounds(current_plan=lambda: self.api.current_plan(self.config.task_id),
                               meta=self.meta, train=self.train_and_upload,
                               poll_s=self.config.poll_s, rounds=rounds)
        except CoordinatorHttpError as e:
            if e.status in (401, 403, 404):
                raise preflight.refusal(e, join=False) from None
            raise
