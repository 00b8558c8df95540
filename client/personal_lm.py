"""A language-model device's personal part: a bias over the vocabulary, its owner's own, never sent.

The keyboard case: the shared model learns how the fleet writes; each owner writes in their own
way (their topics, their words). The personal part is a vector b over the vocabulary added to
the shared model's next-token logits, logits + b, trained on the device's own text after each
round's shared steps. It is the cheapest part that moves next-word suggestions towards the
owner's words, it costs V floats, and it applies on top of whatever shared version the device
syncs to, so every fleet improvement reaches the device at once.

Training is exact and forward-only: the gradient of the next-token cross-entropy with respect
to b is softmax(logits + b) - onehot(target), averaged over the batch's tokens, so a device
needs only the shared model's logits (one no-grad forward per batch), never a backward pass;
an L2 pull (`PersonalConfig.decay`) keeps b at zero where the owner's text says nothing.

The evidence check (the classifier's evidence gate does not apply: b does not depend on the
input): a tenth of the device's training text is held back, and b applies only while it
lowers the next-token loss there; otherwise the device scores and suggests with the shared
model alone.

The local-only reference (what the owner's text alone teaches, without the fleet or a
pretrained model) is a bigram model with absolute discounting over the same tokens.

A label-words device (`LabelPersonalPart`) keeps the same kind of part over its K label words:
a bias added to the class logits, the owner's own label prior (a device whose owner mostly
writes one sentiment), trained and checked the same way; its local-only reference predicts
the owner's most frequent label.

The stored state carries the task id and the model fingerprint, like the classifier's
(`client.personal`); a state of another task or model is refused and rebuilt.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from seedfed.client import data as data_mod
from seedfed.client.device_data import on_model_device
from seedfed.client.personal import (
    PersonalConfig,
    PersonalScores,
    PersonalStateError,
    model_fingerprint,
    state_metadata,
)
from seedfed.shared.model.factory import ModelBundle
from seedfed.shared.model.objectives import NextTokenCounts, next_token_counts, word_starts
from torch import nn

log = logging.getLogger(__name__)

#: `format` in a next-token LM's personal state file.
FORMAT = "seedfed-personal-lm/1"
#: `format` in a label-words LM's personal state file.
LABELS_FORMAT = "seedfed-personal-labels/1"
#: Share of the device's training texts held back for the evidence check.
CHECK_SHARE = 0.1
#: Texts per forward (the device's scoring batch).
BATCH = 32
#: Bigram discount of the local-only reference.
DISCOUNT = 0.75


@dataclass(frozen=True)
class LMScores:
    """One device's held-out next-word scores: the shared model, shared + personal, and
    the local-only bigram (`top3`: the keyboard metric; perplexities beside)."""

    shared: NextTokenCounts
    personal: NextTokenCounts
    local: NextTokenCounts | None


class _BiasPart:
    """A personal bias over `size` logits: its state, its exact Adam steps and the evidence
    check. A subclass says which logits (`_rows`) and what its local-only reference is."""

    format = FORMAT

    def __init__(self, config: PersonalConfig, task_id: str, fingerprint: str,
                 size: int) -> None:
        self.config, self.task_id, self.fingerprint, self.size = config, task_id, fingerprint, size
        self.refused: str | None = None
        self.reset()

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        self.bias = torch.zeros(self.size)
        self.active = False
        self.rounds = 0
        self._moments: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def to_bytes(self) -> bytes:
        meta = {"format": self.format, "task_id": self.task_id, "fingerprint": self.fingerprint,
                "rounds": str(self.rounds), "active": json.dumps(self.active)}
        tensors = {"bias": self.bias.contiguous()} if self.rounds else {}
        return save(tensors, metadata=meta)

    def restore(self, data: bytes | None) -> None:
        """Load a stored state; one of another task or model, or a corrupt one, is refused
        (logged, `refused` says why) and the part starts afresh."""
        self.reset()
        self.refused = None
        if not data:
            return
        try:
            self._load(data)
        except PersonalStateError as e:
            self.refused = str(e)
            log.warning("personal state refused (%s); starting a new one", e)
            self.reset()

    def _load(self, data: bytes) -> None:
        try:
            tensors = load(data)
            meta = state_metadata(data)
        except (SafetensorError, ValueError) as e:
            raise PersonalStateError(f"unreadable personal state: {e}") from e
        if meta.get("format") != self.format:
            raise PersonalStateError(f"personal state format {meta.get('format')!r} is not "
                                     f"{self.format}")
        if meta.get("task_id") != self.task_id:
            raise PersonalStateError("personal state of another task")
        if meta.get("fingerprint") != self.fingerprint:
            raise PersonalStateError("personal state of another model")
        bias = tensors.get("bias")
        if bias is not None and (bias.shape != (self.size,) or not torch.isfinite(bias).all()):
            raise PersonalStateError("personal bias does not fit this model's logits")
        self.rounds = int(meta.get("rounds", "0"))
        self.active = bool(json.loads(meta.get("active", "false")))
        if bias is not None:
            self.bias = bias.float().clone()

    # -- a round -------------------------------------------------------------------------------
    def train(self, examples: data_mod.Examples, rng: np.random.Generator) -> float:
        """One round of bias steps on the device's own examples (the evidence check's share
        held back); returns the personal loss on the last batch."""
        fit, check = _split(examples, self.task_id)
        if len(fit) == 0:
            return 0.0
        self._reference(fit)
        cfg, loss = self.config, 0.0
        size = min(cfg.batch_size, len(fit))
        for _ in range(cfg.steps):
            pick = rng.choice(len(fit), size=size, replace=False)
            loss = self._step(*self._rows(fit.subset(pick)))
        self.rounds += 1
        self.active = len(check) == 0 or self._helps(check)
        return loss

    def _reference(self, fit: data_mod.Examples) -> None:
        """Build the local-only reference from the device's own examples (once)."""

    def _rows(self, examples: data_mod.Examples) -> tuple[torch.Tensor, torch.Tensor]:
        """(the shared model's logits, float32 (N, size), and their targets (N,))."""
        raise NotImplementedError

    def _step(self, rows: torch.Tensor, target: torch.Tensor) -> float:
        """One Adam step on b from the exact gradient of the rows' mean cross-entropy."""
        if not len(target):
            return 0.0
        p = torch.softmax(rows + self.bias, dim=-1)
        loss = float(torch.nn.functional.cross_entropy(rows + self.bias, target))
        grad = (p.sum(0) - torch.bincount(target, minlength=self.size).float()) / len(target)
        grad += self.config.decay * self.bias
        m, v, t = self._moments or (torch.zeros_like(grad), torch.zeros_like(grad), 0)
        t += 1
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        lr = self.config.lr * (1 - 0.999 ** t) ** 0.5 / (1 - 0.9 ** t)
        self.bias = self.bias - lr * m / (v.sqrt() + 1e-8)
        self._moments = (m, v, t)
        return loss

    def _helps(self, check: data_mod.Examples) -> bool:
        rows, target = self._rows(check)
        if not len(target):
            return True
        plain = torch.nn.functional.cross_entropy(rows, target)
        with_bias = torch.nn.functional.cross_entropy(rows + self.bias, target)
        return bool(with_bias < plain)

    @property
    def applied(self) -> torch.Tensor:
        """The bias a prediction adds: b where the evidence check passed, else zero."""
        return self.bias if self.active else torch.zeros(self.size)


