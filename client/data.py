"""Labelled text on a device: loading, the fixed held-out split, non-IID partitions, batches.

Everything random takes an explicit numpy Generator (or a seed that builds one), so a split, a
partition or a batch order is a pure function of its inputs: a device, the coordinator's
evaluator and the benchmarks all carve the same SST-2 split from the same file.

Files are `label<TAB>sentence` TSV with a header (columns in either order, found by name) or
JSON Lines with `label` and `sentence` (or `text`) keys. The built-in preference task
(`seedfed.client.preference`) produces the same `Examples`, so the demo needs no file.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from seedfed.shared.tokens import BATCH_KEYS, memo_for

if TYPE_CHECKING:  # torch loads only where a batch becomes tensors (`tokenize`): a device on
    import torch  # an inference engine (seedfed.client.ort) reads, splits and samples without it

#: Header names accepted for the text column, in order of preference.
TEXT_COLUMNS: tuple[str, ...] = ("sentence", "text")
LABEL_COLUMN = "label"
#: Seed of the fixed train/validation/test split carved from a labelled file.
SPLIT_SEED = 20240229


class DataFormatError(ValueError):
    """A labelled-text file that cannot be read (missing column, bad label, bad JSON)."""


@dataclass(frozen=True)
class Examples:
    """Labelled sentences: `texts[i]` has integer class `labels[i]`."""

    texts: tuple[str, ...]
    labels: np.ndarray  # int64, shape (n,)

    def __post_init__(self) -> None:
        if self.labels.ndim != 1 or len(self.texts) != self.labels.shape[0]:
            raise ValueError(f"{len(self.texts)} texts but labels of shape {self.labels.shape}")
        if self.labels.size and self.labels.min() < 0:
            raise ValueError(f"labels must be >= 0, got {int(self.labels.min())}")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_labels(self) -> int:
        return int(self.labels.max()) + 1 if self.labels.size else 0

    def subset(self, indices: Sequence[int] | np.ndarray) -> Examples:
        idx = np.asarray(indices, dtype=np.int64)
        return Examples(tuple(self.texts[i] for i in idx), self.labels[idx].copy())

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[int, str]]) -> Examples:
        return cls(tuple(t for _, t in pairs), np.array([y for y, _ in pairs], dtype=np.int64))


def _label(value: Any, where: str) -> int:
    try:
        label = int(str(value).strip())
    except ValueError as e:
        raise DataFormatError(f"{where}: label {value!r} is not an integer") from e
    if label < 0:
        raise DataFormatError(f"{where}: label {label} is negative")
    return label


def _text_key(keys: Sequence[str], where: str) -> str:
    for name in TEXT_COLUMNS:
        if name in keys:
            return name
    raise DataFormatError(f"{where}: no text column (one of {TEXT_COLUMNS}); found {list(keys)}")


def _read_tsv(path: Path) -> list[tuple[int, str]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = [h.strip().lower() for h in next(reader, [])]
        if LABEL_COLUMN not in header:
            raise DataFormatError(f"{path}: header {header} has no {LABEL_COLUMN!r} column")
        li, ti = header.index(LABEL_COLUMN), header.index(_text_key(header, str(path)))
        pairs = []
        for n, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) <= max(li, ti):
                raise DataFormatError(f"{path}:{n}: expected {len(header)} columns, got {row}")
            pairs.append((_label(row[li], f"{path}:{n}"), row[ti]))
    return pairs


def _read_jsonl(path: Path) -> list[tuple[int, str]]:
    pairs = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{n}: not JSON ({e.msg})") from e
            if not isinstance(obj, dict) or LABEL_COLUMN not in obj:
                raise DataFormatError(f"{path}:{n}: expected an object with a 'label' key")
            key = _text_key(list(obj), f"{path}:{n}")
            pairs.append((_label(obj[LABEL_COLUMN], f"{path}:{n}"), str(obj[key])))
    return pairs


def load_labelled(path: str | Path) -> Examples:
    """Read a TSV (header with `label` and `sentence`/`text`) or JSONL (`.jsonl`/`.json`) file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no labelled data file at {path}")
    jsonl = path.suffix.lower() in (".jsonl", ".json", ".ndjson")
    pairs = _read_jsonl(path) if jsonl else _read_tsv(path)
    if not pairs:
        raise DataFormatError(f"{path}: no labelled examples")
    return Examples.from_pairs(pairs)


@dataclass(frozen=True)
class Splits:
    train: Examples
    validation: Examples
    test: Examples


