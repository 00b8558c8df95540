"""TerMeZO on ternary (BitNet b1.58) models: loss curves by mask choice, and device memory.

(a) Loss curves. A small BitNetForCausalLM built from config, converted to BitLinear (absmean
    ternary weights, 8-bit activations), is first pretrained with AdamW + straight-through
    estimator on a synthetic Markov-chain corpus A generated here, then fine-tuned with ZO
    (two-point SPSA, P = 1) on a shifted corpus B, at the same forward-pass budget, with:
    `threshold` (latents nearest gamma/2, TerMeZO), `random` (same count, uniform) and `full`
    (every latent: full-latent MeZO). Masks and gammas are refreshed every `epoch_rounds` steps
    (mask epochs). Held-out loss on B every few steps; curves averaged over seeds.

(b) Memory. A Llama-shaped model built from config (~1.1B parameters, TinyLlama shape), made
    layer by layer from the meta device (no fp32 copy of the whole model ever exists) and
    saved as a packed-ternary device snapshot. Each configuration then runs in its own
    subprocess that loads the snapshot and runs once, batch 1 x 64 tokens:
    - `infer`: packed-ternary inference (latents not loaded), one no-grad forward + loss;
    - `zo`: one ternary ZO step (packed codes + masked latents, virtual perturbation).
    `process_peak_mib` is resource.getrusage's ru_maxrss of that process (load included);
    `step_peak_mib` is VmHWM after resetting the peak once the model is loaded
    (/proc/self/clear_refs 5), i.e. the model plus what the action touched.
    Device bytes for mask + latents are set against the fp32 size of the whole model.

    seedfed bench ternary            # full: curves + 1.1B memory points (~10 min)
    seedfed bench ternary --quick    # about a minute: short curves, small model
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # transformers' BitNet helpers: run eagerly
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from seedfed.bench.registry import RESULTS, bench_parser
from seedfed.bench.report import write_json
from seedfed.shared.model.estimator import ZOConfig, spsa_step  # noqa: E402
from seedfed.shared.model.perturb import Perturber  # noqa: E402
from seedfed.shared.model.scopes import build_scope  # noqa: E402
from seedfed.shared.model.ternary import (  # noqa: E402
    MaskConfig,
    TernaryScope,
    absmean_gamma,
    bitlinear_modules,
    convert_to_bitlinear,
    load_ternary_model,
    save_ternary_model,
    start_mask_epoch,
    threshold_mask,
)

VARIANTS = ("threshold", "random", "full")

MODELS: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B shape (as in quant_memory.py): 1.10e9 parameters, untied head.
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "llama-tiny": dict(vocab_size=8000, hidden_size=256, intermediate_size=704,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
}


# ---------------------------------------------------------------------------------------------
# (a) loss curves


@dataclass(frozen=True)
class CurveSetup:
    vocab: int = 48
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    seq: int = 32
    batch: int = 16
    pretrain_steps: int = 150
    pretrain_lr: float = 3e-3
    shift: float = 0.5  # fraction of corpus-B rows whose successors differ from corpus A
    zo_steps: int = 300
    eval_every: int = 25
    fraction: float = 0.02
    epoch_rounds: int = 10  # steps per mask epoch (one step = one round here)
    # eps ~ the distance from gamma/2 that bounds a 2% threshold mask (about 4e-4 to 1e-3 on
    # this model): a probe then flips the masked latents. Swept lr in {1e-5, 3e-5, 1e-4, 3e-4}.
    lr: float = 3e-4
    eps: float = 1e-3
    seeds: tuple[int, ...] = (0, 1)


def markov_chain(vocab: int, gen: torch.Generator, branching: int = 3) -> torch.Tensor:
    """A sparse transition matrix: each token has `branching` likely successors."""
    logits = torch.full((vocab, vocab), -4.0)
    succ = torch.stack([torch.randperm(vocab, generator=gen)[:branching] for _ in range(vocab)])
    logits.scatter_(1, succ, torch.rand(vocab, branching, generator=gen) * 2.0 + 1.0)
    return torch.softmax(logits, dim=1)


def shifted_chain(base: torch.Tensor, shift: float, gen: torch.Generator) -> torch.Tensor:
    """Corpus B: a `shift` fraction of rows get a fresh successor distribution."""
    vocab = base.shape[0]
    fresh = markov_chain(vocab, gen)
    rows = torch.randperm(vocab, generator=gen)[: round(shift * vocab)]
    out = base.clone()
    out[rows] = fresh[rows]
    return out


def sample_batch(chain: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.empty(batch, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, chain.shape[0], (batch,), generator=gen)
    for t in range(1, seq):
        ids[:, t] = torch.multinomial(chain[ids[:, t - 1]], 1, generator=gen).squeeze(1)
    return ids


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def build_bitnet(s: CurveSetup, seed: int) -> nn.Module:
    from transformers import BitNetConfig, BitNetForCausalLM

    cfg = BitNetConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads,
                       num_key_value_heads=s.heads, max_position_embeddings=s.seq,
                       bos_token_id=0, eos_token_id=1)
    model = BitNetForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)  # weights from an explicit generator
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    convert_to_bitlinear(model)
    return model


def pretrain(model: nn.Module, chain: torch.Tensor, s: CurveSetup, gen: torch.Generator) -> float:
    """First-order BitNet training (AdamW, STE through the rounding), gamma refreshed per step."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.pretrain_lr, weight_decay=0.0)
    loss = torch.tensor(0.0)
    for _ in range(s.pretrain_steps):
        loss = lm_loss(model, sample_batch(chain, s.batch, s.seq, gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for _, m in bitlinear_modules(model):
                m.refresh_gamma()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return float(loss.detach())


def zo_curve(model: nn.Module, variant: str, chain: torch.Tensor, eval_ids: torch.Tensor,
             s: CurveSetup, seed: int) -> list[tuple[int, float]]:
    """Eval loss on corpus B against forward passes for one mask variant."""
    config = MaskConfig(selection=variant, fraction=s.fraction,  # type: ignore[arg-type]
                        epoch_rounds=s.epoch_rounds, seed=seed)
    zo = ZOConfig(lr=s.lr, eps=s.eps, perturbations=1, mode="copy")
    gen = torch.Generator().manual_seed(10_000 + seed)  # same batches for every variant
    seed_rng = np.random.default_rng(20_000 + seed)  # same perturbation seeds too

    def evaluate() -> float:
        with torch.no_grad():
            return float(lm_loss(model, eval_ids))

    curve = [(0, evaluate())]
    scope: TernaryScope | None = None
    perturber: Perturber | None = None
    forwards = 0
    for step in range(s.zo_steps):
        if config.starts_epoch(step):
            scope = start_mask_epoch(model, config, config.epoch_of(step))
            perturber = Perturber(scope, "copy")
        assert scope is not None and perturber is not None
        ids = sample_batch(chain, s.batch, s.seq, gen)

        def loss_fn(ids: torch.Tensor = ids) -> float:
            with torch.no_grad():
                return float(lm_loss(model, ids))

        seeds = [int(seed_rng.integers(0, 2**63))]
        forwards += spsa_step(scope, loss_fn, seeds, zo, perturber).forwards
        if (step + 1) % s.eval_every == 0:
            curve.append((forwards, evaluate()))
    return curve


def run_curves(s: CurveSetup) -> dict[str, Any]:
    runs: dict[str, list[list[tuple[int, float]]]] = {v: [] for v in VARIANTS}
    pre: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for seed in s.seeds:
        gen = torch.Generator().manual_seed(seed)
        chain_a = markov_chain(s.vocab, gen)
        chain_b = shifted_chain(chain_a, s.shift, gen)
        eval_ids = sample_batch(chain_b, 64, s.seq, torch.Generator().manual_seed(99 + seed))
        base = build_bitnet(s, seed)
        train_loss = pretrain(base, chain_a, s, gen)
        with torch.no_grad():
            pre.append({"seed": seed, "pretrain_loss_A": train_loss,
                        "start_loss_B": float(lm_loss(base, eval_ids)),
                        "entropy_B": chain_entropy(chain_b)})
        for variant in VARIANTS:
            runs[variant].append(zo_curve(copy.deepcopy(base), variant, chain_b, eval_ids, s,
                                          seed))
    summary = {}
    for v, curves in runs.items():
        losses = np.array([[loss for _, loss in c] for c in curves])
        summary[v] = {
            "forwards": [f for f, _ in curves[0]],
            "mean_loss": losses.mean(axis=0).tolist(),
            "per_seed": losses.tolist(),
            "start": float(losses[:, 0].mean()),
            "end": float(losses[:, -1].mean()),
            "best": float(losses.min(axis=1).mean()),
        }
    return {"setup": asdict(s), "pretraining": pre, "variants": summary,
            "seconds": time.perf_counter() - t0}


def chain_entropy(chain: torch.Tensor) -> float:
    """Mean next-token entropy (nats): the loss floor of corpus B (stationary weights ignored)."""
    p = chain.clamp_min(1e-12)
    return float(-(p * p.log()).sum(dim=1).mean())


def plot_curves(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for v, r in result["variants"].items():
        ax.plot(r["forwards"], r["mean_loss"], label=v, marker="o", markersize=2.5)
    s = result["setup"]
    ax.set_xlabel("forward passes")
    ax.set_ylabel("held-out loss on corpus B (nats)")
    ax.set_title(f"ternary ZO fine-tuning: mask {s['fraction']:.0%} vs random vs full "
                 f"({len(s['seeds'])} seeds)", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# (b) memory


@dataclass(frozen=True)
class MemSpec:
    model: str
    action: str  # infer | zo
    directory: str
    tokens: int = 64
    mode: str = "virtual"
    lr: float = 1e-4
    eps: float = 1e-3


def _llama_config(name: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS[name], tie_word_embeddings=False, max_position_embeddings=2048,
                       bos_token_id=1, eos_token_id=2)


def prepare_snapshot(model_name: str, fraction: float, directory: Path) -> dict[str, Any]:
    """Build the device snapshot layer by layer: at most one fp32 matrix exists at a time."""
    from transformers import LlamaForCausalLM

    config = _llama_config(model_name)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    convert_to_bitlinear(model)
    gen = torch.Generator().manual_seed(0)
    numel_ternary = 0
    for _, m in bitlinear_modules(model):
        w = torch.randn(m.out_features, m.in_features, generator=gen) * 0.02
        m.weight = nn.Parameter(w, requires_grad=False)
        m.gamma = absmean_gamma(w)
        m.mask_epoch = 0
        m.set_mask(threshold_mask(w, m.gamma, fraction))
        m.to_packed(keep_latents=True)
        numel_ternary += w.numel()
        del w
    for module in model.modules():  # the rest: embeddings, norms, head, rotary tables
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.__init__(config=config)  # type: ignore[misc]
            continue
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                fill = (torch.ones(p.shape) if "norm" in type(module).__name__.lower()
                        else torch.randn(p.shape, generator=gen) * 0.02)
                module._parameters[attr] = nn.Parameter(fill, requires_grad=False)
    total = numel_ternary + sum(
        p.numel() for n, p in model.named_parameters() if n.rpartition(".")[2] != "latent")
    save_ternary_model(model, directory, mask_config=MaskConfig(fraction=fraction))
    scope = build_scope("ternary", model)
    assert isinstance(scope, TernaryScope)
    return {"params_total": total, "params_ternary": numel_ternary,
            "device_bytes": scope.device_bytes(), "fp32_bytes": 4 * total,
            "file_bytes": sum(f.stat().st_size for f in directory.iterdir())}


def _vm(field: str) -> int:
    """A /proc/self/status field in KiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker(spec: MemSpec) -> dict[str, Any]:
    imports_kib = _vm("VmRSS")
    t0 = time.perf_counter()
    model = load_ternary_model(spec.directory, with_latents=spec.action == "zo")
    load_s = time.perf_counter() - t0
    loaded_kib = _vm("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the step's own peak
        reset = True
    except OSError:
        reset = False
    ids = torch.randint(0, MODELS[spec.model]["vocab_size"], (1, spec.tokens),
                        generator=torch.Generator().manual_seed(1))

    def loss_fn() -> float:
        with torch.no_grad():
            return float(lm_loss(model, ids))

    t1 = time.perf_counter()
    if spec.action == "infer":
        loss = loss_fn()
        forwards = 1
    else:
        scope = build_scope("ternary", model)
        zo = ZOConfig(lr=spec.lr, eps=spec.eps, perturbations=1, mode=spec.mode)  # type: ignore[arg-type]
        res = spsa_step(scope, loss_fn, [12345], zo, Perturber(scope, spec.mode))  # type: ignore[arg-type]
        loss, forwards = res.loss, res.forwards
    step_s = time.perf_counter() - t1
    return {
        **asdict(spec),
        "loss": loss, "forwards": forwards, "load_s": load_s, "step_s": step_s,
        "imports_mib": imports_kib / 1024, "loaded_mib": loaded_kib / 1024,
        "step_peak_mib": _vm("VmHWM") / 1024 if reset else None,
        "process_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_worker(spec: MemSpec, timeout: float) -> dict[str, Any]:
    return _subprocess("--worker", asdict(spec), timeout)


def _subprocess(flag: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "seedfed.bench.ternary", flag, json.dumps(payload)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{flag} {payload} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_memory(model_name: str, fractions: tuple[float, ...], timeout: float,
               on_point: Any = None) -> dict[str, Any]:
    """Every step in its own subprocess. Linux keeps ru_maxrss across fork + exec, so a parent
    that had built the snapshot itself would hand its peak to every worker as a floor."""
    out: dict[str, Any] = {"model": model_name, "points": []}
    for fraction in fractions:
        with tempfile.TemporaryDirectory(prefix="seedfed-ternary-") as tmp:
            t0 = time.perf_counter()
            sizes = _subprocess("--prepare", {"model_name": model_name, "fraction": fraction,
                                              "directory": tmp}, timeout)
            prep_s = time.perf_counter() - t0
            infer = run_worker(MemSpec(model_name, "infer", tmp), timeout)
            zo = run_worker(MemSpec(model_name, "zo", tmp), timeout)
        db = sizes["device_bytes"]
        out["points"].append({
            "fraction": fraction, "prepare_s": prep_s, **sizes, "infer": infer, "zo": zo,
            "mask_latent_bytes": db["mask"] + db["latent"],
            "mask_latent_over_fp32": (db["mask"] + db["latent"]) / sizes["fp32_bytes"],
            "process_peak_ratio": zo["process_peak_mib"] / infer["process_peak_mib"],
            "step_peak_ratio": (zo["step_peak_mib"] / infer["step_peak_mib"]
                                if zo["step_peak_mib"] and infer["step_peak_mib"] else None),
        })
        if on_point is not None:
            on_point(out)
    return out


# ---------------------------------------------------------------------------------------------
# report


def print_tables(report: dict[str, Any]) -> None:
    if "curves" in report:
        c = report["curves"]
        print(f"\n(a) loss on corpus B, mean of {len(c['setup']['seeds'])} seeds, "
              f"{c['variants']['threshold']['forwards'][-1]} forwards each")
        print(f"{'variant':<10} {'start':>8} {'end':>8} {'best':>8} {'drop':>8}")
        for v, r in c["variants"].items():
            print(f"{v:<10} {r['start']:8.4f} {r['end']:8.4f} {r['best']:8.4f} "
                  f"{r['start'] - r['end']:8.4f}")
        floor = np.mean([p["entropy_B"] for p in c["pretraining"]])
        print(f"(corpus-B entropy floor ~ {floor:.3f} nats)")
    if "memory" in report:
        m = report["memory"]
        print(f"\n(b) memory, {m['model']}, batch 1 x 64 tokens")
        print(f"{'mask':>6} {'params':>8} {'infer MiB':>10} {'zo MiB':>8} {'ratio':>6} "
              f"{'infer step':>10} {'zo step':>8} {'ratio':>6} {'mask+lat MiB':>12} {'/fp32':>7}")
        for p in m["points"]:
            i, z = p["infer"], p["zo"]
            sr = p["step_peak_ratio"]
            print(f"{p['fraction']:6.1%} {p['params_total'] / 1e9:7.2f}B "
                  f"{i['process_peak_mib']:10.0f} {z['process_peak_mib']:8.0f} "
                  f"{p['process_peak_ratio']:6.3f} {i['step_peak_mib'] or 0:10.0f} "
                  f"{z['step_peak_mib'] or 0:8.0f} {sr or float('nan'):6.3f} "
                  f"{p['mask_latent_bytes'] / 2**20:12.1f} {p['mask_latent_over_fp32']:7.2%}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("ternary")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="about a minute")
    parser.add_argument("--part", choices=("all", "curves", "memory"), default="all")
    parser.add_argument("--fractions", default="0.01,0.02",
                        help="mask fractions of the memory points (comma separated)")
    parser.add_argument("--curve-fraction", type=float, default=CurveSetup.fraction,
                        help="mask fraction of the loss curves")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per subprocess")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG next to it)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(MemSpec(**json.loads(args.worker)))))
        return 0
    if args.prepare:
        kw = json.loads(args.prepare)
        print(json.dumps(prepare_snapshot(kw["model_name"], kw["fraction"],
                                          Path(kw["directory"]))))
        return 0
    out = args.out or RESULTS / ("ternary_quick.json" if args.quick else "ternary.json")
    report: dict[str, Any] = {}
    if args.part != "all" and out.exists():  # one part at a time: keep the other's results
        report = json.loads(out.read_text())
    report.update({"quick": args.quick, "torch": torch.__version__})
    if args.part in ("all", "memory"):
        fractions = tuple(float(f) for f in args.fractions.split(","))

        def save_point(memory: dict[str, Any]) -> None:  # a long run keeps what it measured
            report["memory"] = memory
            write_json(out, report, newline=False)

        report["memory"] = run_memory("llama-tiny" if args.quick else "llama-1b",
                                      fractions[:1] if args.quick else fractions, args.timeout,
                                      save_point)
    if args.part in ("all", "curves"):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a tiny model: threads only add overhead
        setup = CurveSetup(fraction=args.curve_fraction)
        if args.quick:
            setup = replace(setup, pretrain_steps=80, zo_steps=100, eval_every=20, seeds=(0,))
        report["curves"] = run_curves(setup)
        plot_curves(report["curves"], out.with_suffix(".png"))
        report["curves"]["plot"] = str(out.with_suffix(".png"))
        torch.set_num_threads(threads)
    write_json(out, report, newline=False)
    print_tables(report)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