class LMPersonalPart(_BiasPart):
    """A personal vocabulary bias on a next-token causal LM (module docstring)."""

    def __init__(self, config: PersonalConfig, model: nn.Module, tokenizer: Any,
                 max_seq_len: int, task_id: str, fingerprint: str) -> None:
        """`model`: the device's causal LM as it syncs (its shared version); `fingerprint`:
        what identifies the frozen model a stored state must have been trained on
        (`lm_fingerprint`)."""
        self.model, self.tokenizer, self.max_seq_len = model, tokenizer, max_seq_len
        head: Any = model.get_output_embeddings()  # type: ignore[operator]
        self.vocab = int(head.weight.shape[0])
        self.starts = word_starts(tokenizer)
        self._bigram: _Bigram | None = None
        super().__init__(config, task_id, fingerprint, self.vocab)

    @classmethod
    def of(cls, config: PersonalConfig, bundle: ModelBundle, task_id: str) -> LMPersonalPart:
        """The personal part of an fp32 (or int8/int4) causal LM's bundle."""
        return cls(config, bundle.model, bundle.tokenizer, bundle.spec.max_seq_len, task_id,
                   model_fingerprint(bundle))

    def reset(self) -> None:
        super().reset()
        self._bigram = None

    def _reference(self, fit: data_mod.Examples) -> None:
        if self._bigram is None:
            self._bigram = _Bigram.of(self._ids(fit), self.vocab)

    @torch.no_grad()
    def _rows(self, examples: data_mod.Examples) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared model's next-token logits at every target token (position t predicts
        t + 1; padding dropped) and those targets."""
        parts, targets = [], []
        for raw in data_mod.eval_batches(examples, self.tokenizer, BATCH, self.max_seq_len):
            batch = on_model_device(data_mod.lm_targets(raw), self.model)
            out = self.model(input_ids=batch["input_ids"],
                             attention_mask=batch.get("attention_mask")).logits
            labels = batch["labels"][:, 1:].cpu()
            keep = labels != -100
            parts.append(out[:, :-1].float().cpu()[keep])
            targets.append(labels[keep])
        return torch.cat(parts), torch.cat(targets)

    def _ids(self, examples: data_mod.Examples) -> list[list[int]]:
        out = []
        for raw in data_mod.eval_batches(examples, self.tokenizer, BATCH, self.max_seq_len):
            for ids, mask in zip(raw["input_ids"], raw["attention_mask"], strict=True):
                out.append(ids[mask.bool()].tolist())
        return out

    # -- scores --------------------------------------------------------------------------------
    @torch.no_grad()
    def scores(self, examples: data_mod.Examples) -> LMScores | None:
        """Held-out next-word counts of the shared model, shared + personal (b where the
        evidence check passed), and the local-only bigram."""
        if len(examples) == 0:
            return None
        shared, personal = NextTokenCounts(), NextTokenCounts()
        local = NextTokenCounts() if self._bigram is not None else None
        bias = self.applied
        for raw in data_mod.eval_batches(examples, self.tokenizer, BATCH, self.max_seq_len):
            batch = on_model_device(data_mod.lm_targets(raw), self.model)
            logits = self.model(input_ids=batch["input_ids"],
                                attention_mask=batch.get("attention_mask")).logits
            logits, labels = logits.float().cpu(), batch["labels"].cpu()
            shared.add(next_token_counts(logits, labels, self.starts))
            personal.add(next_token_counts(logits + bias, labels, self.starts))
            if local is not None and self._bigram is not None:
                local.add(next_token_counts(self._bigram.log_probs(raw["input_ids"]), labels,
                                            self.starts))
        return LMScores(shared, personal, local)

    def score(self, examples: data_mod.Examples) -> PersonalScores | None:
        """`scores` as the device reports it: next-word top-3 accuracies."""
        s = self.scores(examples)
        if s is None:
            return None
        return PersonalScores(s.shared.top3_accuracy, s.personal.top3_accuracy,
                              None if s.local is None else s.local.top3_accuracy,
                              len(examples))


class LabelPersonalPart(_BiasPart):
    """A personal bias over a label-words LM's K class logits (module docstring)."""

    format = LABELS_FORMAT

    def __init__(self, config: PersonalConfig, bundle: ModelBundle, task_id: str) -> None:
        from seedfed.shared.model.objectives import LabelWords, label_word_ids

        self.bundle = bundle
        self.words = LabelWords(label_word_ids(bundle.tokenizer, bundle.spec.objective))
        self._prior: int | None = None
        super().__init__(config, task_id, model_fingerprint(bundle), len(self.words.word_ids))

    def reset(self) -> None:
        super().reset()
        self._prior = None

    def _reference(self, fit: data_mod.Examples) -> None:
        if self._prior is None and len(fit):
            self._prior = int(np.bincount(fit.labels, minlength=self.size).argmax())

    @torch.no_grad()
    def _rows(self, examples: data_mod.Examples) -> tuple[torch.Tensor, torch.Tensor]:
        from seedfed.client.objective_batches import task_batches

        parts, targets = [], []
        spec = self.bundle.spec
        for start in range(0, len(examples), BATCH):
            sl = slice(start, start + BATCH)
            batch = on_model_device(task_batches(spec, self.bundle.tokenizer,
                                                 examples.texts[sl], examples.labels[sl]),
                                    self.bundle.model)
            parts.append(self.words.logits(self.bundle.model, batch).cpu())
            targets.append(batch["labels"].cpu())
        return torch.cat(parts), torch.cat(targets)

    def score(self, examples: data_mod.Examples) -> PersonalScores | None:
        """Held-out accuracy of the shared label words, with the personal bias, and of the
        owner's most frequent label alone."""
        if len(examples) == 0:
            return None
        rows, target = self._rows(examples)
        shared = float((rows.argmax(-1) == target).float().mean())
        personal = float(((rows + self.applied).argmax(-1) == target).float().mean())
        local = None if self._prior is None else float((target == self._prior).float().mean())
        return PersonalScores(shared, personal, local, len(examples))


