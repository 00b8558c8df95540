"""Catch-up crossover on this machine: after how many versions does a snapshot beat replay?

For each scope of the SST-2 recipe's MiniLM (the 770-value head, LoRA r=8 on query/value, the
full model) it measures, on this CPU, what the device's cost model (client/catchup.py) needs:

- the bytes of one log entry of the recipe's round (64 seeds) as JSON on the wire, and of the
  fp32 snapshot (safetensors);
- the replay rate: k entries of 64 seeds replayed and verified (client/sync.catch_up, the
  device's own path: apply + checksum per entry), in elements x seeds per second, next to what
  `calibrate_replay_rate` estimates before a device has replayed anything;
- the snapshot load rate: `load_state` with the checksum check, bytes per second;

then the crossover k* (client/catchup.crossover_versions) at link bandwidths from a poor mobile
link (100 kB/s) to a LAN (100 MB/s). Replay is cheaper below k*.

    nice -n 19 env OMP_NUM_THREADS=1 seedfed bench catchup \
        --json benchmarks/results/catchup.json
    seedfed bench catchup --quick      # synthetic tensors of the head and LoRA sizes
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json
from seedfed.client.backends.torch import calibrate_replay_rate
from seedfed.client.catchup import crossover_versions
from seedfed.client.sync import catch_up, load_state, state_bytes
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.wire import LogEntryWire

SEEDS_PER_ENTRY = 64  # the SST-2 recipe: 1 step x 64 perturbations
BANDWIDTHS = (1e5, 1e6, 1e7, 1e8)  # bytes/s


def recipe_scopes() -> dict[str, Scope]:
    from dataclasses import replace

    from seedfed.shared.model.factory import build_model
    from seedfed.shared.protocol.recipes import resolve_recipe
    from seedfed.shared.protocol.scope_options import options_for
    from seedfed.shared.protocol.task import LoraOptions

    spec = resolve_recipe("sst2").spec
    out = {"head": build_model(spec, initialize=True).scope}
    lora = replace(spec, scope="lora", scope_options=options_for("lora"), step_scales=(),
                   lora=LoraOptions(r=8, target_modules=("query", "value")))
    out["lora"] = build_model(lora, initialize=True).scope
    full = replace(spec, scope="full", scope_options=options_for("full"), step_scales=())
    out["full"] = build_model(full, initialize=True).scope
    return out


def synthetic_scopes() -> dict[str, Scope]:
    """Tensors of the head's and of LoRA's sizes without loading a model (the quick run)."""
    def scope(shapes: dict[str, int]) -> Scope:
        return Scope(nn.Module(), [ScopedTensor(n, torch.zeros(k)) for n, k in shapes.items()])

    lora = {f"l{i}.{m}.lora_{ab}": 384 * 8 for i in range(6) for m in ("q", "v")
            for ab in ("A", "B")}
    return {"head": scope({"classifier.bias": 2, "classifier.weight": 768}),
            "lora": scope({**lora, "classifier.bias": 2, "classifier.weight": 768})}


def _entries(scope: Scope, k: int, rng: np.random.Generator) -> list[LogEntry]:
    """k real entries of 64 seeds from the scope's current state, with their checksums."""
    before = {n: v.clone() for n, v in scope.read().items()}
    out = []
    for base in range(k):
        seeds = tuple(int(s) for s in rng.integers(0, 2**53, SEEDS_PER_ENTRY))
        coefs = tuple(float(c) for c in rng.normal(0, 1e-4, SEEDS_PER_ENTRY).astype(np.float32))
        apply_seeds(scope, seeds, coefs)
        out.append(LogEntry("bench", base, seeds, coefs, checksum(scope)))
    scope.write(before)
    return out


def measure(name: str, scope: Scope, k: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    entries = _entries(scope, k, rng)
    entry_bytes = statistics.mean(len(LogEntryWire.from_entry(e).model_dump_json())
                                  for e in entries)
    start = {n: v.clone() for n, v in scope.read().items()}
    replay_s = []
    for _ in range(repeats):
        scope.write(start)
        t0 = time.perf_counter()
        catch_up(scope, task_id="bench", version=0, entries=entries, target=k)
        replay_s.append(time.perf_counter() - t0)
    snapshot = state_bytes(scope)
    expected = checksum(scope)
    load_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        load_state(scope, snapshot, expected)
        load_s.append(time.perf_counter() - t0)
    numel = scope.numel
    replay_rate = k * SEEDS_PER_ENTRY * numel / statistics.median(replay_s)
    load_rate = len(snapshot) / statistics.median(load_s)
    row: dict[str, Any] = {
        "scope": name, "numel": numel, "tensors": len(scope), "entry_bytes": entry_bytes,
        "snapshot_bytes": len(snapshot), "replay_s_per_entry": statistics.median(replay_s) / k,
        "replay_rate": replay_rate,
        "calibrated_replay_rate": calibrate_replay_rate([(t.name, t.numel) for t in scope]),
        "load_s": statistics.median(load_s), "load_rate": load_rate}
    row["crossover"] = {f"{bw:g}": crossover_versions(
        entry_bytes=entry_bytes, seeds_per_entry=SEEDS_PER_ENTRY, scope_numel=numel,
        download_bytes=len(snapshot), bandwidth=bw, replay_rate=replay_rate,
        load_rate=load_rate) for bw in BANDWIDTHS}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'scope':<6} {'numel':>10} {'entry B':>8} {'snapshot B':>11} {'replay/entry':>12} "
            f"{'rate (calib)':>22} {'load':>8} " + " ".join(f"k*@{bw:g}B/s".rjust(11)
                                                             for bw in BANDWIDTHS))
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['scope']:<6} {r['numel']:>10} {r['entry_bytes']:>8.0f} "
            f"{r['snapshot_bytes']:>11} {r['replay_s_per_entry'] * 1e3:>10.2f}ms "
            f"{r['replay_rate']:>10.3g} ({r['calibrated_replay_rate']:>8.3g}) "
            f"{r['load_s'] * 1e3:>6.1f}ms " + " ".join(f"{v:>11.1f}"
                                                      for v in r["crossover"].values()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("catchup")
    p.add_argument("--quick", action="store_true", help="synthetic head and LoRA tensors")
    p.add_argument("--entries", type=int, default=4, help="entries replayed per timing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    scopes = synthetic_scopes() if args.quick else recipe_scopes()
    rows = [measure(n, s, args.entries, args.repeats) for n, s in scopes.items()]
    print(table(rows))
    if args.json is not None:
        write_json(args.json, {"seeds_per_entry": SEEDS_PER_ENTRY, "rows": rows}, indent=1,
                   newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
