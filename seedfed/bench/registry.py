"""The benchmarks that `seedfed bench NAME` runs: each name, its module, one line on what it
measures.

Every benchmark is the module `seedfed.bench.NAME` with `main(argv: list[str] | None) -> int`
(its own argparse options, exit status returned), so `seedfed bench NAME ARGS...` and
`python -m seedfed.bench.NAME ARGS...` are the same run. A module is imported only when it
runs: listing the names needs none of the benchmarks' dependencies (torch, matplotlib, flwr,
schemathesis, psycopg).

The JSON results quoted in README.md and docs/ live in `RESULTS`, relative to the current
directory: run the benchmarks from the repository's root to refresh them.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

#: Where a benchmark writes its JSON (and PNG) by default, relative to the current directory.
RESULTS = Path("benchmarks/results")

#: name -> what it measures (one line, shown by `seedfed bench list` and `--help`).
BENCHMARKS: dict[str, str] = {
    "core": "ZO step memory vs inference, SGD and AdamW; ZO step vs forward time; replay "
            "throughput",
    "probes": "sequential vs batched ZO probes: ms per scalar and peak memory, per scope and P",
    "accuracy": "SST-2 test accuracy of federated ZO (the real round code) beside zero-shot, "
                "a linear probe and first-order baselines",
    "head_sweep": "fast sweep of the head-only ZO recipe on cached MiniLM embeddings (tuning)",
    "body_sweep": "body scopes on SST-2: first-order ceilings, federated ZO, probe cost",
    "body_coherence": "gradient coherence and curvature of body scopes at the head's optimum",
    "personalization": "the personal part beside personalized-FL baselines, per device",
    "byzantine": "each aggregation rule's training when 10-30% of the devices lie",
    "catchup": "the versions behind at which a snapshot download beats log replay",
    "aggregate_cost": "cost of aggregating a round vs regenerating its perturbations",
    "fleet_size": "round wall time and memory of `seedfed simulate` as the fleet grows",
    "fleet_steps": "ZO device-steps per second of virtual devices sharing one process and "
                   "torch device (head, LoRA, full), bit-exact against a plain device",
    "flower_bytes": "bytes a device uploads per round over Flower, next to FedAvg's",
    "ort_device": "the ONNX Runtime device beside the torch device: ms per scalar, RSS, install",
    "quant_memory": "device peak memory of a ZO step on int8/int4 models vs inference and AdamW "
                    "(--model smollm-135m: fp32 full and LoRA, int4 scales, packed ternary)",
    "ternary": "TerMeZO on ternary (BitNet b1.58) models: loss curves by mask, device memory",
    "ternary_fed": "federated TerMeZO on a ternary classifier: which latents to train",
    "ternary_lm": "federated TerMeZO on a ternary causal LM: held-out perplexity",
    "lm_labels": "label words beside a linear head on the same small causal LM, at equal "
                 "forward passes (validation accuracy)",
    "lm_keyboard": "next-word personalization on a fleet of writers: per-device perplexity and "
                   "top-3, shared vs personalized vs local-only, per shared-model format",
    "ingest": "coordinator upload ingestion: throughput and latency on loopback",
    "crash": "SIGKILL a real coordinator under uploads: no accepted upload lost or doubled",
    "fuzz": "schemathesis against a real coordinator: no 5xx, every answer in the OpenAPI "
            "contract",
}


def bench_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of benchmark `name`: its command and its line of BENCHMARKS."""
    return argparse.ArgumentParser(prog=f"seedfed bench {name}", description=BENCHMARKS[name])


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def load(name: str) -> Callable[[list[str] | None], int]:
    """The `main` of benchmark `name` (a KeyError names an unknown one)."""
    if name not in BENCHMARKS:
        raise KeyError(name)
    module = importlib.import_module(f"seedfed.bench.{name}")
    main: Callable[[list[str] | None], int] = module.main
    return main


def listing() -> str:
    """One line per benchmark: its name and what it measures."""
    width = max(map(len, BENCHMARKS))
    return "\n".join(f"{name:<{width}}  {what}" for name, what in BENCHMARKS.items())
