"""Labelled text on a device: loading, the fixed held-out split, non-IID partitions, batches.

Everything random takes an explicit numpy Generator (or a seed that builds one), so a split, a
partition or a batch order is a pure function of its inputs: a device, the coordinator's
evaluator and the benchmarks all carve the same SST-2 split from the same file.

Files are `label<TAB>sentence` TSV with a header (columns in either order, found by name) or
JSON Lines with `label` and `sentence` (or `text`) keys. A label is an integer 0..K-1 or one
of the task's label words (`LabelSpace`: its label texts, ignoring case and punctuation); a
file that breaks the format raises DataFormatError naming the file and line. The built-in
preference task (`seedfed.client.preference`) produces the same `Examples`, so the demo needs
no file.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from seedfed.shared.model.tokens import BATCH_KEYS, memo_for
from seedfed.shared.protocol.errors import UserError

if TYPE_CHECKING:  # torch loads only where a batch becomes tensors (`tokenize`): the ORT
    import torch  # backend (seedfed.client.backends.ort) reads, splits and samples without it

#: Header names accepted for the text column, in order of preference.
TEXT_COLUMNS: tuple[str, ...] = ("sentence", "text")
LABEL_COLUMN = "label"
#: Seed of the fixed train/validation/test split carved from a labelled file.
SPLIT_SEED = 20240229
#: Spread (sigma of log size) of device sizes in `sized_partition`: the largest of 1,000 devices
#: holds ~20 x the median.
SIZE_SIGMA = 1.0


#: What a labelled-data file looks like: the last part of every format error.
FORMAT_HINT = ("give a TSV file with a header line `label<TAB>sentence` (or `text`) and one "
               "example per line, or JSON Lines of {\"label\": ..., \"text\": ...}; labels are "
               "0..K-1 or the task's label words")
#: File suffixes read as JSON Lines whatever their first line looks like.
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


class DataFormatError(UserError, ValueError):
    """A labelled-text file that cannot be read (missing column, bad label, bad JSON): where
    (file and line) and what, with the format as the hint."""

    def __init__(self, what: str, hint: str = FORMAT_HINT) -> None:
        super().__init__(what, hint)


class MissingDataError(UserError, FileNotFoundError):
    """No labelled-data file at the path given."""


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


@dataclass(frozen=True)
class LabelSpace:
    """The labels a file may use: integers 0..num_labels-1 (any integer >= 0 when num_labels
    is None) or one of `words`, the task's label texts (index = label; "|" separates
    alternatives of one label), matched ignoring case and surrounding punctuation."""

    num_labels: int | None = None
    words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.words and self.num_labels is not None and len(self.words) != self.num_labels:
            raise ValueError(f"{len(self.words)} label words for {self.num_labels} labels")

    @classmethod
    def of_task(cls, num_labels: int, label_texts: Sequence[str], classifier: bool = True,
                ) -> LabelSpace:
        """A task's labels; a task that is no classifier (a causal LM) reads texts only and
        takes any integer label."""
        return cls(num_labels, tuple(label_texts)) if classifier else cls()

    def _lookup(self) -> dict[str, int]:
        return {_word(alt): i for i, text in enumerate(self.words) for alt in text.split("|")
                if _word(alt)}

    def describe(self) -> str:
        """The accepted labels in words, for messages."""
        ints = "an integer >= 0" if self.num_labels is None else f"0..{self.num_labels - 1}"
        if not self.words:
            return ints
        return f"{ints} or one of the task's label words " + ", ".join(
            repr(w.strip()) for w in self.words)

    def parse(self, value: Any, where: str) -> int:
        """The label index of a file's label `value` (found at `where`)."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        text = str(value).strip()
        try:
            label = int(text)
        except ValueError:
            found = self._lookup().get(_word(text)) if not isinstance(value, bool) else None
            if found is None:
                raise DataFormatError(f"{where}: label {value!r} is not an integer "
                                      f"(labels: {self.describe()})") from None
            return found
        if label < 0:
            raise DataFormatError(f"{where}: label {label} is negative "
                                  f"(labels: {self.describe()})")
        if self.num_labels is not None and label >= self.num_labels:
            raise DataFormatError(f"{where}: label {label} is outside the task's "
                                  f"{self.num_labels} labels (labels: {self.describe()})")
        return label


class _AnyLabel(LabelSpace):
    """Any non-empty label (as 0): the file's shape is checked before the task is known."""

    def parse(self, value: Any, where: str) -> int:
        if not str(value).strip():
            raise DataFormatError(f"{where}: empty label")
        return 0


