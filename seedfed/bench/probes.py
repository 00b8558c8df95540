"""`seedfed bench probes`: time per scalar and peak memory of sequential vs batched ZO probes.

Each case runs in its own process (`probes_worker`), so one case's freed pages cannot hide
another's peak. Cases: on MiniLM (batch 16) the head, LoRA on the top layer's query/value,
LoRA on every layer's query/value and the int8 scales of the top layer (QZO); on a
SmolLM-135M-shaped Llama built from config (batch 8 x 64), LoRA r=8 on q/v of every layer.
Modes: `mezo` is MeZO's estimator (two forwards of the whole model per seed; MiniLM cases
only), `sequential` is today's `spsa_step` (the same forwards through the model's own
frozen-prefix feature cache, so a probe runs only the layers at and above the lowest
perturbed tensor), `batched` is `seedfed.client.probes` (shared prefix + stacked copies within
the default memory budget). The speed target is read against both baselines: for LoRA on the
top layer the cache already removes five of six layers, and what is left is the layer whose
matmuls every copy must run. A depth sweep times P = 8 for scopes whose lowest perturbed
tensor sits ever higher in MiniLM (with `shared` = prefix sharing, one copy per forward,
beside them).
`--quick` swaps in tiny models built from config (CI: under a minute, no checkpoint).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from seedfed.bench.core import measured_parser, run_measured, run_worker

MINILM_CASES = ("head", "lora_top", "lora_all", "int8_scales_top")
LLAMA_CASE = "lora_r8"
P_VALUES = (1, 2, 4, 8, 16, 32)
QUICK_P = (1, 2, 4)
#: The targets: (what, limit).
TARGET_SPEED = 0.5  # batched P=8 / sequential ms per scalar, LoRA on MiniLM's top layer
TARGET_MEMORY = 1.10  # batched step peak / inference peak


def _worker(case: str, ps: tuple[int, ...], repeats: int, threads: int | None, quick: bool,
            timeout: float = 7200) -> dict[str, Any]:
    args: list[object] = [case, "--p", ",".join(map(str, ps)), "--repeats", repeats,
                          "--threads", threads or 0, *(["--quick"] if quick else [])]
    return run_worker("seedfed.bench.probes_worker", args, f"probe benchmark worker {case}",
                      timeout)


def _row(results: list[dict[str, Any]], scope: str, mode: str, p: int) -> dict[str, Any] | None:
    for r in results:
        if r["scope"] == scope and r["mode"] == mode and r["P"] == p:
            return r
    return None


def run_probes(quick: bool = False, repeats: int | None = None, threads: int | None = None,
               ps: tuple[int, ...] | None = None, llama_ps: tuple[int, ...] | None = None,
               sweep: bool = True, progress: Any = None) -> dict[str, Any]:
    """Run every case and return the JSON object (`inference_peak_mb`, `results`, ...)."""
    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    started = time.time()
    repeats = repeats or (1 if quick else 3)
    ps = ps or (QUICK_P if quick else P_VALUES)
    llama_ps = llama_ps or ps
    results: list[dict[str, Any]] = []
    inference: dict[str, float] = {}
    batches: dict[str, Any] = {}
    for case in (*MINILM_CASES, LLAMA_CASE):
        say(case)
        out = _worker(case, llama_ps if case == LLAMA_CASE else ps, repeats, threads, quick)
        for r in out["results"]:
            r.pop("samples", None) if quick else None
        results += out["results"]
        key = f"{out['results'][0]['model']}/{case}"
        inference[key] = out["inference_peak_mb"]
        batches[key] = out["batch"]
    result: dict[str, Any] = {"inference_peak_mb": inference, "results": results,
                              "batches": batches, "quick": quick, "repeats": repeats}
    if sweep:
        say("depth sweep")
        result["depth_sweep"] = _worker("sweep", (8,), repeats, threads, quick)["results"]
    p_target = 8 if 8 in ps else max(ps)
    bat = _row(results, "lora_top", "batched", p_target)
    result["targets"] = {}
    for base, label in (("sequential", "sequential (cached prefix)"),
                        ("mezo", "MeZO's sequential (whole model)")):
        seq = _row(results, "lora_top", base, p_target)
        speed = bat["ms_per_scalar"] / seq["ms_per_scalar"] if seq and bat else float("nan")
        result["targets"][f"lora_top_batched_vs_{base}"] = {
            "value": speed, "limit": f"<= {TARGET_SPEED}", "met": speed <= TARGET_SPEED,
            "what": f"LoRA on MiniLM's top layer: batched P={p_target} ms per scalar / {label}"}
    worst = max(r["peak_vs_inference"] for r in results if r["mode"] == "batched")
    result["targets"] |= {
        "batched_peak_vs_inference": {
            "value": worst, "limit": f"<= {TARGET_MEMORY}", "met": worst <= TARGET_MEMORY,
            "what": "worst batched step peak RSS / the case's inference peak RSS"},
    }
    result["env"] = {"python": platform.python_version(), "machine": platform.machine(),
                     "cpus": os.cpu_count(), "threads": threads,
                     "loadavg_end": os.getloadavg(), "wall_s": time.time() - started}
    return result


def render(result: dict[str, Any]) -> Any:
    """A rich table: per case and P, both modes side by side, then the depth sweep."""
    from rich.table import Table

    table = Table(title="seedfed probe benchmark (ms per scalar, peak RSS)")
    for col in ("model", "scope", "P", "mezo ms", "seq ms", "batched ms", "ratio",
                "copies/fwd", "seq peak MB", "batched peak MB", "x inference"):
        table.add_column(col, justify="left" if col in ("model", "scope") else "right")
    results = result["results"]
    for r in results:
        if r["mode"] != "sequential":
            continue
        b = _row(results, r["scope"], "batched", r["P"])
        if b is None:
            continue
        mezo = _row(results, r["scope"], "mezo", r["P"])
        table.add_row(r["model"], r["scope"], str(r["P"]),
                      f"{mezo['ms_per_scalar']:.2f}" if mezo else "-", f"{r['ms_per_scalar']:.2f}",
                      f"{b['ms_per_scalar']:.2f}", f"{b['ms_per_scalar'] / r['ms_per_scalar']:.2f}",
                      str(b["copies_per_forward"]), f"{r['peak_mb']:.0f}", f"{b['peak_mb']:.0f}",
                      f"{b['peak_vs_inference']:.3f}")
    tables = [table]
    if result.get("depth_sweep"):
        sweep = Table(title="MiniLM, P = 8: ms per scalar as the lowest perturbed tensor rises")
        for col in ("scope", "sequential", "shared", "batched", "batched / sequential"):
            sweep.add_column(col, justify="left" if col == "scope" else "right")
        rows: dict[str, dict[str, float]] = {}
        for r in result["depth_sweep"]:
            rows.setdefault(r["scope"], {})[r["mode"]] = r["ms_per_scalar"]
        for scope, v in rows.items():
            sweep.add_row(scope, f"{v['sequential']:.2f}", f"{v['shared']:.2f}",
                          f"{v['batched']:.2f}", f"{v['batched'] / v['sequential']:.2f}")
        tables.append(sweep)
    verdicts = Table(title="targets")
    for col in ("target", "value", "limit", "met"):
        verdicts.add_column(col)
    for t in result["targets"].values():
        verdicts.add_row(t["what"], f"{t['value']:.3f}", t["limit"],
                         "[green]met[/]" if t["met"] else "[red]MISSED[/]")
    tables.append(verdicts)
    return tables


def p_list(text: str) -> tuple[int, ...]:
    """`--p 1,2,4` as a tuple of perturbation counts, each >= 1."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"perturbation counts must be >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, write JSON (`run_measured`)."""
    parser = measured_parser("probes", "tiny models from config, P 1,2,4",
                             "torch threads per worker")
    parser.add_argument("--p", type=p_list, default=None,
                        help="perturbation counts (default 1,2,4,8,16,32)")
    parser.add_argument("--llama-p", type=p_list, default=None,
                        help="perturbation counts for the Llama case (default: --p)")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="MiniLM depth sweep at P 8")
    args = parser.parse_args(argv)
    return run_measured(
        "probe benchmark", args,
        lambda progress: run_probes(args.quick, args.repeats, args.threads, args.p,
                                    args.llama_p, args.sweep, progress=progress),
        render)


if __name__ == "__main__":
    sys.exit(main())
