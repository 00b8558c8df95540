"""Federated TerMeZO on a ternary causal LM: held-out perplexity before and after.

The base is a `seedfed ternarize --model-kind causal_lm` directory (a small Llama the project
pretrained on SST-2 training sentences and distilled into BitLinear). The devices get
training-split sentences that base never saw (taken from the other end of the base's order,
`ternarize.training_order`), written to a labelled TSV in the work directory, and split by
label: device i's sentences are `--label-skew` of label i mod 2 (negative or positive
reviews), so each device has a style of its own. Every run goes through the real round code
of `seedfed.bench.ternary_fed` and `seedfed simulate`: the coordinator, the ServerApp
strategy (`SeedfedStrategy`) on the in-process grid, the ClientApp devices holding the packed
ternary model and training on next-token loss (`seedfed.simulate.driver.drive`; `driver.run`
itself builds the classifier recipe's task, so the causal task is created here).

Variants at one forward budget: `threshold` (the TerMeZO mask: latents nearest gamma / 2) and
`random` (as many latents drawn uniformly). Per run, of version 0 (the base) and of the last
version, loaded as the devices hold it (the packed model from the published ternary snapshot):
perplexity on each device's own held-out sentences (its local split, never trained on), on
those pooled (token-weighted), and on the device file's test split, which no device sees.

    seedfed bench ternary_lm --data PATH/sst2/train.tsv --base runs/ternary-llama \\
        --json benchmarks/results/ternary_fed_lm.json
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json

VARIANTS: dict[str, dict[str, Any]] = {
    "threshold": {"selection": "threshold"},
    "random": {"selection": "random"},
}


def _option(default: Any, help: str) -> Any:
    """A budget field and its `--option` help text."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class LMBudget:
    """One run's budget; each field is also a command-line option (`--per-round`, ...)."""

    rounds: int = _option(50, "federated rounds")
    devices: int = _option(4, "devices in the fleet")
    per_round: int = _option(2, "devices sampled per round")
    steps: int = _option(1, "ZO steps per device per round")
    perturbations: int = _option(4, "perturbations per step")
    batch_size: int = _option(8, "sentences per batch")
    # lr and eps: the best of lr 1e-3..1 x eps 1e-3 / 5e-3 (and fraction 0.01 / 0.05 / 0.001)
    # on the validation split, seed 0, 10 rounds (docs/ternary.md section 5)
    lr: float = _option(0.3, "ZO learning rate")
    eps: float = _option(5e-3, "ZO perturbation size")
    fraction: float = _option(0.01, "share of latents in the mask")
    epoch_rounds: int = _option(5, "rounds per mask epoch")
    label_skew: float = _option(0.9, "share of a device's sentences of its own label")
    device_sentences: int = _option(4000, "unseen training sentences written for the fleet")
    eval_size: int = _option(400, "test-split sentences scored (no device sees them)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "label_skew" and not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value}")
        if not 0.0 <= self.label_skew <= 1.0:
            raise ValueError(f"label_skew must lie in [0, 1], got {self.label_skew}")


@dataclass
class LMRun:
    variant: str
    seed: int
    before: dict[str, Any]
    after: dict[str, Any]
    final_version: int
    seconds: float
    options: dict[str, Any] = field(default_factory=dict)


