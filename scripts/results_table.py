"""The README's results table, generated from the benchmark results in benchmarks/results/.

Each row names what was measured, reads its figures from the JSON files a benchmark wrote, and
shows the command that writes those files, so a figure in the README always equals its source
and re-running the command (then `--write`) updates it.

    python scripts/results_table.py                    # print the markdown table
    python scripts/results_table.py --check README.md  # exit 1 when README.md's table differs
    python scripts/results_table.py --write README.md  # replace README.md's table

The table sits between the lines `<!-- results:begin -->` and `<!-- results:end -->`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
HEADER = ("| measure | result | command that measures it |\n"
          "|---|---|---|")

Results = dict[str, Any]


class TableError(Exception):
    """A results file or a README that the table cannot be built from or written into."""


@dataclass(frozen=True)
class Row:
    """One line of the table: `result` turns the named JSON files (by file stem) into text."""

    measure: str
    sources: tuple[str, ...]
    commands: tuple[str, ...]  # run in this order, they write the sources
    result: Callable[[dict[str, Results]], str]

    @property
    def command_text(self) -> str:
        return "; ".join(f"`{c}`" for c in self.commands)


def _get(data: Results, *path: str | int) -> Any:
    """data[path[0]][path[1]]...; a missing key names the whole path in the error."""
    node: Any = data
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError) as e:
            raise KeyError("/".join(map(str, path))) from e
    return node


def _load(stem: str, results: Path) -> Results:
    path = results / f"{stem}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise TableError(f"{path}: missing; run the command of its row in "
                         f"scripts/results_table.py to write it") from e
    except json.JSONDecodeError as e:
        raise TableError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, dict):
        raise TableError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_note(data: Results) -> str:
    """'; N cores at load average L' where the benchmark recorded its machine's load."""
    cpus, load = data.get("cpus"), data.get("load_avg_1m")
    if load is None and isinstance(data.get("env"), dict):
        cpus, ends = data["env"].get("cpus"), data["env"].get("loadavg_end")
        load = ends[0] if ends else None
    if load is None:
        return ""
    return f"; {cpus} cores at load average {load:.1f}"


def _sst2(r: dict[str, Results]) -> str:
    d = r["accuracy_head_cosine_p512"]
    runs = _get(d, "repeats", "fed_zo_head", "accuracy")
    curve = _get(d, "methods", "fed_zo_head")
    v0 = _get(curve, "points", 0, "accuracy")
    return (f"test accuracy {v0:.3f} -> **{sum(runs) / len(runs):.3f}** (mean of "
            f"{len(runs)} training runs: {', '.join(f'{a:.3f}' for a in runs)}); "
            f"{_get(curve, 'extra', 'rounds')} rounds, {curve['wall_seconds']:.0f} s a run on "
            f"{d['torch_threads']} thread")


def _quant(r: dict[str, Results]) -> str:
    q = r["accuracy_quant_cosine_p512"]
    fp32 = _get(r["accuracy_head_cosine_p512"], "repeats", "fed_zo_head", "accuracy", 0)
    int8 = _get(q, "methods", "fed_zo_head_int8", "final_accuracy")
    int4 = _get(q, "methods", "fed_zo_head_int4", "final_accuracy")
    return (f"int8 **{int8:.3f}**, int4 **{int4:.3f}**, against {fp32:.3f} for fp32 with the "
            f"same seeds (one training run each)")


def _personal(r: dict[str, Results]) -> str:
    runs = {run["method"]: run for run in _get(r["personalization"], "tasks", "tastes")}
    p = _get(runs, "residual", "personalization")
    same_upload = _get(runs, "residual", "upload_bytes") == _get(runs, "off", "upload_bytes")
    return (f"held-out accuracy, mean of {p['devices']} devices: shared model "
            f"{p['shared_accuracy_mean']:.3f}, personalized **{p['personal_accuracy_mean']:.3f}**,"
            f" local-only {p['local_accuracy_mean']:.3f}; "
            f"{p['share_personal_at_least_shared']:.0%} of devices at least as good "
            f"personalized; upload bytes {'equal to' if same_upload else 'NOT equal to'} "
            f"a run without personalization")


