"""One core-benchmark measurement per process: `python -m seedfed.bench.core_worker KIND ...`.

Prints one JSON object on the last line of stdout. Memory kinds (inference, zo_virtual, zo_copy,
sgd, adamw) do the common setup, reset the RSS high-water mark, run the work `STEPS` times and
report the peak; `speed` times a forward pass against ZO steps in both perturbation modes,
interleaved so background load hits them alike; `replay` times seed replay against MeZO-style
regeneration and plain axpy on one large tensor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn

from seedfed.bench.core_setup import (
    build_model,
    make_batch,
    peak_rss_mb,
    reset_peak,
    rss_mb,
    shape_named,
)

if TYPE_CHECKING:
    from seedfed.shared.model.estimator import Mode

MEMORY_KINDS = ("inference", "zo_virtual", "zo_copy", "sgd", "adamw")
#: The work is repeated so an optimizer's lazily created state and a second step count too.
STEPS = 2
LR, EPS = 1e-6, 1e-3
#: Seeds fused into one replay pass for `replay_fused_mparam_s`.
FUSED_SEEDS = 16


def _zo_step_fn(model: torch.nn.Module, loss_fn: Callable[[], float],
                mode: str) -> Callable[[int], None]:
    from seedfed.shared.model.estimator import ZOConfig, spsa_step
    from seedfed.shared.model.perturb import Perturber
    from seedfed.shared.model.scopes import build_scope

    scope = build_scope("full", model)
    config = ZOConfig(lr=LR, eps=EPS, perturbations=1, mode=cast("Mode", mode))
    perturber = Perturber(scope, config.mode)

    def step(seed: int) -> None:
        spsa_step(scope, loss_fn, [seed], config, perturber)

    return step


def _model_and_loss(shape_name: str) -> tuple[nn.Module, Any, Callable[[], float]]:
    """The shape's model, its fixed batch, and the no-grad forward loss on that batch."""
    from seedfed.shared.model.objectives import causal_lm_loss

    shape = shape_named(shape_name)
    model = build_model(shape)
    batch = make_batch(shape)

    def loss_fn() -> float:
        with torch.no_grad():
            return float(causal_lm_loss(model, batch))

    return model, batch, loss_fn


def _work(kind: str, shape_name: str) -> Callable[[int], None]:
    from seedfed.shared.model.objectives import causal_lm_loss

    model, batch, loss_fn = _model_and_loss(shape_name)
    if kind == "inference":
        return lambda _seed: None if loss_fn() else None
    if kind in ("zo_virtual", "zo_copy"):
        return _zo_step_fn(model, loss_fn, kind.removeprefix("zo_"))
    optimizer: torch.optim.Optimizer
    if kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    elif kind == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        raise ValueError(f"unknown benchmark kind {kind!r}")

    def backprop_step(_seed: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        causal_lm_loss(model, batch).backward()
        optimizer.step()

    return backprop_step


def measure_memory(kind: str, shape_name: str) -> dict[str, object]:
    work = _work(kind, shape_name)
    baseline = rss_mb()
    reset_ok = reset_peak()
    for step in range(STEPS):
        work(step + 1)
    peak = peak_rss_mb()
    return {"kind": kind, "baseline_mb": baseline, "peak_mb": peak, "delta_mb": peak - baseline,
            "peak_reset": reset_ok}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_speed(shape_name: str, repeats: int) -> dict[str, object]:
    model, _, loss_fn = _model_and_loss(shape_name)
    steps = {mode: _zo_step_fn(model, loss_fn, mode) for mode in ("virtual", "copy")}
    loss_fn()  # warm-up: first-call allocations and kernel selection are not what we compare
    for step in steps.values():
        step(0)
    times: dict[str, list[float]] = {"forward": [], "virtual": [], "copy": []}
    for r in range(repeats):  # interleaved, so background load hits every variant alike
        times["forward"].append(_timed(loss_fn))
        for mode, step in steps.items():
            start = time.perf_counter()
            step(r + 1)
            times[mode].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"kind": "speed", "forward_s": med["forward"], "zo_step_s": med["virtual"],
            "zo_step_copy_s": med["copy"], "samples": times, "threads": torch.get_num_threads()}


