"""A device without Flower: the coordinator's REST API over plain HTTP(S).

    enroll (join token -> device token) -> fetch the task definition -> catch up (the
    coordinator's catch-up plan: replay the log or download a snapshot, checksum verified) ->
    train the open round's plan on local data -> upload the scalars (binary form) -> repeat.

The device keeps what it must survive a restart in its state directory: its id and token
(file mode 0600), the version and checksum it stands at and its trainable state (safetensors).
It runs its own copy of the base model (`model`), so the coordinator's `model_path` never has to
exist on the device.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from seedfed.client import data as data_mod
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.sync import SyncResult, catch_up, load_state, state_bytes
from seedfed.client.trainer import LocalTrainer, classification_loss
from seedfed.shared.errors import ChecksumMismatchError, LogEntryMismatchError, SeedfedError
from seedfed.shared.models import ModelBundle, build_model
from seedfed.shared.replay import checksum
from seedfed.shared.task import TaskSpec
from seedfed.shared.wire import LogEntryWire, RoundPlan, pack_binary

log = logging.getLogger(__name__)


class DeviceHttpError(SeedfedError, RuntimeError):
    """The coordinator refused a request; carries its status and the reason it gave."""

    def __init__(self, status: int, method: str, path: str, detail: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class DeviceConfig:
    url: str
    task_id: str
    state_dir: Path
    join_token: str | None = None
    model: str | None = None  # local base model directory; None: the task's model_path
    data: DeviceData = field(default_factory=DeviceData)
    poll_s: float = 2.0
    timeout_s: float = 60.0
    bandwidth: float = 2e6  # bytes/s, tells the coordinator's catch-up plan what is cheap

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator URL must start with http:// or https://, got "
                             f"{self.url!r}")
        if not self.task_id:
            raise ValueError("task_id must not be empty")
        for name in ("poll_s", "timeout_s", "bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class RoundOutcome:
    round: int
    version: int
    sync: str
    loss: float
    num_examples: int
    upload_bytes: int


class HttpDevice:
    """One device of one task, talking to the coordinator's REST API."""

    def __init__(self, config: DeviceConfig, client: httpx.Client | None = None) -> None:
        self.config = config
        self.http = client or httpx.Client(base_url=config.url, timeout=config.timeout_s)
        self.state_dir = config.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.meta: dict[str, Any] = self._read_meta()
        self.bundle: ModelBundle | None = None
        self.trainer: LocalTrainer | None = None
        self._examples: data_mod.Examples | None = None

    # -- HTTP ----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, auth: bool = True, **kwargs: Any,
                 ) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if auth:
            headers["Authorization"] = f"Bearer {self.token}"
        resp = self.http.request(method, path, headers=headers, **kwargs)
        if resp.status_code >= 400:
            try:
                detail = str(resp.json().get("detail", resp.text))
            except (ValueError, AttributeError):
                detail = resp.text
            raise DeviceHttpError(resp.status_code, method, path, detail)
        return resp

    @property
    def _task(self) -> str:
        return f"/v1/tasks/{self.config.task_id}"

    # -- persistent device state ----------------------------------------------------------------
    def _meta_path(self) -> Path:
        return self.state_dir / "device.json"

    def _read_meta(self) -> dict[str, Any]:
        path = self._meta_path()
        if not path.is_file():
            return {}
        meta = json.loads(path.read_text())
        if meta.get("task_id") != self.config.task_id:
            raise ValueError(f"{self.state_dir} belongs to task {meta.get('task_id')!r}, not "
                             f"{self.config.task_id!r}; use another --state-dir")
        return dict(meta)

    def _write_meta(self) -> None:
        path = self._meta_path()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the token
        with os.fdopen(fd, "w") as f:
            json.dump({**self.meta, "task_id": self.config.task_id}, f)
        os.replace(tmp, path)

    @property
    def token(self) -> str:
        if "token" not in self.meta:
            raise SeedfedError("device is not enrolled; enroll with the task's join token")
        return str(self.meta["token"])

    @property
    def version(self) -> int | None:
        v = self.meta.get("version")
        return None if v is None else int(v)

    # -- lifecycle -----------------------------------------------------------------------------
    def enroll(self) -> str:
        """Enroll once with the join token; later runs reuse the stored device token."""
        if "token" in self.meta:
            return str(self.meta["device_id"])
        if not self.config.join_token:
            raise SeedfedError("this device has no token yet: pass the task's join token")
        body = self._request("POST", f"{self._task}/devices", auth=False,
                             json={"join_token": self.config.join_token}).json()
        self.meta.update(device_id=body["device_id"], token=body["token"])
        self._write_meta()
        return str(body["device_id"])

    def load_model(self) -> ModelBundle:
        """The task's model on this device's own copy of the base weights."""
        if self.bundle is None:
            spec = TaskSpec.from_dict(self._request("GET", f"{self._task}/spec").json())
            if self.config.model:
                spec = replace(spec, model_path=self.config.model)
            if spec.model_kind != "seq_cls":
                raise SeedfedError(f"the HTTP device trains seq_cls tasks, not "
                                   f"{spec.model_kind}")
            self.bundle = build_model(spec, initialize=False)
            self.trainer = LocalTrainer(self.bundle.model, self.bundle.scope, classification_loss)
            state = self.state_dir / "state.safetensors"
            if self.version is not None and state.is_file():
                try:
                    load_state(self.bundle.scope, state.read_bytes(), self.meta["checksum"])
                except (SeedfedError, OSError) as e:
                    log.warning("stored state unusable (%s); will download a snapshot", e)
                    self.meta.pop("version", None)
        return self.bundle

    def sync(self, target: int | None = None) -> SyncResult:
        """Catch up to `target` (default: the task's current version), verified."""
        bundle = self.load_model()
        status = self._request("GET", self._task).json()
        target = int(status["version"]) if target is None else target
        result: SyncResult | None = None
        if self.version == target:
            return SyncResult(target, str(self.meta["checksum"]), "none")
        if self.version is not None and self.version < target:
            plan = self._request("GET", f"{self._task}/catchup",
                                 params={"from": self.version,
                                         "bandwidth": self.config.bandwidth}).json()
            if plan["action"] == "replay":
                entries = [LogEntryWire.model_validate(e).to_entry() for e in self._request(
                    "GET", f"{self._task}/log", params={"since": self.version}).json()]
                try:
                    result = catch_up(bundle.scope, task_id=self.config.task_id,
                                      version=self.version, entries=entries, target=target)
                except (ChecksumMismatchError, LogEntryMismatchError) as e:
                    log.warning("replay failed (%s); downloading a snapshot", e)
        if result is None:
            resp = self._request("GET", f"{self._task}/snapshots/{target}")
            chk = load_state(bundle.scope, resp.content, resp.headers["X-Seedfed-Checksum"])
            result = SyncResult(target, chk, "snapshot")
        if result.method != "none":
            (self.state_dir / "state.safetensors").write_bytes(state_bytes(bundle.scope))
        self.meta.update(version=result.version, checksum=result.checksum)
        self._write_meta()
        return result

    def examples(self) -> data_mod.Examples:
        if self._examples is None:
            self._examples = load_device_examples(self.config.data)[0]
        return self._examples

    def current_plan(self) -> RoundPlan | None:
        try:
            return RoundPlan.model_validate(
                self._request("GET", f"{self._task}/rounds/current").json())
        except DeviceHttpError as e:
            if e.status == 404:
                return None
            raise

    def train_and_upload(self, plan: RoundPlan) -> RoundOutcome:
        """Catch up to the plan's version, run its steps, upload the scalars (binary form)."""
        sync = self.sync(plan.version)
        bundle, trainer = self.bundle, self.trainer
        assert bundle is not None and trainer is not None
        cfg = self.config.data
        rng = np.random.default_rng([cfg.seed, cfg.partition_id, plan.round])
        batches = data_mod.train_batches(self.examples(), bundle.tokenizer, plan.batch_size,
                                         bundle.spec.max_seq_len, rng)
        result = trainer.run(plan, batches)
        weight = len(self.examples())  # local training set size (see flower_app.train)
        if checksum(bundle.scope) != sync.checksum:
            raise SeedfedError(f"local steps did not restore v{plan.version} exactly")
        body = pack_binary(result.scalars)
        self._request("POST", f"{self._task}/rounds/{plan.round}/uploads", content=body,
                      headers={"Content-Type": "application/octet-stream",
                               "X-Seedfed-Version": str(plan.version),
                               "X-Seedfed-Num-Examples": str(weight),
                               "X-Seedfed-Loss": repr(float(result.loss))})
        self.meta["last_round"] = plan.round
        self._write_meta()
        return RoundOutcome(plan.round, plan.version, sync.method, result.loss, weight,
                            len(body))

    def run(self, rounds: int | None = None, deadline_s: float | None = None,
            ) -> list[RoundOutcome]:
        """Take part in `rounds` rounds (None: until stopped), polling for open rounds."""
        self.enroll()
        done: list[RoundOutcome] = []
        stop = None if deadline_s is None else time.monotonic() + deadline_s
        while rounds is None or len(done) < rounds:
            if stop is not None and time.monotonic() > stop:
                break
            plan = self.current_plan()
            if plan is None or plan.round <= int(self.meta.get("last_round", 0)):
                time.sleep(self.config.poll_s)
                continue
            try:
                done.append(self.train_and_upload(plan))
            except DeviceHttpError as e:
                if e.status != 409:  # 409: the round closed or moved on meanwhile
                    raise
                log.info("round %d: %s", plan.round, e.detail)
                self.meta["last_round"] = plan.round
        return done
