"""`seedfed bench core`: memory, step time and replay throughput of the ZO core, side by side.

    seedfed bench core [--quick] [--json PATH] [--repeats N] [--threads N] [--strict]

Every memory figure comes from its own subprocess (`core_worker`) so one measurement's freed
pages or allocator state cannot hide another's peak; the timing runs interleave their variants
inside one process so background load on the shared CPUs hits them alike. The result is a flat
JSON object (memory peaks, times and throughputs, their ratios, target verdicts and raw
samples) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seedfed.bench.core_setup import shape_named
from seedfed.bench.registry import bench_parser, positive_int
from seedfed.bench.report import write_json

MEMORY_KINDS = ("inference", "zo_virtual", "zo_copy", "sgd", "adamw")
MEMORY_PARALLEL = 2

#: Targets: (result key, comparison, limit, what it means).
TARGETS: tuple[tuple[str, str, float, str], ...] = (
    ("zo_vs_inference_mem", "<=", 1.05, "ZO step peak memory / inference peak"),
    ("zo_step_vs_forward", "<=", 2.05, "ZO step time / one forward pass"),
    ("replay_vs_mezo", ">=", 4.0, "replay throughput / MeZO torch normal_ regeneration"),
    ("replay_vs_axpy", ">=", 0.5, "replay throughput / fp32 axpy (bandwidth limit)"),
    ("replay_fused_vs_axpy", ">=", 2.0, "16 seeds fused in one pass / fp32 axpy"),
)


@dataclass(frozen=True)
class CoreBenchConfig:
    """Sizes of one run. `quick` uses the small Llama and a smaller replay tensor."""

    quick: bool = False
    repeats: int = 5
    replay_numel: int = 1 << 24
    replay_seeds: int = 20
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.replay_numel < 1 or self.replay_seeds < 1:
            raise ValueError(f"replay needs a tensor and seeds, got numel {self.replay_numel}, "
                             f"seeds {self.replay_seeds}")

    @classmethod
    def preset(cls, quick: bool, repeats: int | None = None,
               threads: int | None = None) -> CoreBenchConfig:
        if quick:
            return cls(quick=True, repeats=repeats or 3, replay_numel=1 << 22, threads=threads)
        return cls(quick=False, repeats=repeats or 5, threads=threads)

    @property
    def shape(self) -> str:
        return "quick" if self.quick else "full"


def run_worker(module: str, args: list[object], what: str,
               timeout: float = 7200) -> dict[str, Any]:
    """Run one measurement (`python -m module *args`) in a fresh interpreter, offline; its last
    stdout line is the JSON result. `what` names it in the error if it fails."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker(config: CoreBenchConfig, kind: str, timeout: float = 7200) -> dict[str, Any]:
    """Run one measurement of `seedfed.bench.core_worker` in a fresh interpreter."""
    args: list[object] = [kind, "--shape", config.shape, "--repeats", config.repeats,
                          "--numel", config.replay_numel, "--seeds", config.replay_seeds,
                          "--threads", config.threads or 0]
    return run_worker("seedfed.bench.core_worker", args, f"benchmark worker {kind}", timeout)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run_core(config: CoreBenchConfig, progress: Any = None) -> dict[str, Any]:
    """Run every measurement and return the flat result object."""
    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    started = time.time()
    # Peaks are per process, so two memory workers may run at once (halving the wall time on
    # two cores); the timing workers below run alone.
    say("peak memory: inference, ZO (virtual, copy), SGD, AdamW")
    with ThreadPoolExecutor(max_workers=MEMORY_PARALLEL) as pool:
        memory = dict(zip(MEMORY_KINDS, pool.map(lambda k: _worker(config, k), MEMORY_KINDS),
                          strict=True))
    say("time: forward vs ZO step")
    speed = _worker(config, "speed")
    say("replay throughput")
    replay = _worker(config, "replay")

    inference = memory["inference"]
    result: dict[str, Any] = {
        "shape": shape_named(config.shape).to_dict(),
        "quick": config.quick,
        "repeats": config.repeats,
        "inference_peak_mb": inference["peak_mb"],
        "zo_step_peak_mb": memory["zo_virtual"]["peak_mb"],
        "zo_step_copy_peak_mb": memory["zo_copy"]["peak_mb"],
        "sgd_peak_mb": memory["sgd"]["peak_mb"],
        "adamw_peak_mb": memory["adamw"]["peak_mb"],
        "baseline_mb": inference["baseline_mb"],
        "forward_s": speed["forward_s"],
        "zo_step_s": speed["zo_step_s"],
        "zo_step_copy_s": speed["zo_step_copy_s"],
        "replay_mparam_s": replay["replay_mparam_s"],
        "replay_fused_mparam_s": replay["replay_fused_mparam_s"],
        "replay_numpy_fused_mparam_s": replay["replay_numpy_fused_mparam_s"],
        "replay_fused_seeds": replay["fused_seeds"],
        "stream_kernel": replay["kernel"],
        "mezo_replay_mparam_s": replay["mezo_replay_mparam_s"],
        "axpy_mparam_s": replay["axpy_mparam_s"],
        "replay_numel": replay["numel"],
        "replay_seeds": replay["seeds"],
    }
    for kind, key in (("zo_virtual", "zo_vs_inference_mem"),
                      ("zo_copy", "zo_copy_vs_inference_mem"),
                      ("sgd", "sgd_vs_inference_mem"), ("adamw", "adamw_vs_inference_mem")):
        result[key] = _ratio(memory[kind]["peak_mb"], inference["peak_mb"])
    result["zo_step_vs_forward"] = _ratio(speed["zo_step_s"], speed["forward_s"])
    result["zo_step_copy_vs_forward"] = _ratio(speed["zo_step_copy_s"], speed["forward_s"])
    result["replay_vs_mezo"] = _ratio(replay["replay_mparam_s"], replay["mezo_replay_mparam_s"])
    result["replay_vs_axpy"] = _ratio(replay["replay_mparam_s"], replay["axpy_mparam_s"])
    result["replay_fused_vs_axpy"] = _ratio(replay["replay_fused_mparam_s"],
                                            replay["axpy_mparam_s"])
    result["targets"] = {
        key: {"limit": f"{op} {limit}", "value": result[key],
              "met": result[key] <= limit if op == "<=" else result[key] >= limit, "what": what}
        for key, op, limit, what in TARGETS
    }
    result["memory_detail"] = memory
    result["time_samples"] = {"speed": speed["samples"], "replay": replay["samples"]}
    result["env"] = {"python": platform.python_version(), "machine": platform.machine(),
                     "cpus": os.cpu_count(), "threads": speed["threads"],
                     "loadavg_end": os.getloadavg(), "wall_s": time.time() - started}
    return result