def _ternary(r: dict[str, Results]) -> str:
    s = _get(r["ternary_fed_b32"], "summary", "head")
    return (f"test accuracy {s['initial_mean']:.3f} -> **{s['final_mean']:.3f}** +- "
            f"{s['final_sd']:.3f} ({len(s['seeds'])} seeds, +{s['lift_points']:.1f} points); "
            f"{s['seconds_mean'] / 60:.0f} min a run")


def _ternary_memory(r: dict[str, Results]) -> str:
    m = _get(r["ternary_memory_head_b32"], "memory", "head")
    fp32 = "holds" if m["holds_fp32_weights"] else "never holds"
    return (f"ZO step peak **{m['zo_over_infer']:.3f} x** packed inference "
            f"({m['zo_peak_mib']:.0f} vs {m['infer_peak_mib']:.0f} MiB); the device {fp32} "
            f"fp32 weights")


def _core(r: dict[str, Results]) -> str:
    d = r["core_quiet"]
    return (f"ZO step peak **{d['zo_vs_inference_mem']:.2f} x** inference "
            f"({d['memory_detail']['zo_virtual']['peak_mb']:.0f} vs "
            f"{d['inference_peak_mb']:.0f} MB); SGD {d['sgd_vs_inference_mem']:.2f} x, "
            f"AdamW {d['adamw_vs_inference_mem']:.2f} x{_load_note(d)}")


def _upload(r: dict[str, Results]) -> str:
    row = _get(r["flower_bytes"], "rows", 0)
    return (f"{row['scalars']} scalars: {row['payload_bytes']} B of reply content, "
            f"**{row['ratio_head']:.3f} x** FedAvg of the 770-parameter head, "
            f"{row['ratio_lora']:.4f} x of LoRA, {row['ratio_full']:.1e} x of the whole model")


def _ort(r: dict[str, Results]) -> str:
    d = r["ort_device"]
    t, o = d["torch"], d["ort"]
    return (f"**{o['ms_per_scalar']:.2f} vs {t['ms_per_scalar']:.2f} ms** per scalar, peak RSS "
            f"{o['peak_rss_mb']:.0f} vs {t['peak_rss_mb']:.0f} MB, install "
            f"{_get(d, 'install', 'ort', 'mb'):.0f} vs {_get(d, 'install', 'torch', 'mb'):,.0f} MB"
            f" (ONNX Runtime vs torch); scalars within {d['max_abs_scalar_diff']:.1e}")


def _fleet_size(r: dict[str, Results]) -> str:
    d = r["fleet_size"]
    runs = {(x["engine"], x["devices"]): x for x in _get(d, "runs")}
    sizes = sorted({n for _, n in runs})
    parts = []
    for engine in ("inprocess", "flower"):
        small, large = runs[(engine, sizes[0])], runs[(engine, sizes[-1])]
        ratio = _get(d, "summary", engine, "round_ratio_largest_to_smallest")
        parts.append(f"{engine}: {small['round_s_median_after_first']:.1f} s a round with "
                     f"{sizes[0]:,} devices, {large['round_s_median_after_first']:.1f} s with "
                     f"{sizes[-1]:,} (**{ratio:.2f} x**)")
    return (f"{d['per_round']} devices a round, median round time; " + "; ".join(parts))


def _fleet_steps(r: dict[str, Results]) -> str:
    d = r["fleet_steps"]
    rows = {x["scope"]: x for x in _get(d, "results")}
    rates = ", ".join(f"{scope} **{rows[scope]['device_steps_per_s']:.1f}**"
                      for scope in ("head", "lora", "full") if scope in rows)
    exact = all(x["bit_exact_vs_plain_device"] for x in rows.values())
    batched = rows.get("head", {}).get("batched")
    together = ("" if batched is None else
                f"; the head with every device's probes in one batched matmul "
                f"**{batched['device_steps_per_s']:.1f}** ({batched['speedup']:.1f} x, replay "
                f"{'bit-exact' if batched['replay_bit_exact'] else 'NOT bit-exact'})")
    return (f"device-steps per second on the {d['torch_device']} ({d['threads']} thread, "
            f"{d['devices']} devices sharing one model): {rates}{together}; "
            f"{'every device bit-exact with a lone device' if exact else 'NOT bit-exact'}")