def measure_replay(numel: int, n_seeds: int, repeats: int) -> dict[str, object]:
    """Parameters x seeds per second of: plain axpy (the bandwidth limit of one pass per
    seed), MeZO's torch regeneration, replay one seed per pass, and replay of FUSED_SEEDS
    seeds fused into one pass (the C kernel; `numpy_fused` is the same call on the numpy
    path, the fallback)."""
    from seedfed.shared.model import stream
    from seedfed.shared.protocol import philox

    gen = np.random.default_rng(0)
    seeds = [int(s) for s in gen.integers(0, 2**63, size=max(n_seeds, FUSED_SEEDS))]
    coefs = [float(c) for c in gen.normal(0, 1e-4, size=len(seeds)).astype(np.float32)]
    x = torch.zeros(numel, dtype=torch.float32)
    y = torch.ones(numel, dtype=torch.float32)
    buf = torch.empty(numel, dtype=torch.float32)
    tid = philox.tensor_id("bench.replay.weight")

    def axpy() -> None:  # y precomputed: only the memory traffic of x += c * y remains
        for c in coefs[:n_seeds]:
            x.add_(y, alpha=c)

    def mezo() -> None:  # MeZO regenerates z with torch's generator for every seed
        g = torch.Generator()
        for s, c in zip(seeds[:n_seeds], coefs[:n_seeds], strict=True):
            g.manual_seed(s)
            buf.normal_(generator=g)
            x.add_(buf, alpha=c)

    def replay() -> None:  # one seed per pass over the tensor
        for s, c in zip(seeds[:n_seeds], coefs[:n_seeds], strict=True):
            stream.add_seeds_(x, "bench.replay.weight", [s], [c])

    def fused() -> None:
        stream.add_seeds_(x, "bench.replay.weight", seeds[:FUSED_SEEDS], coefs[:FUSED_SEEDS])

    def numpy_fused() -> None:
        stream.add_dense_numpy(x, x, tid, seeds[:FUSED_SEEDS], coefs[:FUSED_SEEDS])

    variants = {"axpy": axpy, "mezo": mezo, "replay": replay, "fused": fused,
                "numpy_fused": numpy_fused}
    work = {k: numel * (FUSED_SEEDS if "fused" in k else n_seeds) / 1e6 for k in variants}
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            times[k].append(_timed(fn))
    rate = {k: work[k] / statistics.median(v) for k, v in times.items()}
    return {"kind": "replay", "numel": numel, "seeds": n_seeds, "fused_seeds": FUSED_SEEDS,
            "replay_mparam_s": rate["replay"], "replay_fused_mparam_s": rate["fused"],
            "replay_numpy_fused_mparam_s": rate["numpy_fused"],
            "mezo_replay_mparam_s": rate["mezo"], "axpy_mparam_s": rate["axpy"],
            "kernel": stream.KERNEL is not None, "samples": times,
            "threads": torch.get_num_threads()}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m seedfed.bench.core_worker")
    parser.add_argument("kind", choices=(*MEMORY_KINDS, "speed", "replay"))
    parser.add_argument("--shape", default="quick", help="model shape: full or quick")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--numel", type=int, default=1 << 22, help="replay tensor size")
    parser.add_argument("--seeds", type=int, default=20, help="seeds per replayed entry")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    return parser


def main(argv: list[str]) -> dict[str, object]:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kind in MEMORY_KINDS:
        return measure_memory(args.kind, args.shape)
    if args.kind == "speed":
        return measure_speed(args.shape, args.repeats)
    return measure_replay(args.numel, args.seeds, args.repeats)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
