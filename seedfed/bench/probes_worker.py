"""One probe-benchmark case per process: `python -m seedfed.bench.probes_worker CASE ...`.

Prints one JSON object on the last line of stdout. A case builds its model and scope, warms the
feature cache, then measures peak RSS (inference, then each mode and P in increasing order of
memory, the allocator trimmed and the high-water mark reset before each) and time (modes
interleaved per P and repeat, so background load hits both alike). `sweep` times P = 8 for
scopes whose lowest perturbed tensor sits higher and higher in MiniLM.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from seedfed.bench.core_setup import SMOLLM_135M, peak_rss_mb, reset_peak

LR, EPS = 1e-9, 1e-3
MINILM_BATCH, MAX_LEN = 16, 64
LLAMA_SHAPE = replace(SMOLLM_135M, seq_len=64)  # batch 8 x 64 tokens
TOP = "layer.5."
#: MiniLM cases: scope name -> (TaskSpec scope, options, LoRA targets or None, format).
MINILM_CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...] | None, str]] = {
    "head": ("named", {"patterns": ("classifier",)}, None, "fp32"),
    "lora_top": ("lora", {}, (f"{TOP}attention.self.query", f"{TOP}attention.self.value"),
                 "fp32"),
    "lora_all": ("lora", {}, ("query", "value"), "fp32"),
    "int8_scales_top": ("scales", {"layers": (f"encoder.{TOP}",), "include": ("classifier",)},
                        None, "int8"),
}
#: Depth sweep: LoRA (+ head) on modules whose lowest sits ever higher in the encoder.
SWEEP: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("lora q,v layers 0-5", ("query", "value")),
    ("lora q,v layer 2", ("layer.2.attention.self.query", "layer.2.attention.self.value")),
    ("lora q,v layer 4", ("layer.4.attention.self.query", "layer.4.attention.self.value")),
    ("lora q,v layer 5", (f"{TOP}attention.self.query", f"{TOP}attention.self.value")),
    ("lora attention.output.dense + output.dense layer 5",
     (f"{TOP}attention.output.dense", f"{TOP}output.dense")),
    ("lora output.dense layer 5", (f"{TOP}output.dense",)),
    ("head", None),
)


@dataclass
class Case:
    model: nn.Module
    scope: Any
    batch: dict[str, torch.Tensor]
    loss: Callable[..., torch.Tensor]
    losses: Callable[..., torch.Tensor]
    model_name: str


def _trim() -> None:
    """Give freed heap pages back, so the next high-water mark is the next work's own."""
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: peaks then include freed pages
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _minilm_base(quick: bool) -> tuple[Any, Any]:
    from seedfed.shared.model.classifier import MeanPoolClassifier
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.protocol.task import TaskSpec

    if quick:  # a tiny BERT from config: CI needs no checkpoint
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=6,
                         num_attention_heads=4, intermediate_size=64)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = MeanPoolClassifier(BertModel(cfg, add_pooling_layer=False), 2, True).eval()
        return model, None
    from seedfed.shared.protocol.recipes import default_model_path
    from seedfed.shared.protocol.scope_options import options_for

    spec = TaskSpec(model_path=str(default_model_path()), scope="named",
                    scope_options=options_for("named", {"patterns": ("classifier",)}),
                    label_texts=("It was terrible.", "It was great."), max_seq_len=MAX_LEN)
    bundle = build_model(spec, initialize=True)
    return bundle.model, bundle.tokenizer


def _minilm_batch(tokenizer: Any, quick: bool) -> dict[str, torch.Tensor]:
    from seedfed.client.data import tokenize
    from seedfed.client.preference import preference_examples

    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 200, (MINILM_BATCH, 16), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.arange(MINILM_BATCH) % 2}
    ex = preference_examples(MINILM_BATCH, seed=0)
    return tokenize(tokenizer, ex.texts, ex.labels, MAX_LEN)