def _lm_memory(r: dict[str, Results]) -> str:
    parts = []
    for point in _get(r["lm_memory"], "points"):
        t = point["targets"]
        judged = ", ".join(f"{name} **{t[key]['ratio']:.3f} x**"
                           + ("" if t[key]["met"] else " (missed)")
                           for name, key in (("fp32 full", "fp32_zo / fp32_infer"),
                                             ("LoRA", "fp32-lora_zo / fp32_infer"),
                                             ("int4 scales", "int4_zo / int4_infer"),
                                             ("ternary", "ternary_zo / ternary_infer"))
                           if key in t)
        parts.append(f"batch {point['batch']} x {point['seq']}: {judged}")
    return ("ZO step peak / inference peak (ternary: / packed inference; targets 1.05, 1.1): "
            + "; ".join(parts))


def _keyboard_runs(r: dict[str, Results]) -> dict[str, Results]:
    return {run["format"]: run for stem in ("lm_keyboard_float", "lm_keyboard_low")
            for run in _get(r[stem], "runs")}


def _lm_keyboard(r: dict[str, Results]) -> str:
    run = _keyboard_runs(r)["fp32-lora"]
    s, curve = run["summary"], run["curve"]
    return (f"{_get(r['lm_keyboard_float'], 'split')} next-word top-3, mean of "
            f"{len(run['devices'])} devices: shared {s['shared_top3']:.3f}, personalized "
            f"**{s['personal_top3']:.3f}** ({s['personal_minus_shared_top3_points']:+.2f} "
            f"points; {s['not_worse_share']:.0%} of devices not worse), local-only "
            f"{s['local_top3']:.3f}; shared perplexity {curve[0]['shared_perplexity']:.2f} "
            f"(round {curve[0]['round']}) -> {curve[-1]['shared_perplexity']:.2f} (round "
            f"{curve[-1]['round']}); upload {run['upload_bytes_per_round']} B of scalars a "
            "round, with or without the personal part")


def _lm_formats(r: dict[str, Results]) -> str:
    runs = _keyboard_runs(r)
    base = runs["fp32-lora"]["summary"]
    parts = []
    for name in ("int4-lora", "int4-scales", "ternary"):
        if name in runs:
            s = runs[name]["summary"]
            parts.append(f"{name}: shared {s['shared_top3']:.3f}, personalized "
                         f"**{s['personal_top3']:.3f}** "
                         f"({100 * (s['personal_top3'] - base['personal_top3']):+.2f} points "
                         "vs fp32)")
    return (f"personalized next-word top-3 (fp32 LoRA {base['personal_top3']:.3f}); "
            + "; ".join(parts))


def _lm_labels(r: dict[str, Results]) -> str:
    d = r["lm_labels"]
    runs = {x["method"]: x for x in _get(d, "runs")}
    parts = [f"{name} {runs[name]['curve'][0]['accuracy']:.3f} -> "
             f"**{runs[name]['final']:.3f}**" for name in runs]
    return (f"{d['split']} accuracy at {d['args']['forwards']} forward passes each: "
            + "; ".join(parts) + " (a base that has never seen a label)")


def _ingest(r: dict[str, Results]) -> str:
    d = r["ingest"]
    parts = []
    for res in d["results"]:
        if res["mode"] == "open loop 1000/s":
            parts.append(f"{res['backend']} {res['uploads_per_s']:,.0f} uploads/s, "
                         f"p99 **{res['p99_ms']:.1f} ms**")
    if not parts:
        raise KeyError("results/<mode 'open loop 1000/s'>")
    return (f"offered 1,000 uploads/s from {d['results'][0]['clients']} connections: "
            f"{'; '.join(parts)}{_load_note(d)}")


def _crash(r: dict[str, Results]) -> str:
    parts = []
    for stem in ("crash_sqlite", "crash_postgres"):
        res = _get(r[stem], "results", 0)
        same = res["replayed_ok"] == res["versions"]
        parts.append(f"{res['backend']}: {res['kills']} kills, {res['receipts']:,} acknowledged "
                     f"uploads, **{res['lost']} lost**, {res['duplicate_rows']} duplicated, "
                     f"{'every' if same else 'NOT every'} version equal to its replay"
                     f"{_load_note(r[stem])}")
    return "; ".join(parts)


def _fuzz(r: dict[str, Results]) -> str:
    d = r["fuzz"]
    return (f"{d['requests']:,} requests over {d['operations']} operations: "
            f"**{d['server_errors']} server errors**, {d['violations']} schema violations, "
            f"{d['server_tracebacks']} tracebacks")


