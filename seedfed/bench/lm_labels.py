"""Label words beside a linear head on the same small causal LM, at equal forward passes.

MeZO's ablation says ZO learns a classification task far better phrased as the model's own
objective (a prompt and label words through the LM head) than through a new head. This runs
that comparison on the small Llama `seedfed lm-base` pretrains on SST-2 sentences (a weak base:
it does not know the task, so the prompt effect cannot be large; users bring real pretrained
LMs). Every method spends the same forward passes (`--forwards`), ZO steps of `--perturbations`
seeds (two probes each) on batches of the training split, by the device's own trainer:

- `label_words-lora`: the `lm-labels` recipe's task: prompt '<text> It was' + label words
  (terrible, great), LoRA r 8 on the attention query and value;
- `linear_head`: the same LM as a sequence classifier (last-token pooling, a new linear head,
  `AutoModelForSequenceClassification`), ZO on the head alone;
- `linear_head-lora`: that head and the same LoRA adapters.

Accuracy on the validation split (tuning) at every quarter of the budget, zero-shot label
words at 0; `--split test` scores the final models once on the test split.

    seedfed bench lm_labels --data PATH/sst2/train.tsv --base runs/lm-base \\
        --json benchmarks/results/lm_labels.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from seedfed.bench.registry import bench_parser, positive_int
from seedfed.bench.report import write_json

METHODS = ("label_words-lora", "linear_head", "linear_head-lora")


def method_spec(method: str, base: Path, args: Any) -> Any:
    """The TaskSpec a method trains."""
    from seedfed.shared.protocol.recipes import LM_LORA, resolve_recipe
    from seedfed.shared.protocol.scope_options import NamedOptions
    from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec

    hyper = Hyper(lr=args.lr, eps=args.eps, steps=1, perturbations=args.perturbations,
                  batch_size=args.batch_size)
    if method == "label_words-lora":
        return resolve_recipe("lm-labels", {"hyper.lr": args.lr, "hyper.eps": args.eps,
                                            "hyper.perturbations": args.perturbations,
                                            "hyper.batch_size": args.batch_size},
                              model=str(base)).spec
    if method == "linear_head":
        return TaskSpec(model_path=str(base), model_kind="seq_cls", num_labels=2,
                        scope="named", scope_options=NamedOptions(patterns=("score",)),
                        hyper=Hyper(lr=args.head_lr, eps=args.eps, steps=1,
                                    perturbations=args.perturbations,
                                    batch_size=args.batch_size), max_seq_len=64)
    lora = LoraOptions(r=LM_LORA.r, alpha=LM_LORA.alpha, target_modules=("q_proj", "v_proj"),
                       train_head=True)
    return TaskSpec(model_path=str(base), model_kind="seq_cls", num_labels=2, scope="lora",
                    lora=lora, hyper=hyper, max_seq_len=64)


def run_method(method: str, base: Path, splits: Any, args: Any) -> dict[str, Any]:
    import numpy as np

    from seedfed.client.device_data import local_accuracy
    from seedfed.client.objective_batches import endless_batches
    from seedfed.client.trainer import LocalTrainer
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.model.objectives import task_losses
    from seedfed.shared.protocol.wire import RoundPlan

    spec = method_spec(method, base, args)
    bundle = build_model(spec, initialize=True)
    loss, copy_losses = task_losses(spec, bundle.tokenizer)
    trainer = LocalTrainer(bundle.model, bundle.scope, loss, copy_losses=copy_losses)
    train = splits.train
    scored = splits.validation if args.split == "validation" else splits.test
    scored = scored.subset(range(min(args.eval_size, len(scored))))
    batches = endless_batches(spec, bundle.tokenizer, train.texts, train.labels,
                              spec.hyper.batch_size, np.random.default_rng(args.seed))
    steps = args.forwards // (2 * args.perturbations)
    marks = {steps * q // 4 for q in range(1, 5)}
    curve = [{"forwards": 0, "accuracy": local_accuracy(bundle, scored)[0]}]
    started = time.perf_counter()
    for s in range(steps):
        plan = RoundPlan(task_id=method, round=s + 1, version=s,
                         seeds=[[args.seed * 10**6 + s * args.perturbations + i
                                 for i in range(args.perturbations)]],
                         lr=spec.hyper.lr, eps=spec.hyper.eps,
                         batch_size=spec.hyper.batch_size, clip=None, one_sided=False,
                         scope=spec.scope)
        trainer.run(plan, batches, keep=True)
        if s + 1 in marks:
            acc = local_accuracy(bundle, scored)[0]
            curve.append({"forwards": 2 * args.perturbations * (s + 1), "accuracy": acc})
            print(f"{method}: {curve[-1]['forwards']} forwards, {args.split} accuracy "
                  f"{acc:.4f} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return {"method": method, "scope_numel": bundle.scope.numel, "curve": curve,
            "final": curve[-1]["accuracy"], "wall_seconds": round(time.perf_counter() - started,
                                                                  1)}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("lm_labels")
    p.add_argument("--data", type=Path, required=True, help="SST-2's train.tsv")
    p.add_argument("--base", type=Path, default=Path("runs/lm-base"),
                   help="the pretrained base (made by `seedfed lm-base` if missing)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--forwards", type=positive_int, default=2048,
                   help="forward passes per method")
    p.add_argument("--perturbations", type=positive_int, default=16)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--lr", type=float, default=0.1, help="lr of the adapters")
    p.add_argument("--head-lr", type=float, default=0.3, help="lr of the linear head alone")
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--eval-size", type=positive_int, default=1000)
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    from seedfed.client.device_data import dataset_splits
    from seedfed.lm_base import DEMO_CONFIG, ensure_lm_base

    torch.set_num_threads(args.threads)
    meta = ensure_lm_base(args.data, args.base, DEMO_CONFIG)
    splits = dataset_splits(str(args.data))
    result: dict[str, Any] = {"split": args.split, "args": {k: str(v) for k, v in
                                                            vars(args).items()},
                              "base": {"parameters": meta["parameters"],
                                       "perplexity": meta["perplexity"]}, "runs": []}
    for method in args.methods.split(","):
        if method not in METHODS:
            p.error(f"--methods: no method {method!r}; methods: {', '.join(METHODS)}")
        result["runs"].append(run_method(method, args.base, splits, args))
        if args.json is not None:
            write_json(args.json, result)
    for run in result["runs"]:
        print(f"{run['method']}: {args.split} accuracy {run['curve'][0]['accuracy']:.4f} -> "
              f"{run['final']:.4f} in {args.forwards} forwards ({run['scope_numel']:,} "
              "trained values)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
