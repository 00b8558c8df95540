"""`seedfed ternarize`: make a ternary (BitNet b1.58) base from a pretrained fp32 encoder.

No pretrained BitNet encoder can be downloaded here, so the project makes its own, the way
BitNet distillation does: a one-off, centralized, first-order quantization-aware distillation.
The student is a copy of the fp32 sentence encoder whose Linear layers are BitLinear (ternary
weights {-1, 0, +1} times the per-matrix absmean gamma, activations fake-quantized per token to
8 bits, straight-through gradients); it learns, on unlabelled sentences, to reproduce the fp32
model's mean-pooled sentence embeddings (cosine) and its last-layer token states (cosine).
Everything of the student trains (latents, biases, norms, embeddings) with AdamW; gamma is
recomputed from the latents after every step, as the task's conversion will compute it.

The result is a normal sentence-transformers model directory whose Linear weights hold the
distilled fp32 latents: a task with scope `ternary` converts them with gamma = mean |W|, which
is exactly the gamma the distillation ended on, so the fleet starts from the distilled ternary
model. `ternary.json` next to the weights records the settings, the wall time and the base's
zero-shot and linear-probe accuracy next to the fp32 model's (and next to a plain
ternarization without distillation). A directory whose `ternary.json` holds the same settings
key is reused, not rebuilt (`ensure_base`), so tests and demos pay for it once.

Causal LMs (`ternarize_causal`, `seedfed ternarize --model-kind causal_lm`): no small pretrained
Llama is packaged, so the project builds one from `CausalLMConfig` (a BPE tokenizer trained on
the training sentences, a Llama-shaped model), pretrains it first-order on next-token loss, and
distils that fp32 teacher into its BitLinear copy (KL on the next-token distributions plus
next-token cross-entropy) through the same training loop (`_fit`). `--teacher DIR` takes the
pretraining stage from a `seedfed lm-base` directory of the same data and settings
(`seedfed/lm_base.py`), so an fp32 base and its ternary twin share one pretraining. The
directory is a normal Hugging Face causal-LM directory with its tokenizer, cached by its own
settings key (`ensure_causal_base`); `ternary.json` holds the validation perplexities and the
wall times.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

#: Metadata file of a distilled base.
META_FILE = "ternary.json"
#: Files of the source directory that are weights (replaced by the student's) or irrelevant.
_SKIP_FILES = (".safetensors", ".bin", ".onnx", ".h5", ".msgpack", ".ot")
_SKIP_DIRS = ("onnx", "openvino")


@dataclass(frozen=True)
class TernarizeConfig:
    """Settings of one distillation (all of them enter the cache key)."""

    sentences: int = 16000  # unlabelled training sentences distilled on (docs/ternary.md)
    max_len: int = 32  # tokens per sentence (truncated)
    epochs: int = 1
    batch_size: int = 32
    lr: float = 3e-4  # AdamW peak (linear warm-up over 5% of steps, cosine decay to 10%)
    weight_decay: float = 0.0
    token_weight: float = 1.0  # weight of the last-layer token-state cosine term
    act_bits: int | None = 8  # BitNet b1.58: 8-bit per-token activations (None: float)
    probe_train: int = 1000  # labelled training examples of the linear probe
    eval_size: int = 1000  # validation examples scored (zero-shot and probe)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sentences", "max_len", "epochs", "batch_size", "probe_train",
                     "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        if self.act_bits is not None and not 2 <= self.act_bits <= 16:
            raise ValueError(f"act_bits must lie in [2, 16] or be None, got {self.act_bits}")


@dataclass(frozen=True)
class Scores:
    zero_shot: float  # prototype head from the label descriptions, no training
    linear_probe: float  # logistic regression on the frozen embeddings


def settings_key(model: Path, data: Path, config: TernarizeConfig) -> str:
    """What identifies a distilled base: the source weights, the data file and the settings."""
    h = hashlib.sha256()
    for f in sorted(model.glob("*.safetensors")) + [data]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update(json.dumps(asdict(config), sort_keys=True).encode())
    return h.hexdigest()


def read_meta(out: Path) -> dict[str, Any] | None:
    path = out / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


# -- the student --------------------------------------------------------------------------------

def _frozen(model: nn.Module) -> nn.Module:
    """`model` in eval mode with no parameter requiring a gradient (a teacher, or a result)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _student(encoder: nn.Module, act_bits: int | None) -> nn.Module:
    from seedfed.shared.model.ternary import bitlinear_modules, convert_to_bitlinear

    student = copy.deepcopy(encoder)
    convert_to_bitlinear(student, act_bits=act_bits)
    for p in student.parameters():
        p.requires_grad_(True)
    for _, m in bitlinear_modules(student):
        m.refresh_gamma()
    return student.train()


