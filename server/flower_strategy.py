"""The Flower ServerApp strategy: a thin door from Flower's fleet to the coordinator.

It holds no model state. `configure_train` asks the coordinator for the round plan and tells each
sampled device how to catch up (log entries since the version the device last confirmed, or a
snapshot when that is cheaper or the device is new); `aggregate_train` hands the replies to the
coordinator as uploads and asks it to close the round. The optional sync phase
(`configure_evaluate`) pushes the new log entry to every device that trained in the round and
collects the checksum each one reached, so a diverged device is caught at once and re-synced
from a snapshot, and each device's held-out accuracies (shared, personalized, local-only), which
it hands to the coordinator to store for the round (`record_metrics`, the service the REST
route uses too).

The only bookkeeping here is the fleet's: which Flower node is which coordinator device and which
version it confirmed. The messages are `seedfed.shared.protocol.records`, the classes the
ClientApp reads and writes too.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from seedfed.shared.protocol.errors import SeedfedError, UserError
from seedfed.shared.protocol.messages import CatchupPlan, TaskStatus
from seedfed.shared.protocol.records import FP32, CatchUp, SyncIns, SyncRes, TrainIns, TrainRes
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import DeviceMetrics, LogEntryWire, RoundPlan, Upload

log = logging.getLogger(__name__)


class CoordinatorPort(Protocol):
    """What the strategy needs of the coordinator's in-process facade."""

    def open_round(self, task_id: str) -> RoundPlan: ...
    def enroll(self, task_id: str) -> tuple[str, str]: ...
    def submit(self, task_id: str, device_id: str, upload: Upload,
               wire_bytes: int | None = None) -> object: ...
    def submit_many(self, task_id: str, uploads: Sequence[tuple[str, Upload, int | None]],
                    ) -> Sequence[object | Exception]: ...
    def close_round(self, task_id: str) -> LogEntryWire: ...
    def record_metrics(self, task_id: str, device_id: str, round_number: int,
                       metrics: DeviceMetrics) -> object: ...
    def log_since(self, task_id: str, version: int) -> list[LogEntryWire]: ...
    def snapshot(self, task_id: str, version: int, fmt: str | None = None,
                 ) -> tuple[bytes, str]: ...
    def task_status(self, task_id: str) -> TaskStatus: ...
    def task_spec(self, task_id: str) -> TaskSpec: ...
    def catchup(self, task_id: str, from_version: int) -> CatchupPlan: ...