def write_device_file(data: Path, base_meta: dict[str, Any], n: int, path: Path) -> Path:
    """`n` training-split sentences of `data` (with labels) that the base never saw."""
    from seedfed.client.device_data import dataset_splits
    from seedfed.ternarize import training_order

    train = dataset_splits(str(data)).train
    seen = int(base_meta["sentences"])
    if seen + n > len(train):
        raise ValueError(f"the base saw {seen} of {len(train)} sentences: {n} more do not fit")
    order = training_order(len(train), int(base_meta["config"]["seed"]))
    lines = ["label\tsentence"] + [f"{int(train.labels[i])}\t{' '.join(train.texts[i].split())}"
                                   for i in sorted(order[len(order) - n:])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def lm_spec(base: Path, variant: str, b: LMBudget, max_len: int) -> Any:
    from seedfed.shared.protocol.scope_options import options_for
    from seedfed.shared.protocol.task import Hyper, TaskSpec

    return TaskSpec(model_path=str(base), model_kind="causal_lm", scope="ternary",
                    format="ternary", max_seq_len=max_len,
                    scope_options=options_for("ternary", {**VARIANTS[variant],
                                                          "fraction": b.fraction,
                                                          "epoch_rounds": b.epoch_rounds}),
                    hyper=Hyper(lr=b.lr, eps=b.eps, steps=b.steps,
                                perturbations=b.perturbations, batch_size=b.batch_size))


class _NoScore:
    """The strategy's evaluate_fn: nothing per round (perplexity is taken before and after)."""

    times = None

    def __call__(self, server_round: int, _arrays: Any) -> None:
        return None


def _ppl(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens) if tokens else float("nan")


def perplexities(packed: Any, snapshot: tuple[bytes, str], version: int,
                 device_sets: list[list[str]], test: list[str]) -> dict[str, Any]:
    """Perplexity of a version on each device's held-out sentences, pooled, and on the test."""
    from seedfed.ternarize import next_token_nll

    packed.load_snapshot(snapshot[0], version, snapshot[1])
    max_len = packed.spec.max_seq_len
    sums = [next_token_nll(packed.model, packed.tokenizer, texts, max_len)
            for texts in device_sets]
    test_nll, test_tokens = next_token_nll(packed.model, packed.tokenizer, test, max_len)
    return {"devices": [_ppl(*s) for s in sums],
            "devices_pooled": _ppl(sum(s[0] for s in sums), sum(s[1] for s in sums)),
            "test": _ppl(test_nll, test_tokens)}


def one_run(base: Path, device_file: Path, variant: str, seed: int, b: LMBudget,
            out: Path, split: str = "test") -> LMRun:
    """One federated run; `split`: the device file's split scored as "test" ("validation"
    to choose settings without looking at the test split)."""
    from seedfed.client.device_data import DeviceData, dataset_splits, load_device_examples
    from seedfed.client.ternary import SNAPSHOT_FORMAT, PackedTernary
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.flower_strategy import FleetConfig, SeedfedStrategy
    from seedfed.server.settings import Settings
    from seedfed.simulate.config import SimulationConfig, simulation_secret
    from seedfed.simulate.driver import drive, quiet_flower, quiet_transformers
    from seedfed.ternarize import read_meta

    quiet_transformers()
    meta = read_meta(base)
    assert meta is not None, f"{base} holds no {base}/ternary.json"
    spec = lm_spec(base, variant, b, int(meta["config"]["max_len"]))
    cfg = SimulationConfig(out=out, devices=b.devices, rounds=b.rounds, data=str(device_file),
                           seed=seed, devices_per_round=b.per_round, engine="inprocess",
                           personal="off", label_skew=b.label_skew, eval_size=0)
    held = [list(load_device_examples(DeviceData(
        source=str(device_file), partition_id=i, num_partitions=b.devices, seed=seed,
        label_skew=b.label_skew))[1].texts) for i in range(b.devices)]
    test = list(getattr(dataset_splits(str(device_file)), split).texts[:b.eval_size])
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with Coordinator.open(Settings(database_url=f"sqlite:///{out / 'coordinator.db'}",
                                   store_dir=out / "store")) as coord:
        task_id = coord.create_task(spec, name=f"lm-{variant}-{seed}", quorum=1,
                                    round_timeout_s=cfg.round_timeout_s,
                                    devices_per_round=b.per_round,
                                    secret=simulation_secret(seed))
        status = coord.task_status(task_id)
        # the sync phase (every device scores its held-out set) runs after the last round
        # only; in between a device replays the entries it missed with its next plan
        fleet = FleetConfig.from_status(status, min_devices=b.devices, sync_after_round=True,
                                        sync_every=b.rounds, final_round=b.rounds,
                                        sample_seed=seed)
        strategy = SeedfedStrategy(coord, task_id, fleet)
        packed = PackedTernary(spec)
        before = perplexities(packed, coord.snapshot(task_id, 0, SNAPSHOT_FORMAT), 0, held,
                              test)
        with quiet_flower():
            drive(cfg, strategy, _NoScore())  # type: ignore[arg-type]
        final = coord.task_status(task_id).version
        after = perplexities(packed, coord.snapshot(task_id, final, SNAPSHOT_FORMAT), final,
                             held, test)
    return LMRun(variant, seed, before, after, final, time.perf_counter() - started,
                 {**VARIANTS[variant], "fraction": b.fraction, "lr": b.lr})


def summarize(runs: list[LMRun]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in VARIANTS:
        rs = [r for r in runs if r.variant == v]
        if not rs:
            continue
        row: dict[str, Any] = {"seeds": [r.seed for r in rs]}
        for key in ("devices_pooled", "test"):
            b4 = [r.before[key] for r in rs]
            af = [r.after[key] for r in rs]
            row[key] = {"before": b4, "after": af, "before_mean": statistics.mean(b4),
                        "after_mean": statistics.mean(af),
                        "after_sd": statistics.stdev(af) if len(af) > 1 else 0.0,
                        "change_pct_mean": statistics.mean(
                            100 * (a / b - 1) for a, b in zip(af, b4, strict=True))}
        row["devices_improved"] = sum(
            sum(a < b for a, b in zip(r.after["devices"], r.before["devices"], strict=True))
            for r in rs)
        row["device_scores"] = sum(len(r.before["devices"]) for r in rs)
        row["seconds_mean"] = statistics.mean(r.seconds for r in rs)
        out[v] = row
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"{'variant':10} {'own v0':>8} {'own final':>9} {'change':>8} "
             f"{'test v0':>8} {'test final':>10} {'change':>8} {'devices better':>15}"]
    for v, s in result["summary"].items():
        d, t = s["devices_pooled"], s["test"]
        lines.append(f"{v:10} {d['before_mean']:8.2f} {d['after_mean']:9.2f} "
                     f"{d['change_pct_mean']:7.2f}% {t['before_mean']:8.2f} "
                     f"{t['after_mean']:10.2f} {t['change_pct_mean']:7.2f}% "
                     f"{s['devices_improved']:>8}/{s['device_scores']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("ternary_lm")
    ap.add_argument("--data", type=Path, required=True, help="SST-2 train.tsv (labelled)")
    ap.add_argument("--base", type=Path, required=True,
                    help="causal-LM base (seedfed ternarize --model-kind causal_lm)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--split", choices=("test", "validation"), default="test",
                    help="the device file's split scored as 'test' (validation: for tuning)")
    for f in fields(LMBudget):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                        help=f.metadata["help"])
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    b = LMBudget(**{f.name: getattr(a, f.name) for f in fields(LMBudget)})
    from seedfed.ternarize import read_meta

    meta = read_meta(a.base)
    if meta is None or meta.get("model_kind") != "causal_lm":
        raise SystemExit(f"{a.base} is not a causal-LM base (seedfed ternarize --model-kind "
                         "causal_lm)")
    result: dict[str, Any] = {"data": a.data.name, "base": str(a.base), "split": a.split,
                              "base_perplexity": meta["perplexity"], "budget": asdict(b),
                              "runs": [], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    runs: list[LMRun] = []

    def save() -> None:
        write_json(a.json, result)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        device_file = write_device_file(a.data, meta, b.device_sentences, work / "devices.tsv")
        for seed in (int(s) for s in a.seeds.split(",")):
            for v in (v for v in a.variants.split(",") if v):
                r = one_run(a.base, device_file, v, seed, b, work / f"{v}-{seed}", a.split)
                runs.append(r)
                result["runs"].append(asdict(r))
                result["summary"] = summarize(runs)
                save()
                print(f"{v} seed {seed}: own {r.before['devices_pooled']:.2f} -> "
                      f"{r.after['devices_pooled']:.2f}, test {r.before['test']:.2f} -> "
                      f"{r.after['test']:.2f} ({r.seconds:.0f} s)", flush=True)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