#: The table's rows: measure, value key and unit, ratio key (None: the reference row, its text
#: as given) and its format. Times are stored in seconds and shown in ms.
_ROWS: tuple[tuple[str, str | None, str, str | None, str], ...] = (
    ("inference peak", "inference_peak_mb", "MB",
     None, "1.00 x inference"),
    ("ZO step peak (virtual)", "zo_step_peak_mb", "MB",
     "zo_vs_inference_mem", "{:.3f} x"),
    ("ZO step peak (copy)", "zo_step_copy_peak_mb", "MB",
     "zo_copy_vs_inference_mem", "{:.3f} x"),
    ("SGD step peak", "sgd_peak_mb", "MB",
     "sgd_vs_inference_mem", "{:.2f} x"),
    ("AdamW step peak", "adamw_peak_mb", "MB",
     "adamw_vs_inference_mem", "{:.2f} x"),
    ("forward pass", "forward_s", "ms",
     None, "1.00 x forward"),
    ("ZO step (virtual)", "zo_step_s", "ms",
     "zo_step_vs_forward", "{:.2f} x"),
    ("ZO step (copy)", "zo_step_copy_s", "ms",
     "zo_step_copy_vs_forward", "{:.2f} x"),
    ("replay (seed stream)", "replay_mparam_s", "Mparam/s",
     "replay_vs_mezo", "{:.1f} x MeZO"),
    ("", None, "",
     "replay_vs_axpy", "{:.2f} x axpy"),
    ("replay, 16 seeds fused", "replay_fused_mparam_s", "Mparam/s",
     "replay_fused_vs_axpy", "{:.2f} x axpy"),
    ("same, numpy path", "replay_numpy_fused_mparam_s", "Mparam/s",
     None, ""),
    ("MeZO regeneration", "mezo_replay_mparam_s", "Mparam/s",
     None, ""),
    ("fp32 axpy", "axpy_mparam_s", "Mparam/s",
     None, ""),
)
_SCALE = {"MB": 1.0, "ms": 1e3, "Mparam/s": 1.0}


def render(result: dict[str, Any]) -> Any:
    """A rich table of the figures, ratios and target verdicts."""
    from rich.table import Table

    shape = result["shape"]
    table = Table(title=f"seedfed core benchmark: {shape['name']} "
                        f"(batch {shape['batch']} x {shape['seq_len']})")
    for col, justify in (("measure", "left"), ("value", "right"), ("vs reference", "right"),
                         ("target", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    targets = result["targets"]
    for measure, key, unit, ratio_key, ratio in _ROWS:
        value = "" if key is None else f"{result[key] * _SCALE[unit]:.0f} {unit}"
        verdict = ""
        if ratio_key is not None:
            ratio = ratio.format(result[ratio_key])
            t = targets.get(ratio_key)
            if t is not None:
                verdict = f"{t['limit']} {'[green]met[/]' if t['met'] else '[red]MISSED[/]'}"
        table.add_row(measure, value, ratio, verdict)
    return table


def measured_parser(name: str, quick_help: str, threads_help: str) -> argparse.ArgumentParser:
    """The parser of a benchmark with targets (core, probes): --quick, --json, --repeats,
    --threads and --strict; the benchmark adds its own options."""
    parser = bench_parser(name)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timing repeats (median)")
    parser.add_argument("--threads", type=positive_int, default=None, help=threads_help)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return parser


def run_measured(label: str, args: argparse.Namespace,
                 run: Callable[[Callable[[str], None]], dict[str, Any]],
                 tables: Callable[[dict[str, Any]], list[Any]]) -> int:
    """`run(progress)` under a status line, its `tables` printed, its JSON written to --json;
    exit status 1 on a missed target only with --strict (the figures depend on the machine
    and its load)."""
    from rich.console import Console

    console = Console()
    with console.status(label) as status:
        result = run(lambda msg: status.update(f"{label}: {msg}"))
    for table in tables(result):
        console.print(table)
    if args.json is not None:
        write_json(args.json, result, sort_keys=True)
        console.print(f"wrote {args.json}")
    missed = sum(not t["met"] for t in result["targets"].values())
    return 1 if args.strict and missed else 0


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write JSON (`run_measured`)."""
    args = measured_parser("core", "small Llama, under a minute",
                           "torch threads per worker (default: torch's own choice)"
                           ).parse_args(argv)
    config = CoreBenchConfig.preset(args.quick, args.repeats, args.threads)
    return run_measured("core benchmark", args, lambda progress: run_core(config, progress),
                        lambda result: [render(result)])


if __name__ == "__main__":
    sys.exit(main())