def _refresh_gammas(model: nn.Module) -> None:
    from seedfed.shared.model.ternary import bitlinear_modules

    with torch.no_grad():
        for _, m in bitlinear_modules(model):
            m.refresh_gamma()


def _pool(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(states.dtype)
    return (states * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def _distill_loss(student: nn.Module, teacher: nn.Module, batch: dict[str, torch.Tensor],
                  token_weight: float) -> torch.Tensor:
    mask = batch["attention_mask"]
    with torch.no_grad():
        t_states = teacher(**batch).last_hidden_state
    s_states = student(**batch).last_hidden_state
    pooled = 1 - nn.functional.cosine_similarity(_pool(s_states, mask), _pool(t_states, mask),
                                                 dim=-1).mean()
    tok = 1 - nn.functional.cosine_similarity(s_states, t_states, dim=-1)
    m = mask.to(tok.dtype)
    token = (tok * m).sum() / m.sum().clamp_min(1.0)
    return pooled + token_weight * token


def _lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _fit(model: nn.Module, loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
         tokenizer: Any, texts: Sequence[str], *, epochs: int, batch_size: int, max_len: int,
         lr: float, weight_decay: float, seed: int, lm: bool,
         on_step: Callable[[int, int, float], None] | None = None) -> None:
    """First-order training of every parameter of `model` with AdamW (warm-up, cosine to
    10%), `loss_fn` on shuffled batches of `texts` (next-token targets when `lm`); gamma of
    every BitLinear is recomputed after each step (the forward's gamma follows the latents,
    as a ternary task's conversion computes it)."""
    from seedfed.client.data import lm_targets, tokenize

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=lr, weight_decay=weight_decay)
    rng = np.random.default_rng(seed)
    per_epoch = -(-len(texts) // batch_size)
    total, step = per_epoch * epochs, 0
    for _ in range(epochs):
        order = rng.permutation(len(texts))
        for b in range(per_epoch):
            idx = order[b * batch_size:(b + 1) * batch_size]
            batch = tokenize(tokenizer, [texts[i] for i in idx], None, max_len)
            if lm:
                batch = lm_targets(batch)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total, lr)
            loss = loss_fn(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            _refresh_gammas(model)
            step += 1
            if on_step is not None:
                on_step(step, total, float(loss.detach()))


def _distilled(teacher: nn.Module, act_bits: int | None, init_seed: int,
               loss: Callable[[nn.Module, nn.Module, dict[str, torch.Tensor]], torch.Tensor],
               tokenizer: Any, texts: Sequence[str], **fit: Any) -> nn.Module:
    """The BitLinear student of `teacher` (torch seeded with `init_seed` first), trained by
    `_fit` (`fit`: its keyword arguments) on `loss(student, teacher, batch)`, returned frozen."""
    torch.manual_seed(init_seed)
    teacher = _frozen(teacher)
    student = _student(teacher, act_bits)
    _fit(student, lambda batch: loss(student, teacher, batch), tokenizer, texts, **fit)
    return _frozen(student)

def distill(teacher: nn.Module, tokenizer: Any, texts: Sequence[str], config: TernarizeConfig,
            on_step: Callable[[int, int, float], None] | None = None) -> nn.Module:
    """The BitLinear student of `teacher` (an encoder returning `last_hidden_state`), trained
    to reproduce its token states and mean-pooled embeddings on `texts`."""
    return _distilled(teacher, config.act_bits, config.seed,
                      lambda s, t, batch: _distill_loss(s, t, batch, config.token_weight),
                      tokenizer, texts, epochs=config.epochs, batch_size=config.batch_size,
                      max_len=config.max_len, lr=config.lr, weight_decay=config.weight_decay,
                      seed=config.seed, lm=False, on_step=on_step)


# -- scoring ------------------------------------------------------------------------------

@torch.no_grad()
def _embeddings(model: Any, tokenizer: Any, texts: Sequence[str], max_len: int,
                batch: int = 64) -> torch.Tensor:
    from seedfed.client.data import tokenize

    out = []
    for i in range(0, len(texts), batch):
        enc = tokenize(tokenizer, texts[i:i + batch], None, max_len)
        out.append(model.embed(**enc))
    return torch.cat(out)


def _probe(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor,
           test_y: torch.Tensor, classes: int, l2: float = 1e-4) -> float:
    """Accuracy of an L2-regularized logistic regression (LBFGS) on standardized features."""
    mu, sd = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    xs, xt = (train_x - mu) / sd, (test_x - mu) / sd
    w = torch.zeros(xs.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(xs @ w + b, train_y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return float(((xt @ w + b).argmax(1) == test_y).float().mean())


def score(encoder: nn.Module, tokenizer: Any, normalize: bool, label_texts: tuple[str, ...],
          probe: Any, held: Any, max_len: int) -> Scores:
    """Zero-shot (prototype head) and linear-probe accuracy of a sentence encoder."""
    from seedfed.shared.model.classifier import MeanPoolClassifier
    from seedfed.shared.model.head import init_prototype_head

    model = MeanPoolClassifier(encoder, len(label_texts), normalize).eval()
    init_prototype_head(model, tokenizer, label_texts)
    test_x = _embeddings(model, tokenizer, held.texts, max_len)
    test_y = torch.as_tensor(held.labels, dtype=torch.long)
    with torch.no_grad():
        zero = float((model.classifier(test_x).argmax(1) == test_y).float().mean())
    train_x = _embeddings(model, tokenizer, probe.texts, max_len)
    train_y = torch.as_tensor(probe.labels, dtype=torch.long)
    return Scores(zero_shot=zero, linear_probe=_probe(train_x, train_y, test_x, test_y,
                                                        len(label_texts)))


# -- the model directory ------------------------------------------------------------------

def latent_linears(model: nn.Module) -> nn.Module:
    """A copy of a BitLinear model with every BitLinear back as nn.Linear holding its latents
    (what `save_pretrained` writes and what a ternary task converts again)."""
    from seedfed.shared.model.ternary import bitlinear_modules

    out = copy.deepcopy(model)
    for name, m in bitlinear_modules(out):
        if m.weight is None:
            raise ValueError(f"{name} is packed: only a latent-form model can be saved")
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(m.weight)
            if m.bias is not None:
                lin.bias.copy_(m.bias)
        out.set_submodule(name, lin)
    return out


def write_base(student: nn.Module, source: Path, out: Path, meta: dict[str, Any]) -> Path:
    """Write the distilled base as a model directory like `source` (tokenizer, pooling and
    normalization modules copied; weights = the student's latents), then `ternary.json`."""
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_dir():
            if f.name not in _SKIP_DIRS:
                shutil.copytree(f, out / f.name, dirs_exist_ok=True)
        elif not f.name.endswith(_SKIP_FILES) and f.name != META_FILE:
            shutil.copy2(f, out / f.name)
    latent_linears(student).save_pretrained(out)  # type: ignore[operator]
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


def ternarize(model: Path, data: Path, out: Path, config: TernarizeConfig,
              label_texts: tuple[str, ...],
              on_step: Callable[[int, int, float], None] | None = None,
              score_sources: bool = True) -> dict[str, Any]:
    """Distil `model` (a sentence-transformers directory) into a ternary base at `out`;
    returns the metadata written to `out/ternary.json`. `data` is a labelled TSV/JSONL: its
    training split's sentences (labels dropped) are distilled on; the probe trains on its
    labels and both scores are taken on its validation split."""
    from seedfed.client.device_data import dataset_splits
    from seedfed.shared.model.hf import load_base, sentence_pooling
    from seedfed.shared.protocol.task import TaskSpec

    pooling = sentence_pooling(model)
    if pooling is None:
        raise ValueError(f"{model} is not a mean-pooling sentence-transformers directory "
                         "(no modules.json with a mean Pooling module)")
    splits = dataset_splits(str(data))  # the split every simulation and benchmark uses
    order = training_order(len(splits.train), config.seed)
    texts = [splits.train.texts[i] for i in order[:config.sentences]]
    probe = splits.train.subset(order[len(order) - config.probe_train:])
    held = splits.validation.subset(range(min(config.eval_size, len(splits.validation))))
    teacher_model, tokenizer = load_base(TaskSpec(model_path=str(model), model_kind="seq_cls",
                                                  num_labels=len(label_texts)))
    teacher = teacher_model.encoder
    assert isinstance(teacher, nn.Module), "a sentence-transformers directory loads an encoder"

    def scored(encoder: nn.Module) -> dict[str, float]:
        return asdict(score(encoder, tokenizer, pooling.normalize, label_texts, probe, held,
                            config.max_len))

    accuracy: dict[str, dict[str, float]] = {}
    if score_sources:
        accuracy["fp32"] = scored(teacher)
        accuracy["ternary_undistilled"] = scored(_student(teacher, config.act_bits).eval())
    started = time.perf_counter()
    student = distill(teacher, tokenizer, texts, config, on_step)
    wall = time.perf_counter() - started
    accuracy["ternary_distilled"] = scored(student)
    meta = {"source": model.name, "data": data.name, "config": asdict(config),
            "key": settings_key(model, data, config), "distill_seconds": round(wall, 1),
            "threads": torch.get_num_threads(), "sentences": len(texts),
            "accuracy": accuracy, "scored_on": f"validation split ({len(held)} examples)"}
    write_base(student, model, out, meta)
    return meta


def ensure_base(model: Path, data: Path, out: Path, config: TernarizeConfig,
                label_texts: tuple[str, ...],
                on_step: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """`ternarize`, unless `out` already holds a base distilled with the same settings key."""
    meta = read_meta(out)
    if meta is not None and meta.get("key") == settings_key(model, data, config) and \
            (out / "model.safetensors").is_file():
        return meta
    return ternarize(model, data, out, config, label_texts, on_step)


def run_with_progress(model: Path, data: Path, out: Path, config: TernarizeConfig,
                      label_texts: tuple[str, ...], force: bool = False) -> dict[str, Any]:
    """`ensure_base` (or `ternarize` with `force`) with a rich progress bar and a table."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    columns = [TextColumn("[bold]distil {task.completed}/{task.total}"), BarColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("distil", total=None, loss="-")

        def on_step(step: int, total: int, loss: float) -> None:
            progress.update(bar, completed=step, total=total, loss=f"{loss:.4f}")

        fn = ternarize if force else ensure_base
        meta = fn(model, data, out, config, label_texts, on_step)
    table = Table(title=f"ternary base {out} ({meta['scored_on']})")
    for col in ("model", "zero-shot", "linear probe"):
        table.add_column(col, justify="right")
    for name, s in meta["accuracy"].items():
        table.add_row(name, f"{s['zero_shot']:.4f}", f"{s['linear_probe']:.4f}")
    console.print(table)
    console.print(f"distillation: {meta['distill_seconds']:.0f} s on {meta['threads']} "
                  f"thread(s), {meta['sentences']} sentences x {config.epochs} epochs")
    return meta


# -- causal LMs: a small Llama made here, pretrained, then distilled into BitLinear ---------------
#
# No small pretrained Llama is packaged, so the project makes the whole chain itself, on the
# training split's sentences (labels dropped): a byte-level BPE tokenizer trained on them, a
# Llama-shaped model built from `CausalLMConfig`, pretrained first-order on next-token loss
# (the fp32 teacher), then distilled into its BitLinear copy. Distillation rather than plain
# QAT on next-token loss: the teacher's whole next-token distribution is a denser target than
# the one observed token when the corpus is a few thousand sentences, and it is the encoder's
# machinery (student = converted copy of the teacher, gamma refreshed every step); the loss
# keeps a next-token term (`hard_weight`) so the student also sees the data itself.

#: The tokenizer's special tokens (pad first: id 0).
LM_SPECIALS = ("<pad>", "<s>", "</s>")


@dataclass(frozen=True)
class CausalLMConfig:
    """Settings of a causal-LM base (all of them enter the cache key)."""

    vocab: int = 4096  # BPE vocabulary trained on the pretraining sentences
    hidden: int = 192
    layers: int = 3
    heads: int = 4
    intermediate: int = 512
    sentences: int = 6000  # training-split sentences pretrained and distilled on
    max_len: int = 32
    batch_size: int = 32
    pretrain_epochs: int = 2
    pretrain_lr: float = 2e-3
    distill_epochs: int = 1
    distill_lr: float = 1e-3
    hard_weight: float = 0.5  # weight of the next-token cross-entropy next to the KL term
    weight_decay: float = 0.0
    act_bits: int | None = 8
    eval_size: int = 500  # validation sentences whose perplexity is reported
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "intermediate", "sentences",
                     "max_len", "batch_size", "pretrain_epochs", "distill_epochs", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        for name in ("pretrain_lr", "distill_lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
        if self.act_bits is not None and not 2 <= self.act_bits <= 16:
            raise ValueError(f"act_bits must lie in [2, 16] or be None, got {self.act_bits}")


def training_order(n: int, seed: int) -> np.ndarray:
    """The order in which a base takes training-split sentences: it uses the first
    `sentences`, so whoever needs sentences the base never saw takes them from the end."""
    return np.random.default_rng([seed, 7]).permutation(n)


def causal_settings_key(data: Path, config: CausalLMConfig) -> str:
    """What identifies a causal-LM base: the data file and the settings (no source model)."""
    st = data.stat()
    h = hashlib.sha256(f"causal_lm:{data.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update(json.dumps(asdict(config), sort_keys=True).encode())
    return h.hexdigest()


def train_tokenizer(texts: Sequence[str], vocab: int) -> Any:
    """A byte-level BPE tokenizer (no unknown token) trained on `texts`; every encoding
    starts with <s>, so the first word is predicted too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(LM_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos = LM_SPECIALS[1]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=LM_SPECIALS[0],
                                   bos_token=bos, eos_token=LM_SPECIALS[2])


def build_causal_lm(config: CausalLMConfig, tokenizer: Any) -> nn.Module:
    """A freshly initialized Llama-shaped LM of `config`'s shape (seeded), untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=config.hidden,
                      intermediate_size=config.intermediate, num_hidden_layers=config.layers,
                      num_attention_heads=config.heads, num_key_value_heads=config.heads,
                      max_position_embeddings=max(64, config.max_len + 1),
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _lm_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"],
                 attention_mask=batch.get("attention_mask")).logits[:, :-1].float()


def _kd_loss(student: nn.Module, teacher: nn.Module, batch: dict[str, torch.Tensor],
             hard_weight: float) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions over the real (non-padding)
    positions, plus `hard_weight` x the next-token cross-entropy."""
    with torch.no_grad():
        t_logp = torch.log_softmax(_lm_logits(teacher, batch), dim=-1)
    s_logits = _lm_logits(student, batch)
    s_logp = torch.log_softmax(s_logits, dim=-1)
    target = batch["labels"][:, 1:]
    keep = (target != -100).to(s_logp.dtype)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    soft = (kl * keep).sum() / keep.sum().clamp_min(1.0)
    hard = nn.functional.cross_entropy(s_logits.reshape(-1, s_logits.size(-1)),
                                       target.reshape(-1), ignore_index=-100)
    return soft + hard_weight * hard


def pretrain(model: nn.Module, tokenizer: Any, texts: Sequence[str], config: CausalLMConfig,
             on_step: Callable[[int, int, float], None] | None = None) -> nn.Module:
    """First-order next-token pretraining of an fp32 causal LM on `texts` (AdamW)."""
    from seedfed.shared.model.objectives import causal_lm_loss

    model.train()
    _fit(model, lambda batch: causal_lm_loss(model, batch), tokenizer, texts,
         epochs=config.pretrain_epochs, batch_size=config.batch_size, max_len=config.max_len,
         lr=config.pretrain_lr, weight_decay=config.weight_decay, seed=config.seed, lm=True,
         on_step=on_step)
    return _frozen(model)


def distill_causal(teacher: nn.Module, tokenizer: Any, texts: Sequence[str],
                   config: CausalLMConfig,
                   on_step: Callable[[int, int, float], None] | None = None) -> nn.Module:
    """The BitLinear student of a causal LM (every Linear but `lm_head`), distilled from its
    next-token distributions on `texts`."""
    return _distilled(teacher, config.act_bits, config.seed,
                      lambda s, t, batch: _kd_loss(s, t, batch, config.hard_weight),
                      tokenizer, texts, epochs=config.distill_epochs,
                      batch_size=config.batch_size, max_len=config.max_len,
                      lr=config.distill_lr, weight_decay=config.weight_decay,
                      seed=config.seed + 1, lm=True, on_step=on_step)


@torch.no_grad()
def next_token_nll(model: nn.Module, tokenizer: Any, texts: Sequence[str], max_len: int,
                   batch: int = 64) -> tuple[float, int]:
    """(summed next-token negative log-likelihood, target tokens) of `texts`: pooled
    perplexity over several sets is exp(sum of sums / sum of tokens)."""
    from seedfed.client.data import lm_targets, tokenize

    total, tokens = 0.0, 0
    for i in range(0, len(texts), batch):
        b = lm_targets(tokenize(tokenizer, texts[i:i + batch], None, max_len))
        logits, target = _lm_logits(model, b), b["labels"][:, 1:]
        total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                   target.reshape(-1), ignore_index=-100,
                                                   reduction="sum"))
        tokens += int((target != -100).sum())
    return total, tokens


def perplexity(model: nn.Module, tokenizer: Any, texts: Sequence[str], max_len: int) -> float:
    total, tokens = next_token_nll(model, tokenizer, texts, max_len)
    return math.exp(total / tokens) if tokens else float("nan")


def ternarize_causal(data: Path, out: Path, config: CausalLMConfig,
                     on_step: Callable[[str, int, int, float], None] | None = None,
                     teacher_dir: Path | None = None) -> dict[str, Any]:
    """Make a ternary causal-LM base at `out` from the training split of `data` (a labelled
    TSV/JSONL; labels dropped): tokenizer, fp32 pretraining, distillation into BitLinear.
    `teacher_dir`: a `seedfed lm-base` directory made from the same data and settings, whose
    tokenizer and fp32 model are the pretraining stage (then not run again). Returns the
    metadata written to `out/ternary.json` (validation perplexity of the fp32 teacher, of its
    plain ternarization and of the distilled base; the wall times)."""
    from seedfed.client.device_data import dataset_splits

    splits = dataset_splits(str(data))
    order = training_order(len(splits.train), config.seed)
    texts = [splits.train.texts[i] for i in order[:config.sentences]]
    held = list(splits.validation.texts[:config.eval_size])
    started, cpu = time.perf_counter(), time.process_time()

    def phase(name: str) -> Callable[[int, int, float], None] | None:
        return None if on_step is None else (lambda s, t, loss: on_step(name, s, t, loss))

    if teacher_dir is not None:
        tokenizer, teacher = _pretrained_teacher(data, teacher_dir, config)
    else:
        tokenizer = train_tokenizer(texts, config.vocab)
        teacher = pretrain(build_causal_lm(config, tokenizer), tokenizer, texts, config,
                           phase("pretrain"))
    pretrained = time.perf_counter()
    student = distill_causal(teacher, tokenizer, texts, config, phase("distill"))
    done = time.perf_counter()
    ppl = {"fp32": perplexity(teacher, tokenizer, held, config.max_len),
           "ternary_undistilled": perplexity(_student(teacher, config.act_bits).eval(),
                                             tokenizer, held, config.max_len),
           "ternary_distilled": perplexity(student, tokenizer, held, config.max_len)}
    meta = {"model_kind": "causal_lm", "data": data.name, "config": asdict(config),
            "key": causal_settings_key(data, config),
            "pretrain_seconds": round(pretrained - started, 1),
            "distill_seconds": round(done - pretrained, 1),
            "make_seconds": round(done - started, 1),
            "make_cpu_seconds": round(time.process_time() - cpu, 1),
            "threads": torch.get_num_threads(), "sentences": len(texts),
            "parameters": sum(p.numel() for p in teacher.parameters()),
            "perplexity": ppl, "scored_on": f"validation split ({len(held)} sentences)"}
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    latent_linears(student).save_pretrained(out)  # type: ignore[operator]
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


#: The settings of `CausalLMConfig` that make the fp32 teacher (the others: the distillation).
_PRETRAIN_FIELDS = ("vocab", "hidden", "layers", "heads", "intermediate", "sentences", "max_len",
                    "batch_size", "pretrain_epochs", "pretrain_lr", "weight_decay", "seed")


def _pretrained_teacher(data: Path, teacher_dir: Path, config: CausalLMConfig,
                        ) -> tuple[Any, nn.Module]:
    """The tokenizer and frozen fp32 model of a `seedfed lm-base` directory, checked to be
    the pretraining stage of these settings (`lm_base.json`'s key)."""
    from seedfed.shared.model.hf import load_base
    from seedfed.shared.protocol.task import TaskSpec

    meta = json.loads((teacher_dir / "lm_base.json").read_text(encoding="utf-8"))
    made = CausalLMConfig(**meta.get("config", {}))
    if meta.get("key") != causal_settings_key(data, made) or any(
            getattr(made, f) != getattr(config, f) for f in _PRETRAIN_FIELDS):
        raise ValueError(f"{teacher_dir} was pretrained with other data or settings than "
                         "these; make it with `seedfed lm-base` on the same data")
    model, tokenizer = load_base(TaskSpec(model_path=str(teacher_dir), model_kind="causal_lm"))
    return tokenizer, _frozen(model)


def ensure_causal_base(data: Path, out: Path, config: CausalLMConfig,
                       on_step: Callable[[str, int, int, float], None] | None = None,
                       teacher_dir: Path | None = None) -> dict[str, Any]:
    """`ternarize_causal`, unless `out` already holds a base made with the same settings key."""
    meta = read_meta(out)
    if meta is not None and meta.get("key") == causal_settings_key(data, config) and \
            (out / "model.safetensors").is_file():
        return meta
    return ternarize_causal(data, out, config, on_step, teacher_dir)


def run_causal_with_progress(data: Path, out: Path, config: CausalLMConfig,
                             force: bool = False, teacher_dir: Path | None = None,
                             ) -> dict[str, Any]:
    """`ensure_causal_base` (or `ternarize_causal` with `force`) with a progress bar and a
    perplexity table."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    columns = [TextColumn("[bold]{task.fields[phase]} {task.completed}/{task.total}"),
               BarColumn(), TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("make", total=None, loss="-", phase="tokenizer")

        def on_step(phase: str, step: int, total: int, loss: float) -> None:
            progress.update(bar, completed=step, total=total, loss=f"{loss:.4f}", phase=phase)

        fn = ternarize_causal if force else ensure_causal_base
        meta = fn(data, out, config, on_step, teacher_dir)
    table = Table(title=f"causal-LM base {out} ({meta['scored_on']})")
    table.add_column("model")
    table.add_column("perplexity", justify="right")
    for name, v in meta["perplexity"].items():
        table.add_row(name, f"{v:.2f}")
    console.print(table)
    console.print(f"made in {meta['make_seconds']:.0f} s (pretrain {meta['pretrain_seconds']:.0f}"
                  f" s, distill {meta['distill_seconds']:.0f} s) on {meta['threads']} "
                  f"thread(s), {meta['sentences']} sentences")
    return meta