def lm_fingerprint(model: nn.Module, spec_text: str) -> str:
    """A packed ternary LM's identity for its personal state: the task's model description
    and the exact bytes of its LM head (never ternarized, never trained: `HEAD_NAMES`), known
    from construction, before any snapshot fills the BitLinear layers."""
    import hashlib

    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    weight = head.weight.detach().contiguous().cpu()
    digest = hashlib.sha256(spec_text.encode())
    digest.update(f"{weight.dtype}|{list(weight.shape)}|".encode())
    digest.update(weight.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _split(examples: data_mod.Examples, task_id: str) -> tuple[data_mod.Examples,
                                                               data_mod.Examples]:
    """(texts the bias trains on, texts the evidence check scores): a fixed share, drawn
    once per device's text set (the same split every round)."""
    n = len(examples)
    held = int(n * CHECK_SHARE)
    if held < 1 or n - held < 1:
        return examples, examples.subset([])
    order = np.random.default_rng([n, len(task_id), 0xB1A5]).permutation(n)
    return examples.subset(np.sort(order[held:])), examples.subset(np.sort(order[:held]))


class _Bigram:
    """A bigram model with absolute discounting, interpolated with add-one unigrams."""

    def __init__(self, pairs: Counter[tuple[int, int]], unigrams: np.ndarray) -> None:
        self.unigram = (unigrams + 1.0) / (unigrams.sum() + len(unigrams))
        self.rows: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
        by_prev: dict[int, list[tuple[int, int]]] = {}
        for (a, b), c in pairs.items():
            by_prev.setdefault(a, []).append((b, c))
        for a, nexts in by_prev.items():
            ids = np.array([b for b, _ in nexts])
            counts = np.array([c for _, c in nexts], dtype=np.float64)
            total = counts.sum()
            self.rows[a] = (ids, np.maximum(counts - DISCOUNT, 0) / total,
                            DISCOUNT * len(ids) / total)

    @classmethod
    def of(cls, texts: list[list[int]], vocab: int) -> _Bigram:
        pairs: Counter[tuple[int, int]] = Counter()
        unigrams = np.zeros(vocab)
        for ids in texts:
            pairs.update(zip(ids[:-1], ids[1:], strict=False))
            np.add.at(unigrams, ids[1:], 1.0)
        return cls(pairs, unigrams)

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, V) log-probabilities of the next token after each position."""
        b, t = input_ids.shape
        out = np.empty((b, t, len(self.unigram)), dtype=np.float32)
        for i in range(b):
            for j in range(t):
                ids, probs, backoff = self.rows.get(int(input_ids[i, j]),
                                                    (np.empty(0, int), np.empty(0), 1.0))
                p = backoff * self.unigram
                p[ids] += probs
                out[i, j] = np.log(p)
        return torch.from_numpy(out)
