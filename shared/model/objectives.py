"""The objectives' math (`seedfed.shared.protocol.objective` defines them): losses on a batch,
their per-copy forms for stacked probes, the batches they read, and their scores.

One definition for every caller: the device's trainer and scoring, the personal part, the
coordinator's task check and the benchmarks. A forward is an ordinary module call, so the probe
engine's recording, shared prefix and stacked copies (`client.probes`) apply to every objective.

Label words (`label_words_logits`): the decoder's last hidden state at each example's answer
position (the last prompt token) goes through the LM head, and the logits of the K label words
are the class logits. That is exactly a linear head whose rows are the LM head's label-word rows
on the frozen body (tests check it); only B x V logits are formed, not B x T x V.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from seedfed.shared.protocol.objective import TEXT_FIELD, Objective
from seedfed.shared.protocol.task import TaskSpec
from torch import nn

Batch = Mapping[str, torch.Tensor]
LossOnBatch = Callable[[nn.Module, Batch], torch.Tensor]
#: (model, batch repeated `copies` times along dim 0, copies) -> the `copies` mean losses.
CopyLosses = Callable[[nn.Module, Batch, int], torch.Tensor]
#: Batch key of a label-words batch: each row's answer position (the last prompt token).
ANSWER = "answer"
#: Config attributes of LM heads that are more than a Linear on the last hidden state.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale")


# -- next-token modelling ------------------------------------------------------------------------
def causal_lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy; labels of -100 (padding, prompt) are skipped."""
    labels = batch.get("labels", batch["input_ids"])
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    logits = out.logits[:, :-1].float()
    target = labels[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                       ignore_index=-100)


def causal_lm_losses(model: nn.Module, batch: Batch, copies: int) -> torch.Tensor:
    """`causal_lm_loss` of each of `copies` stacked copies of a batch (shape (copies,)).

    The cross-entropy runs copy by copy, so its float32 logits and log-softmax temporaries
    exist for one copy at a time (the vocabulary makes them the largest tensors of the step)."""
    labels = batch.get("labels", batch["input_ids"])
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    rows = out.logits.shape[0] // copies
    losses = []
    for c in range(copies):
        part = slice(c * rows, (c + 1) * rows)
        logits = out.logits[part, :-1].float()
        target = labels[part, 1:]
        losses.append(nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100))
    return torch.stack(losses)


def word_starts(tokenizer: Any) -> torch.Tensor:
    """Bool per vocabulary id: the token begins a word (a byte-level 'Ġ', a sentencepiece '▁'
    or a space). The keyboard metric scores the next word's first token at such targets; a
    tokenizer that marks no word starts scores every token."""
    vocab = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    starts = torch.tensor([isinstance(p, str) and p[:1] in ("Ġ", "▁", " ") for p in pieces])
    return starts if bool(starts.any()) else torch.ones(vocab, dtype=torch.bool)


@dataclass
class NextTokenCounts:
    """Sums over scored texts: summed negative log-likelihood over every target token, and
    next-word hits (top-1, top-3) over the word-start targets."""

    nll: float = 0.0
    tokens: int = 0
    words: int = 0
    top1: int = 0
    top3: int = 0

    def add(self, other: NextTokenCounts) -> None:
        for name in ("nll", "tokens", "words", "top1", "top3"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll / self.tokens)) if self.tokens else float("nan")

    @property
    def top1_accuracy(self) -> float:
        return self.top1 / self.words if self.words else 0.0

    @property
    def top3_accuracy(self) -> float:
        return self.top3 / self.words if self.words else 0.0


def next_token_counts(logits: torch.Tensor, labels: torch.Tensor,
                      starts: torch.Tensor) -> NextTokenCounts:
    """The counts of one batch from its (B, T, V) logits (any extra per-token bias already
    added) and its next-token `labels` (B, T; -100 skipped)."""
    logits, target = logits[:, :-1].float(), labels[:, 1:]
    keep = target != -100
    nll = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                      ignore_index=-100, reduction="sum")
    safe = target.clamp_min(0)
    word = keep & starts.to(target.device)[safe]
    top3 = logits.topk(min(3, logits.size(-1)), dim=-1).indices
    hit3 = (top3 == safe.unsqueeze(-1)).any(-1) & word
    hit1 = (top3[..., 0] == safe) & word
    return NextTokenCounts(float(nll), int(keep.sum()), int(word.sum()), int(hit1.sum()),
                           int(hit3.sum()))


