"""Catch-up by real cost: a device behind by k versions replays the log or downloads a snapshot,
whichever its OWN measurements say is cheaper (docs/protocol.md section 9).

    replay_s   = latency + replay_bytes / bandwidth + replay_seeds * scope_numel / replay_rate
    download_s = latency + download_bytes / bandwidth + download_bytes / load_rate

`choose_catchup` is that rule as a pure function. The rates come from the device itself:
`LinkMeter` (bandwidth and latency from the duration and size of its own downloads),
`RateMeter` for the replay rate (elements x seeds per second of its own replays, seeded by
its backend's `calibrate_replay_rate`, a short timed replay of scratch tensors shaped like its
scope) and
for the snapshot load rate (bytes per second of its own snapshot loads). No fixed constant
decides: a phone on a slow link replays far more versions before a snapshot pays than a
workstation on a LAN does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from seedfed.client.backends.base import SyncResult
from seedfed.shared.protocol.npzo import LogEntry

if TYPE_CHECKING:
    from seedfed.client.backends.base import Backend
    from seedfed.client.device import Device
    from seedfed.shared.protocol.coordinator_client import CoordinatorClient

Action = Literal["none", "replay", "download"]

#: What a device assumes before it has measured anything (replaced by the first measurement).
PRIOR_BANDWIDTH = 2e6  # bytes/s
PRIOR_LATENCY = 0.05  # s per request
PRIOR_LOAD_RATE = 2e8  # snapshot bytes parsed, written and hashed per second
#: Transfers below this size say little about bandwidth (their time is mostly latency).
MIN_BANDWIDTH_SAMPLE = 4096


@dataclass(frozen=True)
class CatchupChoice:
    action: Action
    replay_seconds: float
    download_seconds: float
    reason: str | None = None  # set when the action is forced, not chosen by cost


def choose_catchup(*, versions_behind: int, replay_bytes: int, replay_seeds: int,
                   scope_numel: int, download_bytes: int, bandwidth: float, latency: float,
                   replay_rate: float, load_rate: float, forced: str | None = None,
                   ) -> CatchupChoice:
    """Replay or download by estimated seconds on this device (ties replay: it needs no
    snapshot of the target to exist). `forced` (the coordinator's reason, e.g. a mask epoch
    start in between) makes it a download whatever the costs."""
    for name, v in (("bandwidth", bandwidth), ("replay_rate", replay_rate),
                    ("load_rate", load_rate)):
        if not v > 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if versions_behind < 0 or latency < 0:
        raise ValueError(f"versions_behind ({versions_behind}) and latency ({latency}) must "
                         "be >= 0")
    if versions_behind == 0:
        return CatchupChoice("none", 0.0, 0.0)
    replay_s = latency + replay_bytes / bandwidth + replay_seeds * scope_numel / replay_rate
    download_s = latency + download_bytes / bandwidth + download_bytes / load_rate
    if forced is not None:
        return CatchupChoice("download", replay_s, download_s, forced)
    return CatchupChoice("replay" if replay_s <= download_s else "download", replay_s,
                         download_s)


def crossover_versions(*, entry_bytes: float, seeds_per_entry: float, scope_numel: int,
                       download_bytes: int, bandwidth: float, replay_rate: float,
                       load_rate: float) -> float:
    """The k at which replaying k entries costs as much as one snapshot (latency cancels:
    one request either way); replay is cheaper below it."""
    per_entry = entry_bytes / bandwidth + seeds_per_entry * scope_numel / replay_rate
    return (download_bytes / bandwidth + download_bytes / load_rate) / per_entry


class LinkMeter:
    """Bandwidth and latency of the device's link, from its own transfers.

    Each transfer took t = latency + bytes / bandwidth. Latency is the fastest transfer seen
    (a small answer is nearly all latency); bandwidth is the bytes of the recent transfers of
    at least MIN_BANDWIDTH_SAMPLE bytes over their time beyond that latency.
    """

    def __init__(self, bandwidth: float = PRIOR_BANDWIDTH, latency: float = PRIOR_LATENCY,
                 window: int = 32) -> None:
        self._prior = (bandwidth, latency)
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, n_bytes: int, seconds: float) -> None:
        if n_bytes >= 0 and seconds > 0:
            self._samples.append((n_bytes, seconds))

    def timed(self, call: Callable[[], bytes]) -> bytes:
        """Run a download and record its size and duration."""
        t0 = time.perf_counter()
        data = call()
        self.observe(len(data), time.perf_counter() - t0)
        return data

    @property
    def latency(self) -> float:
        return min((t for _, t in self._samples), default=self._prior[1])

    @property
    def bandwidth(self) -> float:
        big = [(b, t) for b, t in self._samples if b >= MIN_BANDWIDTH_SAMPLE]
        if not big:
            return self._prior[0]
        lat = self.latency
        return sum(b for b, _ in big) / max(sum(max(t - lat, 1e-6) for _, t in big), 1e-6)


class RateMeter:
    """A work rate (units per second) from the device's own timed work: the recent total."""

    def __init__(self, prior: float, window: int = 16) -> None:
        self._prior = prior
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, units: float, seconds: float) -> None:
        if units > 0 and seconds > 0:
            self._samples.append((units, seconds))

    @property
    def rate(self) -> float:
        if not self._samples:
            return self._prior
        return sum(u for u, _ in self._samples) / sum(s for _, s in self._samples)


