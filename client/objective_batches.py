"""Batches of a task's objective (`seedfed.shared.protocol.objective`): a classifier's labelled
batch, a causal LM's next-token batch, or a label-words prompt batch (`prompt_batch`). Every
backend and the personal part draw their batches here, so all see the same token ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from seedfed.client.data import batch_indices, lm_targets, tokenize
from seedfed.shared.model.objectives import ANSWER
from seedfed.shared.protocol.objective import TEXT_FIELD, Objective
from seedfed.shared.protocol.task import TaskSpec


def prompt_batch(tokenizer: Any, objective: Objective, texts: Sequence[str],
                 labels: np.ndarray | None, max_len: int) -> dict[str, torch.Tensor]:
    """A label-words batch: each text in the template, truncated so the whole prompt fits
    `max_len` tokens (the text is cut, never the template's end), right-padded; `answer` is
    each row's last prompt token, `labels` the class ids."""
    prefix, suffix = objective.template.split(TEXT_FIELD)
    tail = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    room = max_len - len(tail)
    if room < 2:
        raise ValueError(f"max_seq_len {max_len} leaves no room for text beside the "
                         f"template's {len(tail)} tokens")
    enc = tokenize(tokenizer, [prefix + t for t in texts], None, room)
    rows = [ids[mask.bool()].tolist() + list(tail)
            for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, ANSWER: mask.sum(1) - 1}
    if labels is not None:
        batch["labels"] = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    return batch


def task_batches(spec: TaskSpec, tokenizer: Any, texts: Sequence[str],
                 labels: np.ndarray | None, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """One batch of a task's objective from texts (and labels)."""
    max_len = max_len or spec.max_seq_len
    if spec.objective.kind == "label_words":
        return prompt_batch(tokenizer, spec.objective, texts, labels, max_len)
    if spec.objective.kind == "next_token":
        return lm_targets(tokenize(tokenizer, texts, None, max_len))
    return tokenize(tokenizer, texts, labels, max_len)


def endless_batches(spec: TaskSpec, tokenizer: Any, texts: Sequence[str],
                    labels: np.ndarray | None, batch_size: int, rng: np.random.Generator,
                    ) -> Iterator[dict[str, torch.Tensor]]:
    """`task_batches` drawn endlessly: each epoch a fresh permutation from `rng`."""
    for idx in batch_indices(len(texts), batch_size, rng):
        yield task_batches(spec, tokenizer, [texts[i] for i in idx],
                           None if labels is None else labels[idx])