SST2 = "PATH/sst2/train.tsv"
#: The keyboard benchmark's runs: formats split over two processes (2 cores), test split.
KEYBOARD_FLOAT, KEYBOARD_LOW = "fp32-lora,int4-lora", "int4-scales,ternary"
KEYBOARD_ARGS = ("--rounds 10 --perturbations 8 --personal-steps 8 --eval-every 2 "
                 "--split test")
LABELS_ARGS = "--forwards 2048 --lr 0.1 --head-lr 0.3 --eval-size 1000 --split test"

ROWS: tuple[Row, ...] = (
    Row("SST-2 sentiment: federated ZO with the shipped recipe (MiniLM-L6 head, 20 "
        "Dirichlet(0.5) devices, all every round)",
        ("accuracy_head_cosine_p512",),
        (f"seedfed bench accuracy --data {SST2} --methods fed_zo_head --repeats 3 "
         "--threads 1 --eval-every 50 --out benchmarks/results/accuracy_head_cosine_p512.json",),
        _sst2),
    Row("the same recipe on an int8 / int4 shared model",
        ("accuracy_quant_cosine_p512", "accuracy_head_cosine_p512"),
        (f"seedfed bench accuracy --data {SST2} --methods "
         "fed_zo_head_int8,fed_zo_head_int4 --threads 1 --eval-every 50 "
         "--out benchmarks/results/accuracy_quant_cosine_p512.json",),
        _quant),
    Row("personalization on the per-device-taste task (`seedfed simulate`'s default)",
        ("personalization",),
        (f"seedfed bench personalization --sst2 {SST2}",),
        _personal),
    Row("a ternary (BitNet b1.58) MiniLM: the ternary recipe on SST-2",
        ("ternary_fed_b32",),
        (f"seedfed ternarize --data {SST2} --out runs/ternary-minilm",
         f"seedfed bench ternary_fed --data {SST2} --model runs/ternary-minilm "
         "--seeds 0,1,2 --variants head,threshold+head --batch-size 32 "
         "--json benchmarks/results/ternary_fed_b32.json"),
        _ternary),
    Row("memory of a packed ternary device's ZO step (that recipe)",
        ("ternary_memory_head_b32",),
        (f"seedfed bench ternary_fed --data {SST2} --model runs/ternary-minilm "
         "--variants head --batch-size 32 --memory-only "
         "--json benchmarks/results/ternary_memory_head_b32.json",),
        _ternary_memory),
    Row("memory of a ZO step of every weight, SmolLM-135M-shaped Llama, batch 8 x 128",
        ("core_quiet",),
        ("seedfed bench core --json benchmarks/results/core_quiet.json",),
        _core),
    Row("memory of a ZO step on a SmolLM-135M-shaped Llama (fp32 full, LoRA r 8, int4 "
        "scales, packed ternary)",
        ("lm_memory",),
        ("seedfed bench quant_memory --model smollm-135m --batch 1,4 --repeats 3 "
         "--json benchmarks/results/lm_memory.json",),
        _lm_memory),
    Row("next-word personalization: 20 writers (topic x sentiment mixes of SST-2 sentences "
        "the base never saw), a 5.3M-parameter Llama made here, fp32 LoRA, 10 rounds",
        ("lm_keyboard_float", "lm_keyboard_low"),
        (f"seedfed lm-base --data {SST2} --out runs/lm-base",
         f"seedfed bench lm_keyboard --data {SST2} --base runs/lm-base --formats "
         f"{KEYBOARD_FLOAT} {KEYBOARD_ARGS} --json benchmarks/results/lm_keyboard_float.json",
         f"seedfed bench lm_keyboard --data {SST2} --base runs/lm-base --formats "
         f"{KEYBOARD_LOW} {KEYBOARD_ARGS} --json benchmarks/results/lm_keyboard_low.json"),
        _lm_keyboard),
    Row("the same fleet on int4 (LoRA over the int4 base; scales) and ternary shared models",
        ("lm_keyboard_float", "lm_keyboard_low"),
        (f"seedfed bench lm_keyboard --data {SST2} --base runs/lm-base --formats "
         f"{KEYBOARD_LOW} {KEYBOARD_ARGS} --json benchmarks/results/lm_keyboard_low.json",),
        _lm_formats),
    Row("label words beside a linear head on the same small Llama, SST-2 labels",
        ("lm_labels",),
        (f"seedfed bench lm_labels --data {SST2} --base runs/lm-base {LABELS_ARGS} "
         "--json benchmarks/results/lm_labels.json",),
        _lm_labels),
    Row("upload per device and round (4 steps x 4 seeds)",
        ("flower_bytes",),
        ("seedfed bench flower_bytes --json benchmarks/results/flower_bytes.json",),
        _upload),
    Row("a device without torch (`--backend ort`), the shipped SST-2 recipe, one thread",
        ("ort_device",),
        (f"seedfed bench ort_device --data {SST2} --rounds 12",),
        _ort),
    Row("fleets of any size: 100 to 10,000 devices on SST-2, 100 a round",
        ("fleet_size",),
        (f"seedfed bench fleet_size --data {SST2} --json benchmarks/results/fleet_size.json",),
        _fleet_size),
    Row("virtual devices sharing one process and torch device (MiniLM-L6; head P=512, LoRA "
        "P=32, full P=8)",
        ("fleet_steps",),
        ("seedfed bench fleet_steps --device cpu --threads 1 --batch-devices",),
        _fleet_steps),
    Row("coordinator upload ingestion (20 scalars an upload)",
        ("ingest",),
        ("seedfed bench ingest --db sqlite postgres --uploads 20000 --rate 1000 2000 0 "
         "--json benchmarks/results/ingest.json",),
        _ingest),
    Row("SIGKILL campaign against a coordinator under upload load",
        ("crash_sqlite", "crash_postgres"),
        ("seedfed bench crash --db sqlite --kills 100 "
         "--json benchmarks/results/crash_sqlite.json",
         "seedfed bench crash --db postgres --kills 100 "
         "--json benchmarks/results/crash_postgres.json"),
        _crash),
    Row("schema-driven fuzzing of the REST API (schemathesis, SQLite)",
        ("fuzz",),
        ("seedfed bench fuzz --requests 30000 --seed 2026 "
         "--json benchmarks/results/fuzz.json",),
        _fuzz),
)