# -- label words ---------------------------------------------------------------------------------
def lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder, LM head) of a Hugging Face causal LM, through a peft wrapper: the decoder's
    last hidden state through the head is the model's logits."""
    unwrap = getattr(model, "get_base_model", None)
    base: Any = unwrap() if callable(unwrap) else model
    config = getattr(base, "config", None)
    extra = [a for a in _HEAD_EXTRAS if getattr(config, a, None) not in (None, 1.0)]
    if extra:
        raise ValueError(f"{type(base).__name__} scales its logits ({extra[0]}): label words "
                         "need an LM head that is a Linear on the last hidden state")
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    if decoder is None or head is None:
        raise ValueError(f"{type(base).__name__} has no decoder and LM head to read label "
                         "words from")
    return decoder, head


def label_word_ids(tokenizer: Any, objective: Objective) -> list[int]:
    """The token of each label word: the first token the word takes after the template's
    text (" great" after " It was"); distinct words must get distinct tokens."""
    suffix = objective.template.split(TEXT_FIELD)[1]
    before = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    ids = []
    for word in objective.label_words:
        after = tokenizer(suffix + " " + word, add_special_tokens=False)["input_ids"]
        skip = len(before)
        if after[:skip] != before:  # the word merged into the template's last token
            skip, after = 0, tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        # the first token of the word that is not a bare space (a character tokenizer's)
        rest = [t for t in after[skip:] if tokenizer.decode([t]).strip()]
        if not rest:
            raise ValueError(f"label word {word!r} takes no token of its own")
        ids.append(int(rest[0]))
    if len(set(ids)) != len(ids):
        raise ValueError(f"label words {list(objective.label_words)} share a first token; "
                         "choose words that start differently")
    return ids


def label_words_logits(model: nn.Module, batch: Batch, word_ids: torch.Tensor) -> torch.Tensor:
    """(B, K) class logits: the LM head's logits of the label words at the answer position."""
    decoder, head = lm_parts(model)
    out = decoder(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    hidden = out[0]
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    at_answer = hidden[rows, batch[ANSWER].to(hidden.device)]
    return head(at_answer)[:, word_ids.to(hidden.device)].float()


class LabelWords:
    """The label-words loss of one tokenizer's words: `loss` and its per-copy `losses`."""

    def __init__(self, word_ids: Sequence[int]) -> None:
        self.word_ids = torch.tensor(list(word_ids), dtype=torch.long)

    def logits(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return label_words_logits(model, batch, self.word_ids)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(self.logits(model, batch), batch["labels"])

    def losses(self, model: nn.Module, batch: Batch, copies: int) -> torch.Tensor:
        per = nn.functional.cross_entropy(self.logits(model, batch), batch["labels"],
                                          reduction="none")
        return per.view(copies, -1).mean(dim=1)


# -- a task's objective ----------------------------------------------------------------------------
def classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross-entropy of a sequence-classification model's logits against `labels`."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float()
    return nn.functional.cross_entropy(logits, batch["labels"])


def classification_losses(model: nn.Module, batch: Batch, copies: int) -> torch.Tensor:
    """`classification_loss` of each of `copies` stacked copies of a batch (shape (copies,))."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float()
    per = nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
    return per.view(copies, -1).mean(dim=1)


def task_losses(spec: TaskSpec, tokenizer: Any) -> tuple[LossOnBatch, CopyLosses]:
    """(loss, per-copy losses) of a task's objective."""
    kind = spec.objective.kind
    if kind == "label_words":
        words = LabelWords(label_word_ids(tokenizer, spec.objective))
        return words.loss, words.losses
    if kind == "next_token":
        return causal_lm_loss, causal_lm_losses
    return classification_loss, classification_losses
