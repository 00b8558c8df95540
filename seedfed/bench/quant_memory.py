"""Device peak memory of a ZO step on quantized models, next to inference and first-order AdamW.

Every configuration runs in its own subprocess (a fresh interpreter, so one configuration's
allocations never inflate another's peak). The worker builds the model from a config (Llama,
random weights from an explicit generator; quantized models are built layer by layer from the
meta device, so they never exist in float), records its resident set, resets the kernel's peak
counter (/proc/self/clear_refs, 5) and runs the action once:

- `infer`: one no-grad forward + loss on the batch;
- `zo`: one two-point SPSA step (P = 1) with `spsa_step`: scope `full` for float models
  (MeZO, virtual perturbation), scope `scales` for int8/int4 (QZO, DDC clip 100);
- `adamw`: one first-order AdamW step in fp32 (forward, backward, optimizer state).

`step_peak_mib` (VmHWM after the reset: resident model + everything the action touched) is the
device figure; `process_peak_mib` also covers building the model. Ratios use step peaks.

    seedfed bench quant_memory            # ~1B Llama, batch 1x64, + small-model point
    seedfed bench quant_memory --quick    # tiny model, 8 subprocesses, 1-3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from seedfed.bench.registry import RESULTS, bench_parser
from seedfed.bench.report import write_json

MODELS: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B shape: 1.10e9 parameters, untied head.
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "llama-small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    "llama-tiny": dict(vocab_size=8000, hidden_size=256, intermediate_size=704,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
}
ROWS: tuple[tuple[str, str], ...] = (
    ("fp32", "infer"), ("fp32", "zo"), ("bf16", "infer"), ("int8", "infer"), ("int8", "zo"),
    ("int4", "infer"), ("int4", "zo"), ("fp32", "adamw"),
)


@dataclass(frozen=True)
class Spec:
    model: str
    fmt: str
    action: str
    batch: int
    seq: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODELS)}")
        if self.fmt not in ("fp32", "bf16", "int8", "int4"):
            raise ValueError(f"unknown format {self.fmt!r}")
        if self.action not in ("infer", "zo", "adamw"):
            raise ValueError(f"unknown action {self.action!r}")
        if self.action == "adamw" and self.fmt != "fp32":
            raise ValueError("AdamW is measured in fp32 only")


# ----------------------------------------------------------------------------- worker side

def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) / 1024


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _build(spec: Spec) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from seedfed.shared.model.quant import QuantConfig, build_quantized, materialize_rest

    config = LlamaConfig(**MODELS[spec.model], tie_word_embeddings=False,
                         max_position_embeddings=max(2048, spec.seq))
    if spec.fmt in ("int8", "int4"):
        quant = QuantConfig(bits=8 if spec.fmt == "int8" else 4, group_size=spec.group_size)
        return build_quantized(config, quant, model_cls=LlamaForCausalLM, seed=0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    dtype = torch.float32 if spec.fmt == "fp32" else torch.bfloat16
    materialize_rest(model, torch.Generator().manual_seed(0), dtype)
    return model.eval()


def _parameter_count(model: Any) -> int:
    from seedfed.shared.model.quant import QuantLinear

    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            n += m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
        else:
            n += sum(p.numel() for p in m.parameters(recurse=False))
    return n


def _run(spec: Spec, model: Any) -> dict[str, Any]:
    import torch

    from seedfed.client.trainer import causal_lm_loss
    from seedfed.shared.model.estimator import ZOConfig, spsa_step
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
        kind = "full" if spec.fmt in ("fp32", "bf16") else "scales"
        for p in model.parameters():
            p.requires_grad_(False)
        scope = build_scope(kind, model)
        perturber = Perturber(scope, "auto")
        config = ZOConfig(lr=1e-6, eps=1e-3, clip=plan_clip(kind, None), mode=perturber.mode)

        def loss_fn() -> float:
            with torch.no_grad():
                return float(causal_lm_loss(model, batch))

        res = spsa_step(scope, loss_fn, [12345], config, perturber)
        info.update(scope=kind, scope_numel=scope.numel, mode=perturber.mode,
                    loss=res.loss, g=float(res.g[0]))
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
    tensors = list(model.parameters()) + list(model.buffers())
    model_mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    build_peak = _status_mib("VmHWM")
    ready = _status_mib("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    info = _run(spec, model)
    action_s = time.perf_counter() - t0
    step_peak = _status_mib("VmHWM")
    return dict(spec=asdict(spec), params=_parameter_count(model), model_mib=model_mib,
                baseline_mib=baseline, ready_mib=ready, build_peak_mib=build_peak,
                step_peak_mib=step_peak if reset else max(step_peak, build_peak),
                process_peak_mib=max(build_peak, step_peak), peak_reset=reset,
                build_s=build_s, action_s=action_s, **info)


# ----------------------------------------------------------------------------- driver side

def measure(spec: Spec, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "seedfed.bench.quant_memory", "--worker", json.dumps(asdict(spec))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(spec=asdict(spec), error=f"timed out after {timeout:.0f} s")
    if done.returncode != 0:
        return dict(spec=asdict(spec), error=done.stderr.strip().splitlines()[-1:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    peak = {(r["spec"]["fmt"], r["spec"]["action"]): r["step_peak_mib"]
            for r in rows if "step_peak_mib" in r}
    out: dict[str, float] = {}
    pairs = {
        "int4_zo / fp32_zo": (("int4", "zo"), ("fp32", "zo")),
        "int4_zo / int4_infer": (("int4", "zo"), ("int4", "infer")),
        "int8_zo / fp32_zo": (("int8", "zo"), ("fp32", "zo")),
        "int8_zo / int8_infer": (("int8", "zo"), ("int8", "infer")),
        "fp32_zo / fp32_infer": (("fp32", "zo"), ("fp32", "infer")),
        "fp32_adamw / fp32_zo": (("fp32", "adamw"), ("fp32", "zo")),
    }
    for label, (a, b) in pairs.items():
        if a in peak and b in peak:
            out[label] = peak[a] / peak[b]
    return out


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
    print(f"{'format':<6} {'action':<6} {'scope':<7} {'model MiB':>10} {'ready MiB':>10} "
          f"{'step peak MiB':>14} {'process peak':>13} {'seconds':>8}")
    for r in rows:
        s = r["spec"]
        if "error" in r:
            print(f"{s['fmt']:<6} {s['action']:<6} error: {r['error']}")
            continue
        print(f"{s['fmt']:<6} {s['action']:<6} {r.get('scope', '-'):<7} {r['model_mib']:>10.0f} "
              f"{r['ready_mib']:>10.0f} {r['step_peak_mib']:>14.0f} "
              f"{r['process_peak_mib']:>13.0f} {r['action_s']:>8.1f}")
    for label, v in ratios.items():
        print(f"  {label:<24} {v:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("quant_memory")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny model only (smoke test)")
    parser.add_argument("--adamw-large", action="store_true",
                        help="also run fp32 AdamW on the large model (needs ~20 GiB)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(Spec(**json.loads(args.worker)))))
        return 0

    if args.quick:
        points = [("llama-tiny", 1, 64, True)]
    else:
        points = [("llama-1b", 1, 64, args.adamw_large), ("llama-small", 16, 256, True)]
    report: dict[str, Any] = {"benchmark": "quant_memory", "quick": args.quick,
                              "group_size": args.group_size, "threads": 2, "points": []}
    for model, batch, seq, with_adamw in points:
        rows = []
        for fmt, action in ROWS:
            if action == "adamw" and not with_adamw:
                continue
            spec = Spec(model, fmt, action, batch, seq, args.group_size)
            print(f"  running {model} {fmt} {action} ...", file=sys.stderr, flush=True)
            rows.append(measure(spec, args.timeout))
        ratios = _ratios(rows)
        point: dict[str, Any] = dict(model=model, batch=batch, seq=seq, rows=rows, ratios=ratios)
        if not with_adamw:
            point["adamw_fp32_estimate"] = adamw_estimate(rows)
        report["points"].append(point)
        print_table(f"{model}  batch {batch} x {seq} tokens", rows, ratios)
        if not with_adamw and point["adamw_fp32_estimate"]:
            est = point["adamw_fp32_estimate"]
            print(f"  fp32 AdamW (not run) >= {est['step_peak_mib_lower_bound']:.0f} MiB: "
                  f"{est['how']}")
    out = args.out or RESULTS / ("quant_memory_quick.json" if args.quick else "quant_memory.json")
    write_json(out, report, newline=False)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