@dataclass(frozen=True)
class FleetConfig:
    """Sampling, quorum and timeouts of the Flower rounds (defaults from the task's row)."""

    devices_per_round: int | None = None  # None: every connected device
    min_devices: int = 1  # wait until this many devices are connected
    quorum: int = 1  # close a round only with at least this many accepted uploads
    round_timeout_s: float = 600.0  # wait for replies at most this long per phase
    node_wait_s: float = 300.0  # wait for `min_devices` at most this long
    sync_after_round: bool = True
    #: with `sync_after_round`, run the sync phase only every this many rounds and in
    #: `final_round` (a simulation scoring every N rounds needs no sync in between: a device
    #: replays the entries it missed with its next plan, to the same bits)
    sync_every: int = 1
    final_round: int | None = None
    sample_seed: int = 0
    #: raise FleetFailedError when no sampled device of a round delivers an accepted upload
    #: (every one failed, was refused or did not reply): a simulation's devices fail alike,
    #: so its next round would fail the same way. A deployed fleet keeps going (the round
    #: stays open and is planned again).
    stop_when_all_fail: bool = False

    def __post_init__(self) -> None:
        if self.devices_per_round is not None and self.devices_per_round < 1:
            raise ValueError(f"devices_per_round must be >= 1 or None, got "
                             f"{self.devices_per_round}")
        for name in ("min_devices", "quorum", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("round_timeout_s", "node_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_status(cls, status: TaskStatus, **overrides: Any) -> FleetConfig:
        """The task's own quorum, timeout and devices per round, with explicit overrides."""
        base = {"quorum": status.quorum, "round_timeout_s": status.round_timeout_s,
                "devices_per_round": status.devices_per_round}
        return cls(**{**base, **overrides})


class FleetFailedError(UserError, RuntimeError):
    """Every device sampled for a round failed (`FleetConfig.stop_when_all_fail`); the
    message carries the first failure."""

    def __init__(self, round_number: int, sampled: int, first: str) -> None:
        super().__init__(f"round {round_number}: all {sampled} sampled devices failed; the "
                         f"first: {first}", "fix what the first failure names (the devices' "
                         "data, model or task settings); a round every device fails is not "
                         "planned again")


@dataclass
class RoundRecord:
    """What one Flower round moved and produced."""

    round: int
    base_version: int
    version: int | None = None  # the version the round committed (None: not closed)
    checksum: str | None = None
    sampled: int = 0
    participants: int = 0
    failures: list[str] = field(default_factory=list)
    loss: float | None = None
    scalars_per_device: int = 0
    upload_bytes: int = 0  # reply payloads (RecordDict tree) accepted this round
    upload_message_bytes: int = 0  # the same replies with Flower's message envelope
    download_bytes: int = 0  # train + sync message payloads sent this round
    synced: int = 0
    sync_mismatches: int = 0
    local_accuracy: float | None = None
    device_checksums: dict[int, str] = field(default_factory=dict)
    #: per synced device, its held-out accuracy: shared, personalized, local-only (the last
    #: two None for a device without a personal part). Metrics only, never examples.
    device_accuracy: dict[int, tuple[float, float | None, float | None]] = field(
        default_factory=dict)


@dataclass
class _Node:
    device_id: str
    version: int | None = None  # last version the device confirmed; None: needs a snapshot
    checksum: str | None = None


def payload_bytes(content: RecordDict) -> int:
    """Bytes Flower moves for a message content: every object of its tree, deflated."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())


def message_bytes(message: Message) -> int:
    """Bytes of a whole message: its content tree plus the message object (metadata)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


class SeedfedStrategy(Strategy):
    """Round plans and aggregation come from the coordinator; this only moves messages."""

    def __init__(self, coordinator: CoordinatorPort, task_id: str, config: FleetConfig,
                 on_round: Callable[[RoundRecord], None] | None = None) -> None:
        self.coordinator = coordinator
        self.task_id = task_id
        self.config = config
        self.on_round = on_round
        self.history: list[RoundRecord] = []
        self._nodes: dict[int, _Node] = {}
        self._plan: RoundPlan | None = None
        self._rng = random.Random(config.sample_seed)
        self._spec: TaskSpec | None = None
        #: devices whose upload the current round accepted: the devices its sync phase
        #: reaches (a cost of the devices per round, whatever the fleet's size)
        self._trained: set[int] = set()

    # -- fleet bookkeeping -------------------------------------------------------------------
    def _node(self, node_id: int) -> _Node:
        if node_id not in self._nodes:
            device_id, _token = self.coordinator.enroll(self.task_id)
            self._nodes[node_id] = _Node(device_id)
        return self._nodes[node_id]

    def _connected(self, grid: Grid) -> list[int]:
        deadline = time.monotonic() + self.config.node_wait_s
        while len(ids := sorted(grid.get_node_ids())) < self.config.min_devices:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids)} devices connected after "
                                   f"{self.config.node_wait_s:.0f} s, need "
                                   f"{self.config.min_devices}")
            time.sleep(0.2)
        return ids

    def _task_spec(self) -> TaskSpec:
        if self._spec is None:
            self._spec = self.coordinator.task_spec(self.task_id)
        return self._spec

    def _snapshot_fmt(self) -> str:
        """The snapshot a device loads: the fp32 trainable state, except on a ternary task,
        whose devices hold the packed model and so take the published ternary snapshot
        (codes, gammas, masks, masked latents; the fp32 master file holds every latent)."""
        return "ternary" if self._task_spec().scope == "ternary" else FP32

    def _catch_up(self, node: _Node, target: int, cache: dict[int, list[LogEntryWire]],
                  ) -> CatchUp:
        """How the device reaches `target`: nothing, the log entries it missed, or a snapshot
        (the coordinator's catch-up plan picks the cheaper; new devices always take one)."""
        if node.version == target:
            return CatchUp()
        if node.version is not None and node.version < target:
            if node.version not in cache:
                plan = self.coordinator.catchup(self.task_id, node.version)
                if plan.action == "replay" and plan.to_version == target:
                    cache[node.version] = self.coordinator.log_since(self.task_id, node.version)
                else:
                    cache[node.version] = []
            if cache[node.version]:
                return CatchUp(entries=tuple(cache[node.version]))
        fmt = self._snapshot_fmt()
        data, chk = self.coordinator.snapshot(self.task_id, target,
                                              None if fmt == FP32 else fmt)
        return CatchUp(snapshot=data, snapshot_version=target, snapshot_checksum=chk,
                       snapshot_format=fmt, task=json.dumps(self._task_spec().to_dict()))

    @staticmethod
    def _message(node_id: int, content: RecordDict, kind: str) -> Message:
        return Message(content=content, message_type=kind, dst_node_id=node_id)

    # -- training ----------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        plan = self.coordinator.open_round(self.task_id)
        self._plan = plan
        connected = self._connected(grid)
        k = self.config.devices_per_round or len(connected)
        chosen = sorted(self._rng.sample(connected, min(k, len(connected))))
        record = RoundRecord(round=plan.round, base_version=plan.version, sampled=len(chosen),
                             scalars_per_device=plan.steps * plan.perturbations)
        self._trained = set()
        self.history.append(record)
        cache: dict[int, list[LogEntryWire]] = {}
        messages = []
        for node_id in chosen:
            ins = TrainIns(self.task_id, plan, self._catch_up(self._node(node_id), plan.version,
                                                              cache))
            msg = self._message(node_id, ins.to_record(), MessageType.TRAIN)
            record.download_bytes += payload_bytes(msg.content)
            messages.append(msg)
        log.info("round %d: plan v%d, %d of %d devices", plan.round, plan.version, len(chosen),
                 len(connected))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        plan, record = self._plan, self.history[-1]
        assert plan is not None
        losses: list[tuple[float, int]] = []
        readable: list[tuple[int, Message, Upload, int]] = []  # node, reply, upload, bytes
        got = list(replies)
        for reply in got:
            node_id = reply.metadata.src_node_id
            node = self._node(node_id)
            if reply.has_error():
                node.version = node.checksum = None  # whatever it holds, resend a snapshot
                record.failures.append(f"device {node_id}: {reply.error.reason}")
                continue
            try:
                readable.append((node_id, reply, self._upload(plan, reply),
                                 payload_bytes(reply.content)))
            except (SeedfedError, KeyError, TypeError, ValueError) as e:
                record.failures.append(f"device {node_id}: {type(e).__name__}: {e}")
        # the round's uploads in one call (one transaction in process): a refusal is that
        # device's failure, never its neighbours'
        outcomes = self.coordinator.submit_many(self.task_id, [
            (self._nodes[n].device_id, upload, size) for n, _, upload, size in readable])
        for (node_id, reply, upload, size), outcome in zip(readable, outcomes, strict=True):
            if isinstance(outcome, Exception):
                record.failures.append(f"device {node_id}: {type(outcome).__name__}: "
                                       f"{outcome}")
                continue
            # it trained at the plan's version and returned to it
            self._nodes[node_id].version = plan.version
            self._trained.add(node_id)
            record.participants += 1
            record.upload_bytes += size
            record.upload_message_bytes += message_bytes(reply)
            losses.append((upload.loss, upload.num_examples))
        if len(got) < record.sampled:
            record.failures.append(f"{record.sampled - len(got)} of {record.sampled} "
                                   "devices did not reply within the round timeout "
                                   f"({self.config.round_timeout_s:.0f} s)")
        for failure in record.failures:
            log.warning("round %d: %s", plan.round, failure)
        if self.config.stop_when_all_fail and record.sampled and not record.participants:
            raise FleetFailedError(plan.round, record.sampled, record.failures[0])
        if record.participants >= self.config.quorum:
            entry = self.coordinator.close_round(self.task_id)
            record.version, record.checksum = entry.base_version + 1, entry.checksum
            total = sum(n for _, n in losses)
            record.loss = sum(v * n for v, n in losses) / total
        else:
            log.warning("round %d: %d accepted uploads, quorum %d; round stays open",
                        plan.round, record.participants, self.config.quorum)
        if not self.config.sync_after_round and self.on_round is not None:
            self.on_round(record)
        metrics = MetricRecord({"participants": record.participants,
                                "upload-bytes": record.upload_bytes,
                                "download-bytes": record.download_bytes})
        if record.loss is not None:
            metrics["loss"] = record.loss
        if record.version is not None:
            metrics["version"] = record.version
        return None, metrics

    @staticmethod
    def _upload(plan: RoundPlan, reply: Message) -> Upload:
        res = TrainRes.from_record(reply.content)
        if res.scalars.shape != (plan.steps, plan.perturbations):
            raise ValueError(f"scalars have shape {list(res.scalars.shape)}, the plan "
                             f"{[plan.steps, plan.perturbations]}")
        return Upload.build(plan, res.scalars, res.num_examples, res.loss)

    # -- sync phase --------------------------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if not self.config.sync_after_round or not self.history:
            return []
        if server_round % self.config.sync_every and server_round != self.config.final_round:
            return []
        status = self.coordinator.task_status(self.task_id)
        record = self.history[-1]
        connected = set(grid.get_node_ids())
        cache: dict[int, list[LogEntryWire]] = {}
        messages = []
        # the devices that trained this round: the others catch up with their next plan
        # (replaying the entries they missed, checksum verified), so a fleet of any size
        # costs what its sampled devices do
        for node_id in sorted(self._trained):
            node = self._nodes[node_id]
            if node_id not in connected or node.version is None:
                continue  # a device without state gets its snapshot with its next plan
            ins = SyncIns(self.task_id, status.version, status.checksum,
                          self._catch_up(node, status.version, cache))
            msg = self._message(node_id, ins.to_record(), MessageType.EVALUATE)
            record.download_bytes += payload_bytes(msg.content)
            messages.append(msg)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message],
                           ) -> MetricRecord | None:
        if not self.history:
            return None
        record = self.history[-1]
        status = self.coordinator.task_status(self.task_id)
        scored: list[tuple[float, float, int]] = []
        for reply in replies:
            node_id = reply.metadata.src_node_id
            node = self._node(node_id)
            if reply.has_error():
                node.version = node.checksum = None
                record.sync_mismatches += 1
                log.warning("sync of device %d failed: %s", node_id, reply.error.reason)
                continue
            try:
                res = SyncRes.from_record(reply.content)
            except (SeedfedError, ValueError) as e:
                node.version = node.checksum = None
                record.sync_mismatches += 1
                log.warning("sync reply of device %d unreadable: %s", node_id, e)
                continue
            record.device_checksums[node_id] = res.checksum
            if (res.version, res.checksum) != (status.version, status.checksum):
                node.version = node.checksum = None
                record.sync_mismatches += 1
                continue
            node.version, node.checksum = res.version, res.checksum
            record.synced += 1
            if res.accuracy is not None and res.loss is not None and res.num_examples > 0:
                scored.append((res.accuracy, res.loss, res.num_examples))
                record.device_accuracy[node_id] = (res.accuracy, res.personal_accuracy,
                                                   res.local_only_accuracy)
                self._store_metrics(record.round, node_id, node.device_id, res)
        total = sum(n for _, _, n in scored)
        if total:
            record.local_accuracy = sum(a * n for a, _, n in scored) / total
        if self.on_round is not None:
            self.on_round(record)
        out = MetricRecord({"synced": record.synced, "mismatches": record.sync_mismatches})
        if record.local_accuracy is not None:
            out["local-accuracy"] = record.local_accuracy
        return out

    def _store_metrics(self, round_number: int, node_id: int, device_id: str,
                       res: SyncRes) -> None:
        """Hand a synced device's held-out scores to the coordinator for the round (the same
        service the REST route calls). A device's bad numbers are its own loss: logged, the
        round goes on."""
        assert res.accuracy is not None  # the caller stores scored replies only
        try:
            metrics = DeviceMetrics(version=res.version, num_examples=res.num_examples,
                                    shared_accuracy=res.accuracy,
                                    personal_accuracy=res.personal_accuracy,
                                    local_accuracy=res.local_only_accuracy)
            self.coordinator.record_metrics(self.task_id, device_id, round_number, metrics)
        except (SeedfedError, ValueError) as e:
            log.warning("round %d: metrics of device %d not stored: %s", round_number, node_id,
                        e)

    def summary(self) -> None:
        c = self.config
        log.info("seedfed strategy: task %s, %s devices per round, quorum %d, timeout %.0f s, "
                 "sync after round: %s", self.task_id, c.devices_per_round or "all", c.quorum,
                 c.round_timeout_s, c.sync_after_round)
