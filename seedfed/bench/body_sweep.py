"""Fast sweep of body scopes for SST-2 + MiniLM: first-order ceilings and federated ZO.

`seedfed.bench.head_sweep` showed the head-only recipe saturates at the first-order linear probe.
This script asks which tensors *below* the head the fleet could train, and at what probe cost,
on the benchmark's own split and Dirichlet partition (`accuracy.carve`), scoring the VALIDATION
split (pass --test only to confirm a choice once).

    seedfed bench body_sweep cache                      # encode once (states per layer)
    seedfed bench body_sweep fo --scopes head ln5out lnb5 top1 ...  # FO ceilings
    seedfed bench body_sweep zo --scope ffo5 --lr 4 --c-body 0.05 ...   # federated ZO
    seedfed bench body_sweep cost                       # ms per probe for each scope

How it stays fast (and the same math as `fed_zo`):
- *cache*: the token states entering encoder layers 0, 3, 4, 5 and the final states (per
  format: fp32, int8 / int4 quantized encoder) of every pool / validation / test sentence are
  computed once (`runs/body_cache_<format>.pt`, ~1 GB); every later
  forward starts at the lowest layer a scope perturbs. The encoder layers run from a small
  functional BERT layer (`layer_forward`) checked against transformers' own on load.
- *ZO*: Rademacher z, two-point estimate g = (L(phi + eps z) - L(phi - eps z)) / 2 eps,
  coef = -(lr / P) * weighted mean over devices of g, n_k weights (FedAvg), every device every
  round with its own batch of 16 (the recipe's fleet). The devices' batches of one round are
  stacked into one forward per probe (per-example losses, then per-device means): the scalars
  equal those of 20 separate device forwards. Per-tensor scales (the task-definition constant
  c_t): theta_t = theta0_t + c_t * phi_t, SPSA on phi (z, eps and lr live in phi units), so one lr
  serves the head (c = 1) and the body (c ~ 0.01-0.1). z comes from torch generators, not the
  Philox stream: same distribution, not the same bits.
- *cheap body probes*: `ffo5` (LoRA-FA on layer 5's FFN output projection, A frozen, beside
  that layer's output LayerNorm and bias) and `fa5` (the LoRA-FA alone) cache x A per token,
  so a probe costs one (tokens x r) @ (r x 384) matmul + LayerNorm + pooling, not a layer.
  Scopes inside layer 5's attention or lower re-run the layers above them.
- Every FO and ZO run reports the training loss on a fixed 2,000 of the pool beside the
  validation accuracy: the objective itself, far less noisy than 1,000 examples' accuracy.
  `body_coherence.py` turns a scope's gradient and curvature there into what a seed can buy.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.nn import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json
from seedfed.bench.sweep_data import FedConfig, carve  # noqa: E402
from seedfed.client.data import tokenize  # noqa: E402
from seedfed.shared.model.factory import build_model  # noqa: E402
from seedfed.shared.protocol.recipes import resolve_recipe  # noqa: E402
from seedfed.shared.protocol.task import Format  # noqa: E402

LAYERS_CACHED = (0, 3, 4, 5)  # states entering these encoder layers are stored
HEADS = 12
LN_EPS = 1e-12


# ------------------------------------------------------------------------------------------
# cache


def _encoder_params(bundle: Any) -> dict[str, torch.Tensor]:
    """Float weights of the encoder layers (dequantized for int8/int4) and the head."""
    from seedfed.shared.model.quant.linear import QuantLinear

    model = bundle.model
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.encoder.encoder.layer):
        for name, mod in layer.named_modules():
            if isinstance(mod, QuantLinear):
                assert mod.bias is not None  # the encoder's Linears all have a bias
                out[f"{i}.{name}.weight"] = mod.dequantized_weight().detach().clone()
                out[f"{i}.{name}.bias"] = mod.bias.detach().clone()
            elif isinstance(mod, (torch.nn.Linear, torch.nn.LayerNorm)):
                out[f"{i}.{name}.weight"] = mod.weight.detach().clone()
                out[f"{i}.{name}.bias"] = mod.bias.detach().clone()
    out["classifier.weight"] = model.classifier.weight.detach().clone()
    out["classifier.bias"] = model.classifier.bias.detach().clone()
    return out


def build_cache(path: Path, data: Path, fmt: str, model: str | None) -> dict[str, Any]:
    cfg = FedConfig()
    pool, parts, val, test = carve(data, cfg)
    spec = resolve_recipe("sst2", model=model).spec
    from dataclasses import replace
    spec = replace(spec, format=cast(Format, fmt))
    bundle = build_model(spec, initialize=True)
    enc = cast(torch.nn.Module, bundle.model.encoder)
    out: dict[str, Any] = {"parts": parts, "format": fmt, "params": _encoder_params(bundle)}
    for split, ex in (("pool", pool), ("val", val), ("test", test)):
        started = time.perf_counter()
        order = np.argsort([len(t) for t in ex.texts])
        rows: dict[int, list[Any]] = {k: [None] * len(ex) for k in LAYERS_CACHED + (6,)}
        with torch.no_grad():
            for s in range(0, len(ex), 128):
                idx = order[s:s + 128]
                b = tokenize(bundle.tokenizer, [ex.texts[i] for i in idx], None, spec.max_seq_len)
                hs = enc(**b, output_hidden_states=True).hidden_states
                lens = b["attention_mask"].sum(1).tolist()
                for k in LAYERS_CACHED + (6,):
                    for j, i in enumerate(idx):
                        rows[k][i] = hs[k][j, :lens[j]].clone()
        lengths = torch.tensor([r.shape[0] for r in rows[0]])
        out[split] = {"lengths": lengths, "y": torch.as_tensor(ex.labels),
                      **{f"h{k}": torch.cat(rows[k]) for k in LAYERS_CACHED + (6,)}}
        print(f"cached {split}: {len(ex)} sentences, {int(lengths.sum())} tokens, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def load_cache(fmt: str, cache_dir: Path, data: Path, model: str | None) -> dict[str, Any]:
    path = cache_dir / f"body_cache_{fmt}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    return build_cache(path, data, fmt, model)


class Split:
    """Cached token states of one split, gathered into padded batches by sentence index."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.lengths = d["lengths"]
        self.y = d["y"]
        self.starts = torch.cat([torch.zeros(1, dtype=torch.long), self.lengths.cumsum(0)[:-1]])
        self.h = {k: d[f"h{k}"] for k in LAYERS_CACHED + (6,) if f"h{k}" in d}

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(states [B, T, 384] entering layer k, mask [B, T] float)."""
        lens = self.lengths[idx]
        t = int(lens.max())
        ar = torch.arange(t)
        mask = ar[None, :] < lens[:, None]
        gather = (self.starts[idx][:, None] + ar[None, :]).clamp_max(self.h[k].shape[0] - 1)
        h = self.h[k][gather] * mask[..., None]
        return h, mask.float()


# ------------------------------------------------------------------------------------------
# the model as functions of a parameter dict


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS)


def attention(p: dict[str, torch.Tensor], i: int, h: torch.Tensor, madd: torch.Tensor
              ) -> torch.Tensor:
    """States after layer i's attention block (its LayerNorm included)."""
    b, t, d = h.shape
    pre = f"{i}.attention."

    def proj(name: str) -> torch.Tensor:
        x = F.linear(h, p[pre + f"self.{name}.weight"], p[pre + f"self.{name}.bias"])
        return x.view(b, t, HEADS, d // HEADS).transpose(1, 2)

    ctx = F.scaled_dot_product_attention(proj("query"), proj("key"), proj("value"),
                                         attn_mask=madd)
    ctx = ctx.transpose(1, 2).reshape(b, t, d)
    o = F.linear(ctx, p[pre + "output.dense.weight"], p[pre + "output.dense.bias"])
    return layer_norm(o + h, p[pre + "output.LayerNorm.weight"], p[pre + "output.LayerNorm.bias"])


def ffn_pre(p: dict[str, torch.Tensor], i: int, a: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(a, p[f"{i}.intermediate.dense.weight"],
                           p[f"{i}.intermediate.dense.bias"]))


def layer_forward(p: dict[str, torch.Tensor], i: int, h: torch.Tensor, madd: torch.Tensor,
                  lora: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    a = attention(p, i, h, madd)
    u = ffn_pre(p, i, a)
    o = F.linear(u, p[f"{i}.output.dense.weight"], p[f"{i}.output.dense.bias"])
    if lora is not None and f"{i}.A" in lora:
        o = o + (u @ lora[f"{i}.A"]) @ lora[f"{i}.B"]
    return layer_norm(o + a, p[f"{i}.output.LayerNorm.weight"], p[f"{i}.output.LayerNorm.bias"])


def pool_logits(p: dict[str, torch.Tensor], h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1.0)
    return F.linear(F.normalize(pooled, dim=-1), p["classifier.weight"], p["classifier.bias"])


def forward(p: dict[str, torch.Tensor], split: Split, idx: torch.Tensor, start: int,
            lora: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None
            ) -> torch.Tensor:
    """Logits of `idx` from the cached states entering layer `start` (in `dtype`, if given:
    finite differences of a loss need float64)."""
    h, mask = split.batch(idx, start)
    if dtype is not None:
        h, mask = h.to(dtype), mask.to(dtype)
    if start < 6:
        madd = ((1.0 - mask) * torch.finfo(h.dtype).min)[:, None, None, :]
        for i in range(start, 6):
            h = layer_forward(p, i, h, madd, lora)
    return pool_logits(p, h, mask)


# ------------------------------------------------------------------------------------------
# scopes: which parameter names train, and the lowest layer they touch


def scope_names(scope: str, params: dict[str, torch.Tensor]) -> tuple[list[str], int, int]:
    """(trained parameter names, lowest layer run, LoRA rank on output.dense (0: none))."""
    names = list(params)
    head = ["classifier.weight", "classifier.bias"]
    lnb = lambda i: [n for n in names if n.startswith(f"{i}.") and (  # noqa: E731
        "LayerNorm" in n or n.endswith(".bias"))]
    table: dict[str, tuple[list[str], int, int]] = {
        "head": (head, 6, 0),
        "ln5out": (head + ["5.output.LayerNorm.weight", "5.output.LayerNorm.bias"], 5, 0),
        "ffo5": (head + ["5.output.LayerNorm.weight", "5.output.LayerNorm.bias",
                         "5.output.dense.bias"], 5, 16),
        "lnb5": (head + lnb(5), 5, 0),
        "lnb45": (head + lnb(4) + lnb(5), 4, 0),
        "bitfit_all": (head + [n for i in range(6) for n in lnb(i)], 0, 0),
        "top1": (head + [n for n in names if n.startswith("5.")], 5, 0),
        "top2": (head + [n for n in names if n[:2] in ("4.", "5.")], 4, 0),
        "top3": (head + [n for n in names if n[:2] in ("3.", "4.", "5.")], 3, 0),
        "full": (head + [n for n in names if n[0].isdigit()], 0, 0),
        "lora5": (head, 5, 8),  # LoRA (A and B trained) on layer 5's output.dense
        "fa5": (head, 5, 16),  # LoRA-FA (B trained, A frozen) on layer 5's output.dense alone
    }
    if scope not in table:
        raise SystemExit(f"unknown scope {scope}; known: {', '.join(table)}")
    return table[scope]


# ------------------------------------------------------------------------------------------
# first-order ceilings


def fo_ceiling(cache: dict[str, Any], scope: str, lr: float, epochs: int, batch: int,
               seed: int, eval_split: str) -> dict[str, Any]:
    torch.manual_seed(seed)
    params = {k: v.clone() for k, v in cache["params"].items()}
    names, start, rank = scope_names(scope, params)
    pool, ev = Split(cache["pool"]), Split(cache[eval_split])
    union = torch.from_numpy(np.sort(np.concatenate(cache["parts"])))
    trained = [params[n].requires_grad_(True) for n in names]
    lora: dict[str, torch.Tensor] = {}
    if rank:
        g = torch.Generator().manual_seed(seed)
        lora = {"5.A": (torch.rand(1536, rank, generator=g) * 2 - 1) / math.sqrt(1536),
                "5.B": torch.zeros(rank, 384)}
        if scope == "lora5":
            lora["5.A"].requires_grad_(True)
        lora["5.B"].requires_grad_(True)
        trained += [t for t in lora.values() if t.requires_grad]
    # the head moves 10-100x further than body tensors: head at lr, body at lr_body
    head_p = [params["classifier.weight"], params["classifier.bias"]]
    body_p = [t for t in trained if all(t is not h for h in head_p)]
    groups = [{"params": head_p, "lr": 1e-2}] + ([{"params": body_p, "lr": lr}] if body_p else [])
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    history = []
    started = time.perf_counter()
    acc0 = evaluate(params, ev, start, lora)
    tr_idx = train_subset(cache["parts"])
    losses = []
    for ep in range(epochs):
        for idx in bucketed(union, pool.lengths, batch):
            loss = F.cross_entropy(forward(params, pool, idx, start, lora or None),
                                   pool.y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        acc = evaluate(params, ev, start, lora)
        history.append(round(acc, 4))
        losses.append(round(mean_loss(params, pool, tr_idx, start, lora), 4))
        print(f"  fo {scope} lr {lr:g} epoch {ep + 1}: {eval_split} {acc:.4f} "
              f"train loss {losses[-1]:.4f} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    numel = sum(t.numel() for t in trained)
    return {"scope": scope, "lr": lr, "epochs": epochs, "batch": batch, "numel": numel,
            "start_layer": start, "acc0": acc0, "history": history, "train_loss": losses,
            "best": max(history),
            "final": history[-1], "seconds": time.perf_counter() - started}


def bucketed(union: torch.Tensor, lengths: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """Shuffled minibatches of similar lengths (chunks of 50 batches sorted by length), so
    padding does not triple the work of the layers on these short SST-2 phrases."""
    perm = union[torch.randperm(len(union))]
    out = []
    chunk = 50 * batch
    for c in range(0, len(perm), chunk):
        part = perm[c:c + chunk]
        part = part[torch.argsort(lengths[part])]
        out += [part[s:s + batch] for s in range(0, len(part) - batch + 1, batch)]
    return [out[i] for i in torch.randperm(len(out)).tolist()]


def train_subset(parts: list[np.ndarray], size: int = 2000) -> torch.Tensor:
    """A fixed `size` of the fleet's pool (seed 5): where every run reports its training loss."""
    union = torch.from_numpy(np.sort(np.concatenate(parts)))
    return union[torch.randperm(len(union), generator=torch.Generator().manual_seed(5))[:size]]


@torch.no_grad()
def mean_loss(params: dict[str, torch.Tensor], split: Split, idx: torch.Tensor, start: int,
              lora: dict[str, torch.Tensor] | None = None) -> float:
    """Mean cross-entropy over `idx` (the fixed 2,000 pool examples the ZO runs report)."""
    order = idx[torch.argsort(split.lengths[idx])]
    total = sum(float(F.cross_entropy(forward(params, split, order[s:s + 100], start,
                                              lora or None), split.y[order[s:s + 100]],
                                      reduction="sum")) for s in range(0, len(order), 100))
    return total / len(idx)


@torch.no_grad()
def evaluate(params: dict[str, torch.Tensor], ev: Split, start: int,
             lora: dict[str, torch.Tensor] | None = None) -> float:
    correct = 0
    order = torch.argsort(ev.lengths)
    for s in range(0, len(ev), 100):
        idx = order[s:s + 100]
        correct += int((forward(params, ev, idx, start, lora or None).argmax(1) == ev.y[idx]).sum())
    return correct / len(ev)


# ------------------------------------------------------------------------------------------
# federated ZO


@dataclass(frozen=True)
class ZoRun:
    scope: str
    lr: float = 4.0
    eps: float = 1e-3
    perturbations: int = 64
    rounds: int = 300
    batch: int = 16
    c_body: float = 0.05  # theta_t = theta0_t + c_t * phi_t for every body tensor
    c_head: float = 1.0
    rank: int = 16
    per_round: int = 20
    eval_every: int = 50
    #: Block seeds: seed j perturbs only block j % blocks (block 0 the head, 1 the body), so
    #: the body's directions never enter the head's scalars; each block steps lr / (its seeds).
    blocks: int = 1
    #: Server momentum (heavy ball) on the round's update: v = beta v + u, phi += v, with the
    #: velocity kept for `window` rounds (the coordinator's windowed form; 0 = unbounded).
    momentum: float = 0.0
    window: int = 0
    #: step scale of the head's bias (its curvature is ~1 / |mean feature|^2 times the
    #: weights', so it caps the lr the weights can take; the recipe's step_scales)
    c_bias: float = 1.0
    #: cosine decay of the round's lr to lr * lr_final at the last round (1: constant)
    lr_final: float = 1.0


#: Scopes at the top of layer 5 whose probes start from a cached pre-LayerNorm state.
CHEAP_TOP = ("ln5out", "ffo5", "lora5", "fa5")
#: peft's LoRA scaling alpha / r of the lora5 scope (alpha 16, r 8).
LORA_SCALE = 2.0


class ZoProblem:
    """Flat phi for a scope, and a batched loss for many phi at once where the scope allows."""

    def __init__(self, cache: dict[str, Any], run: ZoRun, seed: int) -> None:
        self.params = {k: v.clone() for k, v in cache["params"].items()}
        self.names, self.start, rank = scope_names(run.scope, self.params)
        self.rank = run.rank if rank else 0
        self.run = run
        shapes = [self.params[n].shape for n in self.names]
        if self.rank:
            g = torch.Generator().manual_seed(12345)
            # A Kaiming-uniform-like (frozen in ffo5: LoRA-FA; trained in lora5); B starts at 0
            self.A = (torch.rand(1536, self.rank, generator=g) * 2 - 1) / math.sqrt(1536)
            if run.scope == "lora5":
                self.params["5.A"] = self.A
                self.names = self.names + ["5.A"]
                shapes.append(torch.Size((1536, self.rank)))
            self.params["5.B"] = torch.zeros(self.rank, 384)
            self.names = self.names + ["5.B"]
            shapes.append(torch.Size((self.rank, 384)))
        self.sizes = [int(np.prod(s)) for s in shapes]
        self.scale = torch.cat([torch.full((n,), run.c_bias if nm == "classifier.bias"
                                           else run.c_head if nm.startswith("classifier")
                                           else run.c_body) for nm, n in
                                zip(self.names, self.sizes, strict=True)])
        self.theta0 = torch.cat([self.params[n].reshape(-1) for n in self.names])
        self.numel = int(self.theta0.numel())
        self._eval_preps: dict[int, list[tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}

    def unflat(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        out, s = dict(self.params), 0
        for nm, n in zip(self.names, self.sizes, strict=True):
            out[nm] = theta[s:s + n].view(self.params[nm].shape)
            s += n
        return out

    # -- the cheap path for scopes at the top of layer 5 (ln5out, ffo5, head) ----------------

    def prepare(self, split: Split, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """What every probe of a batch shares (the states below the lowest perturbed op).
        Top-of-layer-5 scopes keep only real tokens (packed) and pool by segment sums, so
        padding costs nothing."""
        if self.run.scope in CHEAP_TOP and len(idx) > 32:
            # length-sorted chunks (a device pads only its own batch): pack each, then join
            order = torch.argsort(split.lengths[idx])
            chunks = [self.prepare(split, idx[order[s:s + 32]]) for s in range(0, len(idx), 32)]
            # token -> its sentence's row in idx order (chunk rows are sorted positions)
            seg = order[torch.cat([c["seg"] + s for c, s in
                                   zip(chunks, range(0, len(idx), 32), strict=True)])]
            prep = {"pre": torch.cat([c["pre"] for c in chunks]), "seg": seg,
                    "w": torch.cat([c["w"] for c in chunks]),
                    "rows": torch.tensor(len(idx))}
            for key in ("uA", "u"):
                if key in chunks[0]:
                    prep[key] = torch.cat([c[key] for c in chunks])
            return prep
        h, mask = split.batch(idx, self.start)
        prep = {"mask": mask}
        if self.start == 6:
            prep["pooled"] = F.normalize((h * mask[..., None]).sum(1)
                                         / mask.sum(1, keepdim=True), dim=-1)
            return prep
        p = self.params
        madd = ((1.0 - mask) * torch.finfo(h.dtype).min)[:, None, None, :]
        if self.run.scope in CHEAP_TOP:
            with torch.no_grad():
                a = attention(p, 5, h, madd)
                u = ffn_pre(p, 5, a)
                pre = F.linear(u, p["5.output.dense.weight"], p["5.output.dense.bias"]) + a
            sel = mask.bool()
            prep["pre"] = pre[sel]
            if "5.A" in self.names:
                prep["u"] = u[sel]
            elif self.rank:
                prep["uA"] = u[sel] @ self.A
            b, t = mask.shape
            bidx = torch.arange(b)[:, None].expand(b, t)[sel]
            # mean pooling as a segment sum: token weight 1 / its sentence's length
            prep["seg"], prep["w"] = bidx, 1.0 / mask.sum(1)[bidx]
            prep["rows"] = torch.tensor(b)
        else:
            prep["h"], prep["madd"] = h, madd
        return prep

    def part(self, thetas: torch.Tensor, name: str) -> torch.Tensor:
        s = 0
        for nm, n in zip(self.names, self.sizes, strict=True):
            if nm == name:
                return thetas[:, s:s + n].reshape(thetas.shape[0], *self.params[nm].shape)
            s += n
        raise KeyError(name)

    def batched_logits(self, thetas: torch.Tensor, prep: dict[str, torch.Tensor]
                       ) -> torch.Tensor:
        """[K, B, 2] logits under K flat parameter vectors (top-of-layer-5 and head scopes)."""
        w, b = self.part(thetas, "classifier.weight"), self.part(thetas, "classifier.bias")
        if "pooled" in prep:
            return torch.einsum("nd,kcd->knc", prep["pooled"], w) + b[:, None, :]
        x = prep["pre"].expand(thetas.shape[0], -1, -1)
        if "u" in prep:  # LoRA with A trained: (u A_k) B_k per probe, u cached
            ua = torch.einsum("tu,kur->ktr", prep["u"], self.part(thetas, "5.A"))
            x = x + LORA_SCALE * torch.einsum("ktr,kro->kto", ua, self.part(thetas, "5.B"))
        elif self.rank:
            x = x + torch.einsum("tr,kro->kto", prep["uA"], self.part(thetas, "5.B"))
        if "5.output.dense.bias" in self.names:
            x = x + (self.part(thetas, "5.output.dense.bias")
                     - self.params["5.output.dense.bias"])[:, None, :]
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        x = (x - mu) * torch.rsqrt(var + LN_EPS)
        if "5.output.LayerNorm.weight" in self.names:
            x = x * self.part(thetas, "5.output.LayerNorm.weight")[:, None, :] \
                + self.part(thetas, "5.output.LayerNorm.bias")[:, None, :]
        else:
            x = x * self.params["5.output.LayerNorm.weight"] \
                + self.params["5.output.LayerNorm.bias"]
        k = x.shape[0]
        sums = x.new_zeros(k, int(prep["rows"]), x.shape[-1])
        pooled = F.normalize(sums.index_add_(1, prep["seg"], x * prep["w"][None, :, None]),
                             dim=-1)
        return torch.einsum("kbd,kcd->kbc", pooled, w) + b[:, None, :]

    def losses(self, thetas: torch.Tensor, prep: dict[str, torch.Tensor], y: torch.Tensor
               ) -> torch.Tensor:
        """Per-example cross-entropy [K, B] under each of K flat parameter vectors."""
        out = []
        if "pooled" in prep or "pre" in prep:
            step = 16
            for s in range(0, thetas.shape[0], step):
                lg = self.batched_logits(thetas[s:s + step], prep)
                k = lg.shape[0]
                out.append(F.cross_entropy(lg.reshape(-1, 2), y.repeat(k),
                                           reduction="none").view(k, -1))
            return torch.cat(out)
        for theta in thetas:
            p = self.unflat(theta)
            h = prep["h"]
            for i in range(self.start, 6):
                h = layer_forward(p, i, h, prep["madd"])
            logits = pool_logits(p, h, prep["mask"])
            out.append(F.cross_entropy(logits, y, reduction="none"))
        return torch.stack(out)

    def _logits(self, p: dict[str, torch.Tensor], prep: dict[str, torch.Tensor]) -> torch.Tensor:
        if "pooled" in prep or "pre" in prep:
            return self.batched_logits(self.flat(p)[None], prep)[0]
        h = prep["h"]
        for i in range(self.start, 6):
            h = layer_forward(p, i, h, prep["madd"])
        return pool_logits(p, h, prep["mask"])

    def flat(self, p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([p[n].reshape(-1) for n in self.names])

    def train_loss(self, theta: torch.Tensor, split: Split, idx: torch.Tensor) -> float:
        """Mean cross-entropy over `idx` of `split` (the fleet's objective, on its pool)."""
        key = -id(split)
        if key not in self._eval_preps:
            order = idx[torch.argsort(split.lengths[idx])]
            self._eval_preps[key] = [(order[s:s + 100], self.prepare(split, order[s:s + 100]))
                                     for s in range(0, len(order), 100)]
        p = self.unflat(theta)
        total = sum(float(F.cross_entropy(self._logits(p, prep), split.y[i], reduction="sum"))
                    for i, prep in self._eval_preps[key])
        return total / len(idx)

    def accuracy(self, theta: torch.Tensor, split: Split) -> float:
        correct = 0
        order = torch.argsort(split.lengths)
        if id(split) not in self._eval_preps:  # the frozen prefix of the held-out split, once
            self._eval_preps[id(split)] = [
                (order[s:s + 100], self.prepare(split, order[s:s + 100]))
                for s in range(0, len(split), 100)]
        for idx, prep in self._eval_preps[id(split)]:
            p = self.unflat(theta)
            logits = self._logits(p, prep)
            correct += int((logits.argmax(1) == split.y[idx]).sum())
        return correct / len(split)


def zo_run(cache: dict[str, Any], run: ZoRun, seed: int, eval_split: str,
           head_init: torch.Tensor | None = None, save_head: Path | None = None
           ) -> dict[str, Any]:
    prob = ZoProblem(cache, run, seed)
    pool, ev = Split(cache["pool"]), Split(cache[eval_split])
    parts = [torch.from_numpy(p) for p in cache["parts"]]
    n_k = torch.tensor([float(len(p)) for p in parts], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1000 + seed)
    phi = torch.zeros(prob.numel)
    if head_init is not None:  # phi of the head such that theta = head_init (c_head units)
        n_head = head_init.numel()
        phi[:n_head] = (head_init - prob.theta0[:n_head]) / prob.scale[:n_head]
    theta = lambda ph: prob.theta0 + prob.scale * ph  # noqa: E731
    curve = [(0, prob.accuracy(theta(phi), ev))]
    # the training loss on a fixed 2,000 of the pool: the objective, less noisy than accuracy
    tr_idx = train_subset(cache["parts"])
    losses = [(0, prob.train_loss(theta(phi), pool, tr_idx))]
    started = time.perf_counter()
    history: list[torch.Tensor] = []
    for r in range(run.rounds):
        chosen = (torch.arange(len(parts)) if run.per_round >= len(parts)
                  else torch.randperm(len(parts), generator=gen)[:run.per_round])
        idx, owner = [], []
        for d in chosen.tolist():
            part = parts[d]
            take = part[torch.randperm(len(part), generator=gen)[:min(run.batch, len(part))]]
            idx.append(take)
            owner += [d] * len(take)
        idx_t = torch.cat(idx)
        owner_t = torch.tensor(owner)
        prep = prob.prepare(pool, idx_t)
        y = pool.y[idx_t]
        z = (torch.randint(0, 2, (run.perturbations, prob.numel), generator=gen) * 2 - 1
             ).float()
        per_coord = float(run.perturbations)
        if run.blocks > 1:
            body = torch.cat([torch.full((n,), float(not nm.startswith("classifier")))
                              for nm, n in zip(prob.names, prob.sizes, strict=True)])
            block = torch.arange(run.perturbations) % run.blocks
            z = z * torch.where(block[:, None] == 0, 1 - body, body)
            per_coord = run.perturbations / run.blocks
        lp = prob.losses(theta(phi + run.eps * z), prep, y)  # [P, N]
        lm = prob.losses(theta(phi - run.eps * z), prep, y)
        diff = ((lp - lm) / (2 * run.eps)).double()
        # per-device mean over its batch, then the n_k-weighted mean over devices
        g = torch.zeros(run.perturbations, dtype=torch.float64)
        wsum = 0.0
        for d in chosen.tolist():
            sel = owner_t == d
            g += n_k[d] * diff[:, sel].mean(1)
            wsum += float(n_k[d])
        g /= wsum
        lr = run.lr * (run.lr_final + (1 - run.lr_final)
                       * 0.5 * (1 + math.cos(math.pi * r / max(1, run.rounds - 1))))
        u = -(lr / per_coord) * (g.float() @ z)
        if run.momentum:
            history.append(u)
            if run.window and len(history) > run.window:
                history.pop(0)
            # the windowed heavy ball: past rounds' updates re-applied with beta^age
            u = cast(torch.Tensor, sum(run.momentum ** (len(history) - 1 - i) * h
                                       for i, h in enumerate(history)))
        phi = phi + u
        if (r + 1) % run.eval_every == 0 or r + 1 == run.rounds:
            curve.append((r + 1, prob.accuracy(theta(phi), ev)))
            losses.append((r + 1, prob.train_loss(theta(phi), pool, tr_idx)))
            print(f"    {run.scope} c {run.c_body:g} lr {run.lr:g} m {run.momentum:g} "
                  f"round {r + 1}: {eval_split} {curve[-1][1]:.4f} train loss "
                  f"{losses[-1][1]:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    wall = time.perf_counter() - started
    if save_head is not None:
        torch.save(theta(phi)[:prob.sizes[0] + prob.sizes[1]].clone(), save_head)
    return {"run": run.__dict__, "seed": seed, "numel": prob.numel, "curve": curve,
            "train_loss": losses, "final": curve[-1][1], "seconds": wall}


def fo_head(cache: dict[str, Any], lr: float, c_bias: float, momentum: float, rounds: int,
            batch: int, seed: int, eval_split: str, eval_every: int) -> dict[str, Any]:
    """First-order SGD of the head alone with the fleet's rounds: every device's batch, the
    n_k-weighted mean of their losses, one step a round; the bias steps c_bias x lr (the
    step scale, in theta units c^2 lr). What ZO with many seeds a round approaches, and the
    top eigenvalues of the features' second moment (the head's curvature up to the softmax's)."""
    def feats(split: Split) -> torch.Tensor:
        rows = []
        for s in range(0, len(split), 200):
            h, m = split.batch(torch.arange(s, min(s + 200, len(split))), 6)
            rows.append(F.normalize((h * m[..., None]).sum(1) / m.sum(1, keepdim=True), dim=-1))
        return torch.cat(rows)
    pool, ev = Split(cache["pool"]), Split(cache[eval_split])
    xp, xv = feats(pool), feats(ev)
    eig = torch.linalg.eigvalsh(xp.T @ xp / len(xp))
    parts = [torch.from_numpy(p) for p in cache["parts"]]
    n_k = torch.tensor([float(len(p)) for p in parts])
    gen = torch.Generator().manual_seed(2000 + seed)
    w = cache["params"]["classifier.weight"].clone().requires_grad_()
    b = cache["params"]["classifier.bias"].clone().requires_grad_()
    vw, vb = torch.zeros_like(w), torch.zeros_like(b)
    curve = []
    for r in range(rounds):
        loss = sum(n_k[d] * F.cross_entropy(xp[take] @ w.T + b, pool.y[take])
                   for d, p in enumerate(parts)
                   for take in [p[torch.randperm(len(p), generator=gen)[:batch]]]) / n_k.sum()
        gw, gb = torch.autograd.grad(loss, [w, b])
        with torch.no_grad():
            vw, vb = momentum * vw + gw, momentum * vb + c_bias * gb
            w -= lr * vw
            b -= lr * vb
            if (r + 1) % eval_every == 0:
                curve.append((r + 1, float(((xv @ w.T + b).argmax(1) == ev.y).float().mean())))
    return {"lr": lr, "c_bias": c_bias, "momentum": momentum, "seed": seed, "curve": curve,
            "eig_top": eig[-3:].tolist(), "eig_median": float(eig[len(eig) // 2]),
            "mean_norm": float(xp.mean(0).norm())}


# ------------------------------------------------------------------------------------------
# cost per probe (one device batch of 16, as a device pays it)


def probe_cost(cache: dict[str, Any], scopes: list[str], repeats: int) -> list[dict[str, Any]]:
    pool = Split(cache["pool"])
    out = []
    idx = torch.arange(16) * 400 + 3
    for scope in scopes:
        prob = ZoProblem(cache, ZoRun(scope), 0)
        prep = prob.prepare(pool, idx)
        th = prob.theta0[None].clone()
        y = pool.y[idx]
        prob.losses(th, prep, y)
        t0 = time.perf_counter()
        for _ in range(repeats):
            th.add_(1e-3)
            prob.losses(th, prep, y)
        per = (time.perf_counter() - t0) / repeats
        t0 = time.perf_counter()
        for _ in range(max(1, repeats // 10)):
            prob.prepare(pool, idx)
        shared = (time.perf_counter() - t0) / max(1, repeats // 10)
        out.append({"scope": scope, "numel": prob.numel, "start_layer": prob.start,
                    "ms_per_probe": 1000 * per, "ms_shared_per_batch": 1000 * shared})
        print(f"  {scope:10s} numel {prob.numel:8d} probe {1000 * per:7.2f} ms  shared prefix "
              f"{1000 * shared:7.2f} ms / batch of 16", flush=True)
    return out


# ------------------------------------------------------------------------------------------


def check_layers(cache: dict[str, Any]) -> float:
    """The functional layers reproduce the cached encoder states (float tolerance)."""
    sp = Split(cache["val"])
    idx = torch.arange(64)
    h, mask = sp.batch(idx, 4)
    madd = ((1.0 - mask) * torch.finfo(h.dtype).min)[:, None, None, :]
    with torch.no_grad():
        h5 = layer_forward(cache["params"], 4, h, madd)
    ref, _ = sp.batch(idx, 5)
    return float(((h5 - ref) * mask[..., None]).abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("body_sweep")
    ap.add_argument("what", choices=["cache", "fo", "fohead", "zo", "cost", "check"])
    ap.add_argument("--data", type=Path, required=True, help="SST-2 train.tsv (label, sentence)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--cache-dir", type=Path, default=Path("runs"))
    ap.add_argument("--format", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scopes", nargs="+", default=["head"])
    ap.add_argument("--scope", default="ffo5")
    ap.add_argument("--lr", type=float, nargs="+", default=[4.0])
    ap.add_argument("--eps", type=float, nargs="+", default=[1e-3])
    ap.add_argument("--c-body", type=float, nargs="+", default=[0.05])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--perturbations", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=1, help="block seeds (2: head / body)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--momentum", type=float, nargs="+", default=[0.0],
                    help="server heavy-ball momentum beta on each round's update")
    ap.add_argument("--window", type=int, default=0, help="momentum window in rounds (0: all)")
    ap.add_argument("--c-bias", type=float, default=1.0, help="step scale of classifier.bias")
    ap.add_argument("--lr-final", type=float, default=1.0,
                    help="cosine-decay the lr to lr * this at the last round")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--fo-batch", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0,
                    help="zo: run seeds first-seed .. first-seed + seeds - 1 (split runs apart)")
    ap.add_argument("--head-init", default=None, help="a .pt flat head to start from")
    ap.add_argument("--save-head", type=Path, default=None, help="save the final flat head")
    ap.add_argument("--test", action="store_true", help="score test (only to confirm a choice)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = load_cache(args.format, args.cache_dir, args.data, args.model)
    split = "test" if args.test else "val"
    rows: list[dict[str, Any]] = []
    if args.what == "check":
        print(f"max |functional layer 4 - encoder| = {check_layers(cache):.2e}")
    elif args.what == "fo":
        for scope, lr in itertools.product(args.scopes, args.lr):
            r = fo_ceiling(cache, scope, lr, args.epochs, args.fo_batch, 0, split)
            rows.append(r)
            print(f"FO {scope:10s} lr {lr:g} numel {r['numel']:8d} start {r['start_layer']} "
                  f"acc0 {r['acc0']:.4f} best {r['best']:.4f} final {r['final']:.4f} "
                  f"{r['seconds']:.0f} s", flush=True)
    elif args.what == "fohead":
        for lr, beta in itertools.product(args.lr, args.momentum):
            r = fo_head(cache, lr, args.c_bias, beta, args.rounds, args.batch, 0, split,
                        args.eval_every)
            rows.append(r)
            print(f"FO head lr {lr:g} c_bias {args.c_bias:g} m {beta:g}: "
                  f"{[round(a, 3) for _, a in r['curve']]} (features: |mean| "
                  f"{r['mean_norm']:.2f}, top eigenvalues {[round(e, 3) for e in r['eig_top']]}, "
                  f"median {r['eig_median']:.4f})", flush=True)
    elif args.what == "zo":
        head = torch.load(args.head_init) if args.head_init else None
        for lr, eps, c, beta in itertools.product(args.lr, args.eps, args.c_body, args.momentum):
            run = ZoRun(args.scope, lr, eps, args.perturbations, args.rounds, args.batch, c, 1.0,
                        args.rank, args.per_round, args.eval_every, args.blocks, beta,
                        args.window, args.c_bias, args.lr_final)
            res = [zo_run(cache, run, s, split, head, args.save_head)
                   for s in range(args.first_seed, args.first_seed + args.seeds)]
            accs = [r["final"] for r in res]
            rows.append({"run": run.__dict__, "finals": accs, "curves": [r["curve"] for r in res],
                         "train_loss": [r["train_loss"] for r in res],
                         "seconds": [r["seconds"] for r in res], "numel": res[0]["numel"]})
            each = " ".join(f"{a:.3f}" for a in accs)
            print(f"ZO {args.scope} lr {lr:g} eps {eps:g} c {c:g} m {beta:g} "
                  f"P {run.perturbations} R {run.rounds} mean {np.mean(accs):.4f} ({each}) "
                  f"curve {[round(a, 3) for _, a in res[0]['curve']]} "
                  f"{np.mean([r['seconds'] for r in res]):.0f} s/run", flush=True)
    elif args.what == "cost":
        rows = probe_cost(cache, args.scopes, 50)
    if args.json:
        write_json(args.json, rows, newline=False, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