def _adapt(base: Any, targets: tuple[str, ...] | None, scope_kind: str,
           options: dict[str, Any], fmt: str) -> tuple[nn.Module, Any]:
    """The base MiniLM with this case's adapters / quantization and scope (as build_model)."""
    from seedfed.shared.model.classifier import MeanPoolClassifier, frozen_prefix_depth
    from seedfed.shared.model.lora import apply_lora
    from seedfed.shared.model.quant.model import QuantConfig, quantize_model
    from seedfed.shared.model.scopes import build_scope
    from seedfed.shared.protocol.task import LoraOptions

    model = copy.deepcopy(base)
    model.clear_cache()
    if targets is not None:
        model = apply_lora(model, LoraOptions(r=8, target_modules=targets), "seq_cls")
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # a trained-looking adapter (B = 0 is version 0)
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    if fmt == "int8":
        model = quantize_model(model, QuantConfig(bits=8, group_size=64 if base.config
                                                  .hidden_size % 64 == 0 else 16))
    for p in model.parameters():
        p.requires_grad_(False)
    scope = (build_scope(scope_kind, model, **options) if targets is None
             else build_scope("lora", model))
    inner = getattr(getattr(model, "base_model", model), "model", model)
    if isinstance(inner, MeanPoolClassifier):
        inner.frozen_prefix = frozen_prefix_depth(model, scope)
    return model.eval(), scope


def build_case(name: str, quick: bool) -> Case:
    from seedfed.shared.model.objectives import (
        causal_lm_loss,
        causal_lm_losses,
        classification_loss,
        classification_losses,
    )

    if name == "lora_r8":
        return _llama_case(quick, causal_lm_loss, causal_lm_losses)
    base, tokenizer = _minilm_base(quick)
    batch = _minilm_batch(tokenizer, quick)
    scope_kind, options, targets, fmt = MINILM_CASES[name]
    model, scope = _adapt(base, targets, scope_kind, options, fmt)
    del base
    return Case(model, scope, batch, classification_loss, classification_losses,
                "minilm-tiny" if quick else "minilm")


def _llama_case(quick: bool, loss: Any, losses: Any) -> Case:
    from seedfed.bench.core_setup import QUICK, build_model, make_batch
    from seedfed.shared.model.lora import apply_lora
    from seedfed.shared.model.scopes import build_scope
    from seedfed.shared.protocol.task import LoraOptions

    shape = QUICK if quick else LLAMA_SHAPE
    model = apply_lora(build_model(shape), LoraOptions(r=8, target_modules=("q_proj", "v_proj")),
                       "causal_lm")
    for p in model.parameters():
        p.requires_grad_(False)
    return Case(model, build_scope("lora", model), make_batch(shape), loss, losses,
                shape.name)


@contextlib.contextmanager
def _whole_forward(model: nn.Module) -> Any:
    """MeZO's probe: every forward runs the whole model (the feature cache switched off)."""
    from seedfed.shared.model.classifier import MeanPoolClassifier

    inner = next((m for m in model.modules() if isinstance(m, MeanPoolClassifier)), None)
    depth = inner.frozen_prefix if inner is not None else 0
    if inner is not None:
        inner.frozen_prefix = 0
    try:
        yield
    finally:
        if inner is not None:
            inner.frozen_prefix = depth


def _stepper(case: Case, mode: str) -> Callable[[list[int]], Any]:
    """One ZO step of `mode`: `mezo` (two whole forwards per seed, MeZO's estimator),
    `sequential` (the same through the model's frozen-prefix feature cache), `shared` (the
    probe engine, prefix shared, one copy per forward) or `batched` (shared + stacked copies)."""
    from seedfed.client.probes import ProbeEngine, engine_step
    from seedfed.shared.model.estimator import ZOConfig, spsa_step
    from seedfed.shared.model.perturb import Perturber

    perturber = Perturber(case.scope)
    engine = ProbeEngine(case.model, case.scope, case.loss,
                         case.losses if mode == "batched" else None,
                         share_prefix=mode not in ("sequential", "mezo"), perturber=perturber)

    def loss_fn() -> float:
        with torch.no_grad():
            return float(case.loss(case.model, case.batch))

    def step(seeds: list[int]) -> Any:
        config = ZOConfig(lr=LR, eps=EPS, perturbations=len(seeds))
        state = case.scope.read()
        try:
            if mode == "mezo":
                with _whole_forward(case.model):
                    return spsa_step(case.scope, loss_fn, seeds, config, perturber)
            if mode == "sequential":
                return spsa_step(case.scope, loss_fn, seeds, config, perturber)
            return engine_step(engine, case.batch, seeds, config)
        finally:
            case.scope.write(state)

    return step


