"""Device peak memory of a ZO step on float, LoRA, quantized and ternary models, next to
inference and first-order AdamW.

Every configuration runs in its own subprocess (a fresh interpreter, so one configuration's
allocations never inflate another's peak). The worker builds the model from a config (Llama,
random weights from an explicit generator; quantized models are built layer by layer from the
meta device, so they never exist in float), records its resident set, resets the kernel's peak
counter (/proc/self/clear_refs, 5) and runs the action once:

- `infer`: one no-grad forward + next-token cross-entropy on the batch;
- `zo`: one two-point SPSA step (P = 1, sequential probes) with `spsa_step`: scope `full` for
  fp32/bf16 (MeZO, virtual perturbation), `lora` for fp32-lora (peft LoRA r=8 on q_proj and
  v_proj), `scales` for int8/int4 (QZO, DDC clip 100), `ternary` for the packed BitNet model
  (TerMeZO, threshold mask of 1%);
- `adamw`: one first-order AdamW step in fp32 (forward, backward, optimizer state).

The ternary model is the one a device holds: `build_packed_model` builds it from a Hugging Face
directory without its fp32 ternary matrices, and the coordinator's published snapshot fills the
packed codes (both written once per model by a preparing subprocess). Its `infer` row holds the
codes alone (an inference-only device); its `zo` row also the masked latents and their indices.

`step_peak_mib` (VmHWM after the reset: resident model + everything the action touched) is the
device figure; `process_peak_mib` also covers building the model. Ratios use step peaks; the
targets (`TARGETS`) bound four of them.

    seedfed bench quant_memory                       # ~1B Llama, batch 1x64, + small-model point
    seedfed bench quant_memory --model smollm-135m   # LM_ROWS on one model, batch 1x64
    seedfed bench quant_memory --model smollm-135m --batch 1,4 --json out.json
    seedfed bench quant_memory --quick               # tiny model, every row, ~2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from seedfed.bench.registry import RESULTS, bench_parser, positive_int
from seedfed.bench.report import write_json

MODELS: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B shape: 1.10e9 parameters, untied head.
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "llama-small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    "llama-tiny": dict(vocab_size=8000, hidden_size=256, intermediate_size=704,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    # SmolLM-135M shape: 1.35e8 parameters, the LM head tied to the embeddings (its largest
    # tensor, 49152 x 576).
    "smollm-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        tie_word_embeddings=True),
}
FORMATS = ("fp32", "bf16", "int8", "int4", "fp32-lora", "ternary")
#: The rows of the default points: float and int8/int4 formats beside fp32 AdamW.
ROWS: tuple[tuple[str, str], ...] = (
    ("fp32", "infer"), ("fp32", "zo"), ("bf16", "infer"), ("int8", "infer"), ("int8", "zo"),
    ("int4", "infer"), ("int4", "zo"), ("fp32", "adamw"),
)
#: The rows of `--model`: each ZO step beside the inference its target compares it with.
LM_ROWS: tuple[tuple[str, str], ...] = (
    ("fp32", "infer"), ("fp32", "zo"), ("fp32-lora", "infer"), ("fp32-lora", "zo"),
    ("int4", "infer"), ("int4", "zo"), ("ternary", "infer"), ("ternary", "zo"),
)
#: `--quick`: every row once, on the tiny model.
QUICK_ROWS = ROWS + tuple(r for r in LM_ROWS if r not in ROWS)
#: ratio label -> (numerator row, denominator row).
RATIOS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "fp32_zo / fp32_infer": (("fp32", "zo"), ("fp32", "infer")),
    "fp32-lora_zo / fp32_infer": (("fp32-lora", "zo"), ("fp32", "infer")),
    "fp32-lora_zo / fp32-lora_infer": (("fp32-lora", "zo"), ("fp32-lora", "infer")),
    "int4_zo / int4_infer": (("int4", "zo"), ("int4", "infer")),
    "ternary_zo / ternary_infer": (("ternary", "zo"), ("ternary", "infer")),
    "int4_zo / fp32_zo": (("int4", "zo"), ("fp32", "zo")),
    "int8_zo / fp32_zo": (("int8", "zo"), ("fp32", "zo")),
    "int8_zo / int8_infer": (("int8", "zo"), ("int8", "infer")),
    "fp32_adamw / fp32_zo": (("fp32", "adamw"), ("fp32", "zo")),
}
#: The product's bounds on a ZO step's peak over inference's (ternary: over packed inference).
TARGETS: dict[str, float] = {
    "fp32_zo / fp32_infer": 1.05,
    "fp32-lora_zo / fp32_infer": 1.05,
    "int4_zo / int4_infer": 1.05,
    "ternary_zo / ternary_infer": 1.10,
}
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")
#: Where the preparing subprocess puts a ternary model: the Hugging Face directory a device
#: builds its packed model from, and the snapshot the coordinator publishes.
BASE_DIR = "base"
SNAPSHOT_FILE = "snapshot.safetensors"


@dataclass(frozen=True)
class Spec:
    model: str
    fmt: str
    action: str
    batch: int
    seq: int
    group_size: int = 64
    #: fmt "ternary": the directory `prepare_ternary` wrote.
    directory: str | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODELS)}")
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown format {self.fmt!r}; known: {FORMATS}")
        if self.action not in ("infer", "zo", "adamw"):
            raise ValueError(f"unknown action {self.action!r}")
        if self.action == "adamw" and self.fmt != "fp32":
            raise ValueError("AdamW is measured in fp32 only")
        if (self.fmt == "ternary") != (self.directory is not None):
            raise ValueError("a ternary row, and only a ternary row, reads a prepared directory")


# ----------------------------------------------------------------------------- worker side

def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) / 1024


def _trim_heap() -> bool:
    """Hand the heap's free memory back to the kernel (glibc `malloc_trim`). Building a model
    frees float layers and temporaries that would otherwise stay resident: the ready figure
    would vary by tens of MiB between identical builds, and a step could reuse those pages
    without its peak showing them."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.malloc_trim(0) >= 0)
    except (OSError, AttributeError):
        return False


