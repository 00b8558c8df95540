"""A device without Flower: the coordinator's REST API over plain HTTP(S).

    enroll (join token -> device token) -> fetch the task definition -> catch up (the
    coordinator's catch-up plan: replay the log or download a snapshot, checksum verified) ->
    train the open round's plan on local data -> upload the scalars (binary form) -> repeat.

The device keeps what it must survive a restart in its state directory: its id and token
(file mode 0600), the version and checksum it stands at and its trainable state (safetensors).
It runs its own copy of the base model (`model`), so the coordinator's `model_path` never has to
exist on the device.

A ternary task (scope "ternary") holds its model packed (`client.ternary.PackedTernary`) and
downloads the published ternary snapshot (`?format=ternary`), never the fp32 master: at join
time and at every mask epoch start, replaying the log inside an epoch. Its state directory
also keeps the last snapshot it loaded (`ternary.safetensors`, with its version and checksum
in device.json): with the masked latents in `state.safetensors` that rebuilds the packed
model on a restart without a download, as long as the task is still in the same mask epoch.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from seedfed.client import data as data_mod
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.sync import SyncResult, catch_up, load_state, state_bytes
from seedfed.client.ternary import SNAPSHOT_FORMAT, PackedTernary, is_ternary
from seedfed.client.trainer import LocalTrainer, classification_loss
from seedfed.shared.errors import ChecksumMismatchError, LogEntryMismatchError, SeedfedError
from seedfed.shared.models import ModelBundle, build_model
from seedfed.shared.replay import LogEntry, checksum
from seedfed.shared.task import TaskSpec
from seedfed.shared.wire import LogEntryWire, RoundPlan, pack_binary

log = logging.getLogger(__name__)

#: State-directory file of a ternary device: the published snapshot its packed model came from.
TERNARY_SNAPSHOT_FILE = "ternary.safetensors"
STATE_FILE = "state.safetensors"


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
        self.ternary: PackedTernary | None = None  # set instead of bundle/trainer (ternary)
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

    def _spec(self) -> TaskSpec:
        spec = TaskSpec.from_dict(self._request("GET", f"{self._task}/spec").json())
        return replace(spec, model_path=self.config.model) if self.config.model else spec

    def _ensure_model(self) -> None:
        """Build the task's model once: a ternary task's packed model (restored from the state
        directory when it can be), or the bundle of any other task."""
        if self.bundle is not None or self.ternary is not None:
            return
        spec = self._spec()
        if is_ternary(spec):
            self.ternary = PackedTernary(spec)
            self._restore_ternary()
        else:
            self.load_model(spec)

    def load_model(self, spec: TaskSpec | None = None) -> ModelBundle:
        """The task's model on this device's own copy of the base weights (not for ternary
        tasks: their packed model is `self.ternary`)."""
        if self.bundle is None:
            spec = spec or self._spec()
            if is_ternary(spec):
                raise SeedfedError("a ternary task's model is held packed (HttpDevice.ternary)")
            if spec.model_kind != "seq_cls":
                raise SeedfedError(f"the HTTP device trains seq_cls tasks, not "
                                   f"{spec.model_kind}")
            self.bundle = build_model(spec, initialize=False)
            self.trainer = LocalTrainer(self.bundle.model, self.bundle.scope, classification_loss)
            state = self.state_dir / STATE_FILE
            if self.version is not None and state.is_file():
                try:
                    load_state(self.bundle.scope, state.read_bytes(), self.meta["checksum"])
                except (SeedfedError, OSError) as e:
                    log.warning("stored state unusable (%s); will download a snapshot", e)
                    self.meta.pop("version", None)
        return self.bundle

    def sync(self, target: int | None = None) -> SyncResult:
        """Catch up to `target` (default: the task's current version), verified."""
        self._ensure_model()
        if self.ternary is not None:
            return self._sync_ternary(target)
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
            (self.state_dir / STATE_FILE).write_bytes(state_bytes(bundle.scope))
        self.meta.update(version=result.version, checksum=result.checksum)
        self._write_meta()
        return result

    # -- ternary tasks ---------------------------------------------------------------------------
    def _restore_ternary(self) -> None:
        """Rebuild the packed model from the state directory (the epoch's snapshot + the
        stored version's latents); anything missing or unverified means a fresh download."""
        t = self.ternary
        assert t is not None
        if self.version is None:
            return
        try:
            t.restore(snapshot=(self.state_dir / TERNARY_SNAPSHOT_FILE).read_bytes(),
                      snapshot_version=int(self.meta["snapshot_version"]),
                      snapshot_checksum=str(self.meta["snapshot_checksum"]),
                      state=(self.state_dir / STATE_FILE).read_bytes()
                      if (self.state_dir / STATE_FILE).is_file() else None,
                      version=self.version, checksum=str(self.meta["checksum"]))
        except (SeedfedError, OSError, KeyError, ValueError) as e:
            log.warning("stored ternary state unusable (%s); will download a snapshot", e)
            t.forget()
            self.meta.pop("version", None)

    def _sync_ternary(self, target: int | None) -> SyncResult:
        """`PackedTernary.sync` over REST: the log when the catch-up plan says replay (the
        coordinator forces a download across a mask epoch start), else the published ternary
        snapshot of `target`. The result and what a restart needs go to the state directory."""
        t = self.ternary
        assert t is not None
        status = self._request("GET", self._task).json()
        target = int(status["version"]) if target is None else target
        if t.version == target:
            return SyncResult(target, t.checksum, "none")
        entries: list[LogEntry] = []
        if t.version is not None and t.version < target:
            plan = self._request("GET", f"{self._task}/catchup",
                                 params={"from": t.version,
                                         "bandwidth": self.config.bandwidth}).json()
            if plan["action"] == "replay":
                entries = [LogEntryWire.model_validate(e).to_entry() for e in self._request(
                    "GET", f"{self._task}/log", params={"since": t.version}).json()]
        downloads: dict[int, httpx.Response] = {}

        def download() -> httpx.Response:
            if target not in downloads:
                downloads[target] = self._request("GET", f"{self._task}/snapshots/{target}",
                                                  params={"format": SNAPSHOT_FORMAT})
            return downloads[target]

        result = t.sync(task_id=self.config.task_id, target=target,
                        target_checksum=self._checksum_of(target, status, entries, download),
                        entries=entries, fetch=lambda: download().content)
        assert t.scope is not None
        if result.method == "snapshot":
            assert t.snapshot is not None
            _write_atomic(self.state_dir / TERNARY_SNAPSHOT_FILE, t.snapshot)
            self.meta.update(snapshot_version=t.snapshot_version,
                             snapshot_checksum=t.snapshot_checksum)
        if result.method != "none":
            _write_atomic(self.state_dir / STATE_FILE, state_bytes(t.scope))
        self.meta.update(version=result.version, checksum=result.checksum)
        self._write_meta()
        return result

    def _checksum_of(self, version: int, status: dict[str, Any], entries: Sequence[LogEntry],
                     download: Callable[[], httpx.Response]) -> str:
        """The coordinator's checksum of `version`: the task status for the current version,
        else the log entry that made it, else (version 0, since moved on) the snapshot's."""
        if version == int(status["version"]):
            return str(status["checksum"])
        for e in entries:
            if e.version == version and e.checksum is not None:
                return str(e.checksum)
        if version > 0:
            made = self._request("GET", f"{self._task}/log",
                                 params={"since": version - 1, "limit": 1}).json()
            return str(LogEntryWire.model_validate(made[0]).checksum)
        return str(download().headers["X-Seedfed-Checksum"])

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
        if self.ternary is not None:
            bundle, trainer = self.ternary.bundle, self.ternary.trainer
        else:
            assert self.bundle is not None and self.trainer is not None
            bundle, trainer = self.bundle, self.trainer
        cfg = self.config.data
        rng = np.random.default_rng([cfg.seed, cfg.partition_id, plan.round])
        batches = data_mod.batches_for(bundle.spec.model_kind, self.examples(),
                                       bundle.tokenizer, plan.batch_size,
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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