def _seeds(p: int, rep: int) -> list[int]:
    return [1000 * rep + 17 * i + 1 for i in range(p)]


def measure(name: str, ps: list[int], repeats: int, quick: bool,
            modes: tuple[str, ...] | None = None) -> dict[str, Any]:
    case = build_case(name, quick)
    # MeZO's whole-model probes are the baseline of the MiniLM cases (the Llama has no cache).
    modes = modes or (("mezo", "sequential", "batched") if name in MINILM_CASES
                      else ("sequential", "batched"))
    steppers = {m: _stepper(case, m) for m in modes}
    for m in modes:  # warm-up: the feature cache holds the batch, lazy inits are done
        steppers[m](_seeds(1, 99))
    with torch.no_grad():
        case.loss(case.model, case.batch)
    _trim()
    reset_peak()
    with torch.no_grad():
        case.loss(case.model, case.batch)
    inference = peak_rss_mb()
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for m in modes:
        for p in ps:
            _trim()
            reset_peak()
            res = steppers[m](_seeds(p, 98))
            rows[(m, p)] = {"model": case.model_name, "scope": name, "mode": m, "P": p,
                            "peak_mb": peak_rss_mb(), "inference_peak_mb": inference,
                            "copies_per_forward": getattr(res, "copies_per_forward", 1),
                            "model_calls": getattr(res, "model_calls", 2 * p), "samples": []}
    for rep in range(repeats):
        for p in ps:
            for m in modes if rep % 2 == 0 else tuple(reversed(modes)):
                t = time.perf_counter()
                steppers[m](_seeds(p, rep))
                rows[(m, p)]["samples"].append((time.perf_counter() - t) * 1e3 / p)
    out = []
    for row in rows.values():
        row["ms_per_scalar"] = statistics.median(row["samples"])
        row["peak_vs_inference"] = row["peak_mb"] / row["inference_peak_mb"]
        out.append(row)
    return {"case": name, "inference_peak_mb": inference, "results": out,
            "batch": {k: list(v.shape) for k, v in case.batch.items()}}


def sweep(p: int, repeats: int, quick: bool) -> dict[str, Any]:
    from seedfed.shared.model.objectives import classification_loss, classification_losses

    base, tokenizer = _minilm_base(quick)
    batch = _minilm_batch(tokenizer, quick)
    out = []
    for label, targets in SWEEP:
        model, scope = _adapt(base, targets, "named", {"patterns": ("classifier",)}, "fp32")
        case = Case(model, scope, batch, classification_loss, classification_losses, "minilm")
        modes = ("sequential", "shared", "batched")
        steppers = {m: _stepper(case, m) for m in modes}
        for m in modes:
            steppers[m](_seeds(1, 99))
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(repeats):
            for m in modes:
                t = time.perf_counter()
                steppers[m](_seeds(p, rep))
                samples[m].append((time.perf_counter() - t) * 1e3 / p)
        for m in modes:
            out.append({"scope": label, "mode": m, "P": p,
                        "ms_per_scalar": statistics.median(samples[m]), "samples": samples[m]})
        del model, scope, case, steppers
        _trim()
    return {"case": "sweep", "results": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=[*MINILM_CASES, "lora_r8", "sweep"])
    parser.add_argument("--p", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ps = [int(v) for v in args.p.split(",") if v]
    if args.case == "sweep":
        result = sweep(8, args.repeats, args.quick)
    else:
        result = measure(args.case, ps, args.repeats, args.quick)
    result["threads"] = torch.get_num_threads()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