def render(results: Path = RESULTS, rows: tuple[Row, ...] = ROWS) -> str:
    """The markdown table, one line per row; raises TableError naming the file at fault."""
    lines = [HEADER]
    cache: dict[str, Results] = {}
    for row in rows:
        for stem in row.sources:
            if stem not in cache:
                cache[stem] = _load(stem, results)
        try:
            result = row.result(cache)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise TableError(f"{', '.join(s + '.json' for s in row.sources)} in {results}: "
                             f"no usable figure for {row.measure!r} ({type(e).__name__}: "
                             f"{e}); re-run {row.command_text}") from e
        lines.append(f"| {row.measure} | {result} | {row.command_text} |")
    return "\n".join(lines) + "\n"


def _split(text: str, where: Path) -> tuple[str, str, str]:
    """(before the table, the table, from the end marker on)."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < 0 or end < begin or text.count(BEGIN) > 1 or text.count(END) > 1:
        raise TableError(f"{where}: needs one line {BEGIN} and, after it, one line {END} "
                         f"around the results table")
    start = begin + len(BEGIN) + 1  # the table starts on the line after the marker
    return text[:start], text[start:end], text[end:]


def check(readme: Path, table: str) -> bool:
    """True when `readme`'s table equals `table`."""
    return _split(readme.read_text(), readme)[1] == table


def write(readme: Path, table: str) -> None:
    """Replace `readme`'s table with `table`, leaving the rest of the file as it is."""
    before, _, after = _split(readme.read_text(), readme)
    readme.write_text(before + table + after)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", type=Path, metavar="README",
                      help="exit 1 when this file's table differs from the results")
    mode.add_argument("--write", type=Path, metavar="README",
                      help="replace this file's table with the one built from the results")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="folder of the benchmark JSON files (default: benchmarks/results)")
    args = ap.parse_args(argv)
    try:
        table = render(args.results)
        if args.check:
            if check(args.check, table):
                return 0
            print(f"error: the results table in {args.check} differs from {args.results}; "
                  f"run `python scripts/results_table.py --write {args.check}`", file=sys.stderr)
            return 1
        if args.write:
            write(args.write, table)
            return 0
    except (TableError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