def _fault_in(tensors: Any) -> None:
    """Read every tensor once. A ternary device's float tensors (embeddings, norms, LM head)
    map its base model's safetensors file, so their pages become resident only when a forward
    first reads them; read now, the ready figure holds the whole model as for other rows (the
    step peak is the same either way)."""
    for t in tensors:
        if t.numel():
            t.detach().sum()


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _config(model: str, seq: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{"tie_word_embeddings": False, **MODELS[model]},
                       max_position_embeddings=max(2048, seq))


def _float_model(model: str, seq: int, dtype: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from seedfed.shared.model.quant import materialize_rest

    with torch.device("meta"):
        llama = LlamaForCausalLM(_config(model, seq))
    materialize_rest(llama, torch.Generator().manual_seed(0), dtype)
    return llama.eval()


def _build(spec: Spec) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from seedfed.shared.model.quant import QuantConfig, build_quantized

    if spec.fmt == "ternary":
        assert spec.directory is not None
        return _packed_ternary(Path(spec.directory), with_latents=spec.action == "zo")
    if spec.fmt in ("int8", "int4"):
        quant = QuantConfig(bits=8 if spec.fmt == "int8" else 4, group_size=spec.group_size)
        return build_quantized(_config(spec.model, spec.seq), quant, model_cls=LlamaForCausalLM,
                               seed=0)
    model = _float_model(spec.model, spec.seq,
                         torch.bfloat16 if spec.fmt == "bf16" else torch.float32)
    if spec.fmt == "fp32-lora":
        from seedfed.shared.model.lora import apply_lora, init_adapters
        from seedfed.shared.protocol.task import LoraOptions

        model = apply_lora(model, LoraOptions(r=LORA_RANK, target_modules=LORA_TARGETS),
                           "causal_lm")
        init_adapters(model, torch.Generator().manual_seed(2))
    return model


def _packed_ternary(directory: Path, with_latents: bool) -> Any:
    """The packed model a ternary device holds after loading the published snapshot; without
    latents, an inference-only device's (codes and gammas, no mask or masked latents)."""
    from safetensors import safe_open

    from seedfed.shared.model.ternary import (
        bitlinear_modules,
        build_packed_model,
        load_published_ternary,
    )
    from seedfed.shared.protocol.scope_options import TernaryOptions

    model = build_packed_model(directory / BASE_DIR)
    f: Any
    with safe_open(str(directory / SNAPSHOT_FILE), framework="pt", device="cpu") as f:
        names: list[str] = f.keys()
        # Only the tensors the row holds are read: a dropped buffer could stay resident.
        tensors = {k: f.get_tensor(k) for k in names
                   if with_latents or k.rpartition(".")[2] in ("packed", "gamma", "bias")}
    if with_latents:
        load_published_ternary(model, tensors, config=TernaryOptions().mask, epoch=0)
    else:
        for name, m in bitlinear_modules(model):
            m.load_packed(tensors[f"{name}.packed"], tensors[f"{name}.gamma"],
                          bias=tensors.get(f"{name}.bias"))
    return model


def prepare_ternary(model: str, directory: Path) -> dict[str, Any]:
    """Write what a ternary device of `model` starts from: the Hugging Face directory of the
    random fp32 model (`BASE_DIR`; the device reads its embeddings, norms and head) and the
    coordinator's published snapshot of its ternary scope (`SNAPSHOT_FILE`: codes, gammas,
    threshold masks of the task defaults and the masked latents)."""
    import torch
    from safetensors.torch import save_file

    from seedfed.shared.model.scopes import build_scope
    from seedfed.shared.model.ternary import TernaryScope, publish_ternary

    llama = _float_model(model, 2048, torch.float32)
    llama.save_pretrained(directory / BASE_DIR)
    scope = build_scope("ternary", llama)  # Linear -> BitLinear (LM head kept), masks chosen
    assert isinstance(scope, TernaryScope)
    save_file(publish_ternary(scope.read(), scope), str(directory / SNAPSHOT_FILE))
    return dict(device_bytes=scope.device_bytes(), masked_latents=scope.numel)


def _parameter_count(model: Any) -> int:
    """Weights of the model as a float model counts them (quantized and packed layers by
    their shape)."""
    from seedfed.shared.model.quant import QuantLinear
    from seedfed.shared.model.ternary import BitLinear

    n = 0
    seen: set[int] = set()  # a tied LM head counts once
    for m in model.modules():
        if isinstance(m, (QuantLinear, BitLinear)):
            n += m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
            continue
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n


def _scope_kind(fmt: str) -> str:
    return {"fp32": "full", "bf16": "full", "fp32-lora": "lora", "ternary": "ternary"}.get(
        fmt, "scales")


def _zo_temporaries(scope: Any, mode: str) -> dict[str, float]:
    """What a ZO step holds beyond inference by construction: a virtual probe swaps in one
    perturbed copy of a whole tensor at a time (the largest bounds it), and the step keeps the
    z words of every whole tensor (1 bit per element) for the probes and the update; a copy
    step stashes the scope."""
    from seedfed.shared.protocol.philox import BLOCK_ELEMENTS

    whole = [t.numel for t in scope if t.indices is None]
    words = sum(4 * -(-n // BLOCK_ELEMENTS) for n in whole)
    return dict(largest_copy_mib=4 * max(whole, default=0) / 2**20 if mode == "virtual" else 0.0,
                z_words_mib=8 * words / 2**20 if mode == "virtual" else 0.0,
                stash_mib=4 * scope.numel / 2**20 if mode == "copy" else 0.0)


def _run(spec: Spec, model: Any) -> dict[str, Any]:
    import torch

    from seedfed.shared.model.estimator import ZOConfig, spsa_step
    from seedfed.shared.model.objectives import causal_lm_loss
    from seedfed.shared.model.perturb import Perturber
    from seedfed.shared.model.quant import plan_clip
    from seedfed.shared.model.scopes import build_scope

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (spec.batch, spec.seq), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    info: dict[str, Any] = {}
    if spec.action == "infer":
        with torch.no_grad():
            info["loss"] = float(causal_lm_loss(model, batch))
    elif spec.action == "zo":
        kind = _scope_kind(spec.fmt)
        for p in model.parameters():
            p.requires_grad_(False)
        # The ternary model's scope came with its snapshot; building it again re-covers the
        # same masked latents (packed layers keep the mask they loaded).
        scope = build_scope(kind, model)
        perturber = Perturber(scope, "auto")
        config = ZOConfig(lr=1e-6, eps=1e-3, clip=plan_clip(kind, None), mode=perturber.mode)

        def loss_fn() -> float:
            with torch.no_grad():
                return float(causal_lm_loss(model, batch))

        res = spsa_step(scope, loss_fn, [12345], config, perturber)
        info.update(scope=kind, scope_numel=scope.numel, mode=perturber.mode,
                    loss=res.loss, g=float(res.g[0]), **_zo_temporaries(scope, perturber.mode))
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        loss = causal_lm_loss(model, batch)
        loss.backward()
        opt.step()
        info["loss"] = float(loss)
    return info


def worker(spec: Spec) -> dict[str, Any]:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    baseline = _status_mib("VmRSS")
    t0 = time.perf_counter()
    model = _build(spec)
    build_s = time.perf_counter() - t0
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    model_mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    _fault_in(tensors)
    build_peak = _status_mib("VmHWM")
    trimmed = _trim_heap()
    ready = _status_mib("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    info = _run(spec, model)
    action_s = time.perf_counter() - t0
    step_peak = _status_mib("VmHWM")
    logits_mib = spec.batch * spec.seq * model.config.vocab_size * 4 / 2**20
    return dict(spec=asdict(spec), params=_parameter_count(model), model_mib=model_mib,
                logits_mib=logits_mib, baseline_mib=baseline, ready_mib=ready,
                build_peak_mib=build_peak,
                step_peak_mib=step_peak if reset else max(step_peak, build_peak),
                process_peak_mib=max(build_peak, step_peak), peak_reset=reset, trimmed=trimmed,
                build_s=build_s, action_s=action_s, **info)


# ----------------------------------------------------------------------------- driver side

def _subprocess(flag: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "seedfed.bench.quant_memory", flag, json.dumps(payload)]
    # TORCHDYNAMO_DISABLE: transformers' BitNet helpers (imported by the ternary code) run
    # eagerly, as on a device; every row gets it, so the rows share one environment.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout:.0f} s")
    if done.returncode != 0:
        return dict(error=done.stderr.strip().splitlines()[-1:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(spec: Spec, timeout: float, repeats: int = 1) -> dict[str, Any]:
    """The row's result with the median step peak of `repeats` runs (each a fresh process:
    the kernel's peak counter moves by several MiB between identical runs)."""
    runs = []
    for _ in range(repeats):
        result = _subprocess("--worker", asdict(spec), timeout)
        if "error" in result:
            return dict(spec=asdict(spec), **result)
        runs.append(result)
    runs.sort(key=lambda r: r["step_peak_mib"])
    median = dict(runs[(len(runs) - 1) // 2])
    median["step_peak_runs_mib"] = [r["step_peak_mib"] for r in runs]
    return median


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    peak = {(r["spec"]["fmt"], r["spec"]["action"]): r["step_peak_mib"]
            for r in rows if "step_peak_mib" in r}
    return {label: peak[a] / peak[b] for label, (a, b) in RATIOS.items()
            if a in peak and b in peak}


def targets(ratios: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each measured ratio that has a target: the ratio, its bound and whether it is met."""
    return {label: dict(ratio=ratios[label], target=bound, met=ratios[label] <= bound)
            for label, bound in TARGETS.items() if label in ratios}


def adamw_estimate(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Lower bound for fp32 AdamW when it is not run: inference peak + grads + two moments."""
    infer = next((r for r in rows if r["spec"]["fmt"] == "fp32" and r["spec"]["action"] == "infer"
                  and "step_peak_mib" in r), None)
    if infer is None:
        return None
    extra = 3 * 4 * infer["params"] / 2**20
    return dict(step_peak_mib_lower_bound=infer["step_peak_mib"] + extra,
                how="fp32 inference step peak + 12 bytes/parameter (gradients, exp_avg, "
                    "exp_avg_sq); activations kept for backward not included")


def print_table(title: str, rows: list[dict[str, Any]], ratios: dict[str, float]) -> None:
    print(f"\n{title}")
    print(f"{'format':<9} {'action':<6} {'scope':<7} {'model MiB':>10} {'ready MiB':>10} "
          f"{'step peak MiB':>14} {'process peak':>13} {'seconds':>8}")
    for r in rows:
        s = r["spec"]
        if "error" in r:
            print(f"{s['fmt']:<9} {s['action']:<6} error: {r['error']}")
            continue
        print(f"{s['fmt']:<9} {s['action']:<6} {r.get('scope', '-'):<7} {r['model_mib']:>10.0f} "
              f"{r['ready_mib']:>10.0f} {r['step_peak_mib']:>14.0f} "
              f"{r['process_peak_mib']:>13.0f} {r['action_s']:>8.1f}")
    judged = targets(ratios)
    for label, v in ratios.items():
        line = f"  {label:<31} {v:.3f}"
        if label in judged:
            verdict = "met" if judged[label]["met"] else "MISSED"
            line += f"   target <= {judged[label]['target']:.2f}  {verdict}"
        print(line)


def _sizes(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive integers ("1,4")."""
    return tuple(positive_int(part) for part in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("quant_memory")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="tiny model, every row (smoke test)")
    which.add_argument("--model", choices=sorted(MODELS),
                       help="one model: fp32 full, fp32 LoRA, int4 scales and packed ternary ZO "
                            "steps beside their inference (default: llama-1b and llama-small "
                            "points, float and int8/int4 rows)")
    parser.add_argument("--batch", type=_sizes, default=(1,),
                        help="with --model: batch sizes, comma separated (default 1)")
    parser.add_argument("--seq", type=positive_int, default=64,
                        help="with --model: tokens per sequence (default 64)")
    parser.add_argument("--adamw-large", action="store_true",
                        help="also run fp32 AdamW on the large model (needs ~20 GiB)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs per row; the row reports the median step peak (default 1)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per configuration")
    parser.add_argument("--json", "--out", dest="out", type=Path, default=None,
                        help="where to write the results (default: benchmarks/results/"
                             "quant_memory[_quick|_MODEL].json)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(Spec(**json.loads(args.worker)))))
        return 0
    if args.prepare:
        job = json.loads(args.prepare)
        print(json.dumps(prepare_ternary(job["model"], Path(job["directory"]))))
        return 0

    # (model, batch, seq, rows, with AdamW)
    points: list[tuple[str, int, int, tuple[tuple[str, str], ...], bool]]
    if args.quick:
        points = [("llama-tiny", 1, 64, QUICK_ROWS, True)]
    elif args.model:
        points = [(args.model, b, args.seq, LM_ROWS, False) for b in args.batch]
    else:
        points = [("llama-1b", 1, 64, ROWS, args.adamw_large),
                  ("llama-small", 16, 256, ROWS, True)]
    report: dict[str, Any] = {"benchmark": "quant_memory", "quick": args.quick,
                              "group_size": args.group_size, "threads": 2,
                              "repeats": args.repeats, "points": []}
    with tempfile.TemporaryDirectory(prefix="seedfed-quant-memory-") as tmp:
        prepared: dict[str, dict[str, Any]] = {}
        for model, batch, seq, row_set, with_adamw in points:
            rows = []
            for fmt, action in row_set:
                if action == "adamw" and not with_adamw:
                    continue
                directory = None
                if fmt == "ternary":
                    directory = str(Path(tmp) / model)
                    if model not in prepared:
                        print(f"  preparing {model} ternary ...", file=sys.stderr, flush=True)
                        Path(directory).mkdir()
                        prepared[model] = _subprocess("--prepare", dict(
                            model=model, directory=directory), args.timeout)
                spec = Spec(model, fmt, action, batch, seq, args.group_size, directory)
                if directory is not None and "error" in prepared[model]:
                    rows.append(dict(spec=asdict(spec), error=prepared[model]["error"]))
                    continue
                print(f"  running {model} {fmt} {action} batch {batch}x{seq} ...",
                      file=sys.stderr, flush=True)
                rows.append(measure(spec, args.timeout, args.repeats))
            ratios = _ratios(rows)
            point: dict[str, Any] = dict(model=model, batch=batch, seq=seq, rows=rows,
                                         ratios=ratios, targets=targets(ratios))
            if model in prepared:
                point["ternary"] = prepared[model]
            if not with_adamw:
                point["adamw_fp32_estimate"] = adamw_estimate(rows)
            report["points"].append(point)
            print_table(f"{model}  batch {batch} x {seq} tokens", rows, ratios)
            if not with_adamw and point["adamw_fp32_estimate"]:
                est = point["adamw_fp32_estimate"]
                print(f"  fp32 AdamW (not run) >= {est['step_peak_mib_lower_bound']:.0f} MiB: "
                      f"{est['how']}")
    default = ("quant_memory_quick.json" if args.quick else
               f"quant_memory_{args.model}.json" if args.model else "quant_memory.json")
    out = args.out or RESULTS / default
    write_json(out, report, newline=False)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