def check_format(path: str | Path) -> int:
    """Check a labelled-data file's shape (it exists; header, columns or JSON, not empty)
    before the labels it may use are known; the number of examples. Raises as
    `load_labelled`."""
    return len(load_labelled(path, _AnyLabel()))


def _word(text: str) -> str:
    return text.strip().strip(".!?,;:'\"").strip().casefold()


def _text_key(keys: Sequence[str], where: str) -> str:
    for name in TEXT_COLUMNS:
        if name in keys:
            return name
    raise DataFormatError(f"{where}: no text column (one of {TEXT_COLUMNS}); found {list(keys)}")


def _tsv_header(header: list[str], first: str, where: str) -> tuple[int, int]:
    """(label column, text column) of a TSV header, or why the first line is not one."""
    if LABEL_COLUMN in header:
        return header.index(LABEL_COLUMN), header.index(_text_key(header, where))
    if not first.strip():
        raise DataFormatError(f"{where}: the file is empty" if not first else
                              f"{where}: the first line is blank, not a header")
    if "\t" not in first and "," in first:
        raise DataFormatError(f"{where}: the file looks comma-separated (CSV)",
                              "seedfed reads tab-separated columns: " + FORMAT_HINT)
    if header and header[0].lstrip("-").isdigit():
        raise DataFormatError(f"{where}: no header line (the first line is an example)",
                              "add the line `label<TAB>sentence` at the top")
    raise DataFormatError(f"{where}: header {header} has no {LABEL_COLUMN!r} column")


def _read_tsv(path: Path, labels: LabelSpace) -> list[tuple[int, str]]:
    with path.open(encoding="utf-8", newline="") as f:
        first = f.readline()
        header = [h.strip().lower() for h in first.rstrip("\r\n").split("\t")] if first else []
        li, ti = _tsv_header(header, first, f"{path}:1")
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        pairs = []
        for n, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) <= max(li, ti):
                raise DataFormatError(f"{path}:{n}: expected {len(header)} tab-separated "
                                      f"columns, got {len(row)}")
            pairs.append((labels.parse(row[li], f"{path}:{n}"), row[ti]))
    return pairs


def _read_jsonl(path: Path, labels: LabelSpace) -> list[tuple[int, str]]:
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
            pairs.append((labels.parse(obj[LABEL_COLUMN], f"{path}:{n}"), str(obj[key])))
    return pairs


def _is_jsonl(path: Path) -> bool:
    if path.suffix.lower() in JSONL_SUFFIXES:
        return True
    with path.open("rb") as f:
        return f.read(64).lstrip().startswith(b"{")