class CatchupMeters:
    """What one device has measured of itself: its link, its replay rate, its load rate."""

    def __init__(self, bandwidth: float = PRIOR_BANDWIDTH) -> None:
        self.link = LinkMeter(bandwidth)
        self.replay: RateMeter | None = None  # calibrated at the first catch-up
        self.load = RateMeter(PRIOR_LOAD_RATE)
        self.last: CatchupChoice | None = None  # the latest decision (logs, tests)

    def replay_rate(self, backend: Backend) -> float:
        if self.replay is None:
            self.replay = RateMeter(backend.calibrate_replay_rate())
        return self.replay.rate


def sync_by_cost(device: Device, api: CoordinatorClient, task_id: str, target: int,
                 fmt: str | None, meters: CatchupMeters) -> SyncResult:
    """Bring `device` to `target`: the coordinator's catch-up plan gives the sizes, the
    device's own rates (sent along, so the plan's `action` agrees) decide; every download and
    replay is timed into `meters`. A failed replay still ends on the snapshot (Device.sync)."""
    entries: list[LogEntry] = []
    start = device.version
    numel = 0  # known only to a device that holds a state (a packed model may hold none yet)
    if start is not None and start < target:
        numel = sum(n for _, n in device.backend.state_sizes())
        rate = meters.replay_rate(device.backend)
        plan = api.catchup(task_id, start, bandwidth=meters.link.bandwidth, regen_rate=rate)
        meters.last = choose_catchup(
            versions_behind=target - start, replay_bytes=plan.replay_bytes,
            replay_seeds=plan.replay_seeds, scope_numel=numel,
            download_bytes=plan.download_bytes, bandwidth=meters.link.bandwidth,
            latency=meters.link.latency, replay_rate=rate, load_rate=meters.load.rate,
            forced=plan.reason)
        if meters.last.action == "replay":
            t0 = time.perf_counter()
            wire = api.log_since(task_id, start)
            meters.link.observe(sum(len(e.model_dump_json()) for e in wire),
                                time.perf_counter() - t0)
            entries = [e.to_entry() for e in wire]
    fetched: list[tuple[int, float]] = []

    def fetch() -> tuple[bytes, str]:
        t0 = time.perf_counter()
        data, chk = api.snapshot(task_id, target, fmt)
        fetched.append((len(data), time.perf_counter() - t0))
        meters.link.observe(*fetched[-1])
        return data, chk

    t0 = time.perf_counter()
    result = device.sync(target, entries=entries, fetch=fetch)
    local_s = time.perf_counter() - t0 - sum(t for _, t in fetched)
    if result.method == "replay" and meters.replay is not None and start is not None \
            and numel:
        seeds = sum(len(e.seeds) for e in entries if start <= e.base_version < target)
        meters.replay.observe(seeds * numel, local_s)
    elif result.method == "snapshot" and fetched and not entries:
        meters.load.observe(fetched[-1][0], local_s)
    return result