def split(examples: Examples, validation: int = 1000, test: int = 2000,
          seed: int = SPLIT_SEED) -> Splits:
    """A fixed train/validation/test split: one permutation from `seed`, test first.

    Exact duplicate sentences are dropped first (SST-2 repeats short phrases), so the same text
    cannot sit on both sides of the split.
    """
    if validation < 0 or test < 0:
        raise ValueError(f"split sizes must be >= 0, got validation={validation}, test={test}")
    seen: set[str] = set()
    keep = []
    for i, t in enumerate(examples.texts):
        key = t.strip().lower()
        if key not in seen:
            seen.add(key)
            keep.append(i)
    unique = examples.subset(keep)
    if validation + test >= len(unique):
        raise ValueError(f"{len(unique)} unique examples cannot hold validation={validation} "
                         f"+ test={test} and a training set")
    order = np.random.default_rng(seed).permutation(len(unique))
    return Splits(train=unique.subset(np.sort(order[validation + test:])),
                  validation=unique.subset(np.sort(order[test:test + validation])),
                  test=unique.subset(np.sort(order[:test])))


def dirichlet_partition(labels: np.ndarray, n_devices: int, alpha: float,
                        rng: np.random.Generator, min_size: int = 1,
                        max_tries: int = 100) -> list[np.ndarray]:
    """Split example indices over devices, non-IID: each class spreads by Dirichlet(alpha).

    Smaller alpha -> more skewed label mixes per device. Draws again (same generator) until
    every device holds at least `min_size` examples, so every device can train.
    """
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be positive, got {alpha}")
    labels = np.asarray(labels)
    if n_devices * min_size > labels.size:
        raise ValueError(f"{labels.size} examples cannot give {n_devices} devices "
                         f"{min_size} each")
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_devices)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(n_devices, alpha))
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
            for d, chunk in enumerate(np.split(idx, cuts)):
                parts[d].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(o.size for o in out) >= min_size:
            return out
    raise ValueError(f"no Dirichlet(alpha={alpha}) draw in {max_tries} tries gave every one of "
                     f"{n_devices} devices >= {min_size} examples; lower min_size or raise alpha")


def tokenize(tokenizer: Any, texts: Sequence[str], labels: np.ndarray | None,
             max_len: int) -> dict[str, torch.Tensor]:
    """One padded batch (padding to the longest text, truncated at max_len): the tensors
    `tokenizer(texts, padding=True, truncation=True, max_length=max_len)` returns.

    A device tokenizes the same few thousand sentences every round (its batches, its
    personal part's, its held-out set), ~3 ms a batch: each text is tokenized once per
    tokenizer and max_len (`shared.tokens.TokenMemo`) and the batch padded from those, as the
    tokenizer pads (a tokenizer the memo cannot reproduce takes its own path)."""
    import torch

    memo = memo_for(tokenizer, max_len) if len(texts) else None
    if memo is None:
        enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_len,
                        return_tensors="pt")
        batch = {k: v for k, v in enc.items() if k in BATCH_KEYS}
    else:
        batch = memo.batch(texts)
    if labels is not None:
        batch["labels"] = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    return batch


def train_batches(examples: Examples, tokenizer: Any, batch_size: int, max_len: int,
                  rng: np.random.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Endless shuffled batches: each epoch is a fresh permutation from `rng`; a device with
    fewer examples than `batch_size` yields its whole set each time."""
    for idx in batch_indices(len(examples), batch_size, rng):
        yield tokenize(tokenizer, [examples.texts[i] for i in idx], examples.labels[idx],
                       max_len)


def batch_indices(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The example indices of `train_batches`' batches, endlessly: each epoch a fresh
    permutation from `rng`, cut into whole batches (every backend samples with this)."""
    if n == 0:
        raise ValueError("cannot draw batches from an empty example set")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    size = min(batch_size, n)
    while True:
        order = rng.permutation(n)
        for start in range(0, len(order) - size + 1, size):
            yield order[start:start + size]


def lm_batches(examples: Examples, tokenizer: Any, batch_size: int, max_len: int,
               rng: np.random.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """`train_batches` for a causal LM: the texts only (labels unused), next-token targets in
    `labels` with padding set to -100, so a loss skips it (`trainer.causal_lm_loss`)."""
    for batch in train_batches(examples, tokenizer, batch_size, max_len, rng):
        yield lm_targets(batch)


def batches_for(model_kind: str, examples: Examples, tokenizer: Any, batch_size: int,
                max_len: int, rng: np.random.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Training batches for a model kind: `lm_batches` for a causal LM, else `train_batches`."""
    make = lm_batches if model_kind == "causal_lm" else train_batches
    return make(examples, tokenizer, batch_size, max_len, rng)


def lm_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tokenized batch as a language-modelling batch: labels = input_ids, -100 on padding."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    labels = ids.clone() if mask is None else ids.masked_fill(mask == 0, -100)
    return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")} | {
        "labels": labels}


def eval_batches(examples: Examples, tokenizer: Any, batch_size: int, max_len: int,
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """Every example once, in file order (per-example output lines up with the file;
    `client.evaluate.predict` sorts by length instead, which is faster)."""
    for start in range(0, len(examples), batch_size):
        sl = slice(start, start + batch_size)
        yield tokenize(tokenizer, examples.texts[sl], examples.labels[sl], max_len)