def load_labelled(path: str | Path, labels: LabelSpace | None = None) -> Examples:
    """Read a TSV (header with `label` and `sentence`/`text`, columns in either order) or JSON
    Lines file (a `.jsonl`/`.json`/`.ndjson` suffix, or a first line that is a JSON object).
    `labels`: what the labels may be (default: any integer >= 0). Every problem raises
    DataFormatError naming the file and line (MissingDataError: no such file)."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"no labelled data file at {path}" + (
            " (it is a directory)" if path.is_dir() else ""), "check the path given to --data")
    labels = labels or LabelSpace()
    try:
        pairs = _read_jsonl(path, labels) if _is_jsonl(path) else _read_tsv(path, labels)
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from e
    if not pairs:
        raise DataFormatError(f"{path}: no labelled examples (the file is empty or holds only "
                              "a header)")
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
    every device holds at least `min_size` examples, so every device can train; a draw is
    checked on its counts before any index list is built, so a try costs O(classes x
    devices) whatever the fleet. Raises ValueError when no draw of `max_tries` fits: with
    many devices per example (a thousand devices on SST-2) some device almost surely gets
    less than `min_size`; `fleet_partition` then falls back to `sized_partition`.
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
        draws = []  # per class: its examples in a random order, and each device's count
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(n_devices, alpha))
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
            draws.append((idx, np.diff(cuts, prepend=0, append=idx.size)))
        if int(np.sum([counts for _, counts in draws], axis=0).min()) >= min_size:
            owners = [np.repeat(np.arange(n_devices), counts) for _, counts in draws]
            return _by_device(np.concatenate(owners), np.concatenate([i for i, _ in draws]),
                              n_devices)
    raise ValueError(f"no Dirichlet(alpha={alpha}) draw in {max_tries} tries gave every one of "
                     f"{n_devices} devices >= {min_size} examples; lower min_size or raise alpha")


def sized_partition(labels: np.ndarray, n_devices: int, alpha: float,
                    rng: np.random.Generator, min_size: int = 1,
                    size_sigma: float = SIZE_SIGMA) -> list[np.ndarray]:
    """Split example indices over devices, non-IID, for a fleet of any size: each device's size
    is drawn first (lognormal, `size_sigma`: a few devices hold many examples, most few, as
    in LEAF's natural partitions), at least `min_size`, then its label mixture from
    Dirichlet(alpha K p) over the K classes (p: the classes' shares, so alpha means what it
    means to `dirichlet_partition` on balanced classes), and its examples are dealt from each
    class's shuffled queue. Vectorized: O(examples + devices x classes).

    Every example goes to exactly one device when the examples can give every device
    `min_size`: the mixtures' class counts are then moved (randomly, device by device) so
    that each class's total is its supply. With more devices than that (say 100,000 devices
    on SST-2's 64k sentences) every device gets `min_size` examples, each class is dealt in
    proportion to its supply, and a class's queue wraps around: examples are shared between
    devices, evenly, and a device never holds one twice unless a class has fewer examples
    than a device draws from it."""
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be positive, got {alpha}")
    if min_size < 1 or not size_sigma >= 0:
        raise ValueError(f"need min_size >= 1 and size_sigma >= 0, got {min_size}, "
                         f"{size_sigma}")
    labels = np.asarray(labels)
    if labels.size == 0:
        raise ValueError("cannot partition an empty example set")
    classes, class_of = np.unique(labels, return_inverse=True)
    supply = np.bincount(class_of)
    total = max(labels.size, n_devices * min_size)
    sizes = min_size + _apportion(total - n_devices * min_size,
                                  rng.lognormal(0.0, size_sigma, n_devices))
    mixtures = rng.dirichlet(alpha * classes.size * supply / labels.size, size=n_devices)
    counts = rng.multinomial(sizes, mixtures)  # (devices, classes)
    dealt = supply if total == labels.size else _apportion(total, supply.astype(np.float64))
    counts = _match_column_totals(counts, dealt, rng)
    owners, examples = [], []
    for k in range(classes.size):
        queue = rng.permutation(np.flatnonzero(class_of == k))
        owners.append(np.repeat(np.arange(n_devices), counts[:, k]))
        examples.append(queue[np.arange(dealt[k]) % supply[k]])
    parts = _by_device(np.concatenate(owners), np.concatenate(examples), n_devices)
    if (counts > supply).any():  # a class smaller than one device's draw from it
        parts = [np.unique(p) for p in parts]
    return parts


def fleet_partition(labels: np.ndarray, n_devices: int, alpha: float,
                    rng: np.random.Generator, min_size: int = 1,
                    max_tries: int = 100) -> list[np.ndarray]:
    """The fleet's non-IID partition at any size: `dirichlet_partition` (each class spread by
    Dirichlet(alpha), the split the measured recipes' fleets were tuned on) when one of
    `max_tries` draws gives every device `min_size` examples, else `sized_partition` from the
    same generator. A pure function of its inputs, so every process derives the same one."""
    try:
        return dirichlet_partition(labels, n_devices, alpha, rng, min_size, max_tries)
    except ValueError:
        if n_devices < 1 or not alpha > 0:
            raise
    return sized_partition(labels, n_devices, alpha, rng, max(min_size, 1))


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """`total` units split in proportion to `weights` (largest remainders; ties to the lower
    index), as int64 summing to `total` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    short = total - int(out.sum())
    if short:
        out[np.argsort(-(exact - out), kind="stable")[:short]] += 1
    return out


def _match_column_totals(counts: np.ndarray, totals: np.ndarray,
                         rng: np.random.Generator) -> np.ndarray:
    """`counts` (devices x classes, with counts.sum() == totals.sum()) changed so that class
    k's column sums to totals[k], every device keeping its row sum: the surplus of an
    over-asked class is taken from random units of its column (a multivariate hypergeometric
    draw), and those units' devices get the classes that fall short instead."""
    counts = counts.astype(np.int64)
    diff = counts.sum(axis=0) - totals
    freed = np.zeros(counts.shape[0], dtype=np.int64)
    for k in np.flatnonzero(diff > 0):
        take = rng.multivariate_hypergeometric(counts[:, k], int(diff[k]))
        counts[:, k] -= take
        freed += take
    for k in np.flatnonzero(diff < 0):
        give = rng.multivariate_hypergeometric(freed, int(-diff[k]))
        counts[:, k] += give
        freed -= give
    return counts


def _by_device(owners: np.ndarray, examples: np.ndarray, n_devices: int) -> list[np.ndarray]:
    """Example indices grouped by owning device, each group sorted."""
    order = np.lexsort((examples, owners))
    bounds = np.cumsum(np.bincount(owners, minlength=n_devices))[:-1]
    return np.split(examples[order].astype(np.int64), bounds)


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
