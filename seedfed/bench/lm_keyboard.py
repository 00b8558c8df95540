"""Next-word personalization on a fleet of writers (the keyboard case), per shared-model format.

The base is the small Llama `seedfed lm-base` pretrains on SST-2 training sentences (made
here if missing, cached). The fleet's owners write differently (`client.lm_fleet`: topic x
sentiment groups, a Dirichlet mixture per device, sentences the base never saw). Every device
is a real `Device` (torch backend) against an in-process coordinator: it syncs by replay,
trains the plan's ZO steps on next-token loss, uploads its scalars, and after the shared steps
trains its personal vocabulary bias (`client.personal_lm`) on its own text.

Per format (fp32 LoRA; int4 with LoRA over the quantized base; int4 `scales`), after the last
round, on each device's own held-out sentences: perplexity and next-word top-1 / top-3 of the
shared model, shared + personal, and the local-only bigram; the share of devices the personal
part leaves no worse; the bytes each device uploaded a round (one float32 per seed, whatever
the personal part). The shared model's perplexity on held-out sentences of the whole pool is
measured every `--eval-every` rounds. `--split validation` (the default, for tuning) scores a
validation cut of each device's text; `--split test` reads the held-out sentences once.

    seedfed bench lm_keyboard --data PATH/sst2/train.tsv --base runs/lm-base \\
        --json benchmarks/results/lm_keyboard.json
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from seedfed.bench.registry import bench_parser, positive_int
from seedfed.bench.report import write_json

#: format name -> (TaskSpec format, scope)
FORMATS: dict[str, tuple[str, str]] = {
    "fp32-lora": ("fp32", "lora"),
    "int4-lora": ("int4", "lora"),
    "int4-scales": ("int4", "scales"),
    "ternary": ("ternary", "ternary"),
}


def fleet_text(data: Path, base_sentences: int, seed: int, devices: int, train: int,
               held: int, split: str) -> Any:
    """The writers' text: the pool past the base's sentences, split into device text."""
    from seedfed.client.device_data import dataset_splits
    from seedfed.client.lm_fleet import writer_fleet
    from seedfed.ternarize import training_order

    splits = dataset_splits(str(data))
    order = training_order(len(splits.train), 0)
    pool = splits.train.subset(order[base_sentences:])
    fleet = writer_fleet(pool, devices, train_per_device=train, held_per_device=2 * held,
                         seed=seed)
    # validation: the first half of each device's held-out text; test: the second half
    part = slice(0, held) if split == "validation" else slice(held, 2 * held)
    return fleet.train, [h.subset(range(len(h))[part]) for h in fleet.held_out]


def run_format(name: str, base: Path, trains: list[Any], helds: list[Any], args: Any,
               ) -> dict[str, Any]:
    """One fleet on one format: rounds, then per-device scores."""
    import numpy as np

    from seedfed.client.device import Device, MemoryStore
    from seedfed.client.device_data import DeviceData, next_token_scores
    from seedfed.client.personal import PersonalConfig
    from seedfed.client.personal_lm import LMPersonalPart
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings
    from seedfed.shared.protocol.recipes import resolve_recipe
    from seedfed.shared.protocol.wire import Upload

    fmt, scope = FORMATS[name]
    given: dict[str, Any] = {"spec.format": fmt}
    given.update({f"hyper.{k}": getattr(args, k) for k in ("lr", "eps", "perturbations")
                  if getattr(args, k) is not None})
    if scope == "ternary":  # the recipe's TerMeZO settings (`recipes.LM_TERNARY_OPTIONS`)
        given = {"spec.format": fmt} | ({"hyper.lr": args.ternary_lr}
                                        if args.ternary_lr is not None else {})
    spec = resolve_recipe("lm-keyboard", given, model=str(base),
                          scope=scope if scope == "scales" else None).spec
    personal = PersonalConfig(method="residual", steps=args.personal_steps, lr=args.personal_lr,
                              decay=args.personal_decay, batch_size=32)
    work = Path(tempfile.mkdtemp(prefix=f"lm-keyboard-{name}-"))
    pooled = helds[0]
    for h in helds[1:]:
        pooled = type(h)(pooled.texts + h.texts, np.concatenate([pooled.labels, h.labels]))
    curve: list[dict[str, Any]] = []
    started = time.perf_counter()
    with Coordinator.open(Settings(database_url=f"sqlite:///{work / 'c.db'}",
                                   store_dir=work / "store")) as coord:
        task = coord.create_task(spec, secret=f"{args.seed:032x}")
        devices = [Device(spec, task, MemoryStore(), personal) for _ in trains]
        data = [DeviceData(source="lm-keyboard", partition_id=i, num_partitions=len(trains),
                           seed=args.seed) for i in range(len(trains))]
        upload_bytes = 0

        def shared_ppl() -> float:
            backend: Any = devices[0].backend
            return next_token_scores(backend.bundle, pooled).perplexity

        for rnd in range(1, args.rounds + 1):
            plan = coord.open_round(task)
            for dev, text, dd in zip(devices, trains, data, strict=True):
                _sync(coord, task, dev, plan.version)
                trained = dev.train(plan, text, dd)
                upload = Upload.build(plan, trained.scalars, trained.num_examples, trained.loss)
                upload_bytes = 4 * trained.scalars.size
                coord.submit(task, coord.enroll(task)[0], upload)
            coord.close_round(task)
            if rnd == 1 or rnd % args.eval_every == 0 or rnd == args.rounds:
                _sync(coord, task, devices[0], coord.task_status(task).version)
                curve.append({"round": rnd, "shared_perplexity": shared_ppl()})
                print(f"{name} round {rnd}: shared perplexity {curve[-1]['shared_perplexity']:.2f}"
                      f" ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        version = coord.task_status(task).version
        rows = []
        for dev, held in zip(devices, helds, strict=True):
            _sync(coord, task, dev, version)
            part = dev.personal
            assert isinstance(part, LMPersonalPart)
            s = part.scores(held)
            assert s is not None and s.local is not None
            rows.append({k: {"perplexity": c.perplexity, "top1": c.top1_accuracy,
                             "top3": c.top3_accuracy}
                         for k, c in (("shared", s.shared), ("personal", s.personal),
                                      ("local", s.local))} | {"active": part.active})
    v0 = curve[0]["shared_perplexity"] if curve else float("nan")
    return {"format": name, "spec_format": fmt, "scope": scope, "devices": rows,
            "curve": curve, "upload_bytes_per_round": upload_bytes,
            "wall_seconds": round(time.perf_counter() - started, 1),
            "summary": summarize(rows), "first_round_perplexity": v0}


def _sync(coord: Any, task: str, dev: Any, version: int) -> None:
    since = dev.version
    entries = [] if since is None else [e.to_entry() for e in coord.log_since(task, since)]
    fmt = None if dev.snapshot_format == "fp32" else dev.snapshot_format
    dev.sync(version, entries=entries, fetch=lambda: coord.snapshot(task, version, fmt))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over devices and the share the personal part leaves no worse (top-3)."""
    def mean(kind: str, metric: str) -> float:
        return statistics.fmean(r[kind][metric] for r in rows)

    out = {f"{k}_{m}": mean(k, m) for k in ("shared", "personal", "local")
           for m in ("perplexity", "top1", "top3")}
    out["personal_minus_shared_top3_points"] = 100 * (out["personal_top3"] - out["shared_top3"])
    out["not_worse_share"] = sum(r["personal"]["top3"] >= r["shared"]["top3"]
                                 for r in rows) / len(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("lm_keyboard")
    p.add_argument("--data", type=Path, required=True,
                   help="SST-2's train.tsv (labelled sentences)")
    p.add_argument("--base", default="runs/lm-base", help="the pretrained base directory "
                   "(made by `seedfed lm-base` if missing)")
    p.add_argument("--ternary-base", default="runs/lm-ternary", help="its ternary twin "
                   "(distilled from it by `seedfed ternarize --model-kind causal_lm --teacher "
                   "BASE` if missing)")
    p.add_argument("--ternary-lr", type=float, default=None,
                   help="the ternary run's lr (default: the recipe's TerMeZO lr)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: "
                   + ", ".join(FORMATS))
    p.add_argument("--devices", type=positive_int, default=20)
    p.add_argument("--rounds", type=positive_int, default=10)
    p.add_argument("--train", type=positive_int, default=200, help="sentences per device")
    p.add_argument("--held", type=positive_int, default=50, help="held-out sentences per "
                   "device and split")
    p.add_argument("--perturbations", type=positive_int, default=None,
                   help="seeds a step (default: the lm-keyboard recipe's)")
    p.add_argument("--lr", type=float, default=None, help="default: the recipe's")
    p.add_argument("--eps", type=float, default=None, help="default: the recipe's")
    p.add_argument("--personal-steps", type=positive_int, default=8)
    p.add_argument("--personal-lr", type=float, default=0.05)
    p.add_argument("--personal-decay", type=float, default=1e-3)
    p.add_argument("--eval-every", type=positive_int, default=2)
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    from seedfed.lm_base import DEMO_CONFIG, ensure_lm_base

    torch.set_num_threads(args.threads)
    meta = ensure_lm_base(args.data, Path(args.base), DEMO_CONFIG)
    trains, helds = fleet_text(args.data, meta["sentences"], args.seed, args.devices,
                               args.train, args.held, args.split)
    result: dict[str, Any] = {"split": args.split, "args": {k: str(v) for k, v in
                                                            vars(args).items()},
                              "base": {"parameters": meta["parameters"],
                                       "perplexity": meta["perplexity"]}, "runs": []}
    for name in args.formats.split(","):
        if name not in FORMATS:
            p.error(f"--formats: no format {name!r}; formats: {', '.join(FORMATS)}")
        base = Path(args.base)
        if FORMATS[name][1] == "ternary":
            from seedfed.ternarize import ensure_causal_base

            base = Path(args.ternary_base)
            ensure_causal_base(args.data, base, DEMO_CONFIG, teacher_dir=Path(args.base))
        run = run_format(name, base, trains, helds, args)
        result["runs"].append(run)
        s = run["summary"]
        print(f"{name}: top-3 shared {s['shared_top3']:.4f} personal {s['personal_top3']:.4f} "
              f"local {s['local_top3']:.4f} (+{s['personal_minus_shared_top3_points']:.2f} "
              f"points, {s['not_worse_share']:.0%} not worse); perplexity shared "
              f"{s['shared_perplexity']:.2f} personal {s['personal_perplexity']:.2f}")
        if args.json is not None:
            write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
