"""The exported forward on ONNX Runtime: tokenize, encode (cached), score probes. numpy only.

`open_model` opens a bundle as its kind's model: `OrtModel` (a head bundle) or `OrtLM` (a
causal LM's LoRA bundle).

`OrtModel` reproduces what the torch device computes for a head-scope task:

- tokenization with the base model's `tokenizer.json` (padding to the longest text, truncation
  at `max_seq_len`, as `client.data.tokenize` asks of the HF fast tokenizer);
- the features of a sentence are computed once (`encoder.onnx`) and cached by its token ids,
  as `MeanPoolClassifier`'s feature cache does; new sentences of a batch run together, padded
  to the longest of them;
- `logits(features, stacked)`: C probes in one `top.onnx` run, the trainable tensors of copy c
  being `stacked[name][c]`;
- `mean_losses`: per-copy mean cross-entropy in float32, the torch loss's arithmetic.

`OrtLM` reproduces it for a causal LM's LoRA scope:

- `batch`: the token ids `client.objective_batches.task_batches` gives the torch device for the
  same texts (a label-words prompt batch with its answer positions, or a next-token batch with
  -100 on padding), from the tokenizer the bundle ships and the token ids the manifest
  recorded at export (the template's tail, the label words);
- `run`: C probes in one `lm.onnx` run, copy c's LoRA tensors being `stacked[name][c]`: the
  per-copy mean losses and what scoring reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from seedfed.client.backends.ort.bundle import (
    CAUSAL_LM_LORA,
    ENCODER,
    HEAD,
    LM,
    LM_INPUTS,
    LM_OUTPUTS,
    TOKENIZER,
    TOP,
    BundleError,
    LmInfo,
    Manifest,
)
from seedfed.shared.protocol.objective import TEXT_FIELD
from tokenizers import Tokenizer

#: Upper bound of the per-sentence feature cache (FIFO eviction beyond it), as the torch
#: device's `FEATURE_CACHE_BYTES`.
FEATURE_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class Encoded:
    """A tokenized batch (int64 [B, T] each), right-padded."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray


def _session(path: Path, threads: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OrtModel:
    """One head bundle loaded for inference (sessions, tokenizer, feature cache)."""

    def __init__(self, root: str | Path, *, threads: int | None = None) -> None:
        self.root = Path(root)
        self.manifest = Manifest.load(self.root, kind=HEAD)
        self.encoder = _session(self.root / ENCODER, threads)
        self.top = _session(self.root / TOP, threads)
        self.max_seq_len = int(self.manifest.spec["max_seq_len"])
        self.tokenizer = Tokenizer.from_file(str(self.root / TOKENIZER))
        self.tokenizer.enable_truncation(max_length=self.max_seq_len)
        pad = self.tokenizer.id_to_token(self.manifest.pad_id) or "[PAD]"
        self.tokenizer.enable_padding(pad_id=self.manifest.pad_id, pad_token=pad)
        self._cache: dict[bytes, np.ndarray] = {}
        self._cache_bytes = 0
        self.cache_limit_bytes = FEATURE_CACHE_BYTES

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.manifest.tensors]

    def tokenize(self, texts: Sequence[str]) -> Encoded:
        encs = self.tokenizer.encode_batch(list(texts))
        return Encoded(np.array([e.ids for e in encs], dtype=np.int64),
                       np.array([e.attention_mask for e in encs], dtype=np.int64),
                       np.array([e.type_ids for e in encs], dtype=np.int64))

    def clear_cache(self) -> None:
        self._cache.clear()
        self._cache_bytes = 0

    def features(self, texts: Sequence[str]) -> np.ndarray:
        """Pooled features [B, H] of the texts (cached per sentence by its tokens)."""
        enc = self.tokenize(texts)
        lengths = enc.attention_mask.sum(axis=1).tolist()
        keys = [enc.input_ids[i, :n].tobytes() + enc.token_type_ids[i, :n].tobytes()
                for i, n in enumerate(lengths)]
        missing = [i for i, k in enumerate(keys) if k not in self._cache]
        fresh: dict[bytes, np.ndarray] = {}
        if missing:
            sub = np.array(missing)
            n_max = max(lengths[i] for i in missing)
            feats = self.encoder.run(None, {
                "input_ids": enc.input_ids[sub, :n_max],
                "attention_mask": enc.attention_mask[sub, :n_max],
                "token_type_ids": enc.token_type_ids[sub, :n_max]})[0]
            for j, i in enumerate(missing):
                fresh[keys[i]] = np.array(feats[j], dtype=np.float32)
            self._remember(fresh)
        return np.stack([fresh[k] if k in fresh else self._cache[k] for k in keys])

    def _remember(self, fresh: dict[bytes, np.ndarray]) -> None:
        for key, row in fresh.items():
            self._cache[key] = row
            self._cache_bytes += row.nbytes
        while self._cache_bytes > self.cache_limit_bytes and self._cache:
            oldest = next(iter(self._cache))  # FIFO: dicts keep insertion order
            self._cache_bytes -= self._cache.pop(oldest).nbytes

    def logits(self, features: np.ndarray, stacked: Mapping[str, np.ndarray]) -> np.ndarray:
        """Logits [C, B, labels] of C probes: copy c's trainable tensors are stacked[name][c]
        (each [C, *shape] or [C, numel])."""
        feed: dict[str, np.ndarray] = {"features": np.ascontiguousarray(features,
                                                                        dtype=np.float32)}
        for i, t in enumerate(self.manifest.tensors):
            value = stacked[t.name]
            feed[f"p{i}"] = np.ascontiguousarray(value.reshape((value.shape[0], *t.shape)),
                                                 dtype=np.float32)
        return np.asarray(self.top.run(None, feed)[0])


def example_losses(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Cross-entropy of every example of each copy's logits [C, B, L] against labels [B]:
    shape (C, B), float32 throughout (log-sum-exp shifted by the row maximum), as torch's."""
    x = logits.astype(np.float32, copy=False)
    top = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - top).sum(axis=-1, dtype=np.float32)) + top[..., 0]
    picked = np.take_along_axis(x, labels.reshape(1, -1, 1).astype(np.int64), axis=-1)[..., 0]
    return np.asarray(lse - picked, dtype=np.float32)


def mean_losses(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The mean cross-entropy of each copy (shape (C,)): the ZO loss of every probe."""
    return example_losses(logits, labels).mean(axis=-1, dtype=np.float32)


class OrtLM:
    """One causal-LM LoRA bundle loaded for inference (`lm.onnx`, tokenizer, manifest)."""

    def __init__(self, root: str | Path, *, threads: int | None = None) -> None:
        self.root = Path(root)
        self.manifest = Manifest.load(self.root, kind=CAUSAL_LM_LORA)
        assert self.manifest.lm is not None  # Manifest.load reads it for this kind
        self.lm: LmInfo = self.manifest.lm
        self.session = _session(self.root / LM, threads)
        self.objective = self.lm.objective
        self.max_seq_len = int(self.manifest.spec["max_seq_len"])
        self.template = str(self.manifest.spec["objective"]["template"])
        self.tokenizer = Tokenizer.from_file(str(self.root / TOKENIZER))
        self.tokenizer.no_padding()  # rows are padded here, as the torch device pads them
        self.inputs = LM_INPUTS[self.objective]
        self.outputs = LM_OUTPUTS[self.objective]
        got = [i.name for i in self.session.get_inputs()]
        want = [*self.inputs, *(f"p{i}" for i in range(len(self.manifest.tensors)))]
        if got != want:
            raise BundleError(f"{self.root / LM} takes {got[:6]}, its manifest says "
                              f"{want[:6]}; export the bundle again")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.manifest.tensors]

    def encode(self, texts: Sequence[str], max_len: int) -> list[list[int]]:
        """Each text's token ids, special tokens included, truncated to `max_len` tokens as
        `tokenizer(texts, truncation=True, max_length=max_len)` does."""
        self.tokenizer.enable_truncation(max_length=max_len,
                                         direction=self.lm.truncation_side)
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def _padded(self, rows: Sequence[Sequence[int]], side: str,
                ) -> tuple[np.ndarray, np.ndarray]:
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.manifest.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            at = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            ids[i, at] = r
            mask[i, at] = 1
        return ids, mask

    def batch(self, texts: Sequence[str], labels: np.ndarray | None) -> dict[str, np.ndarray]:
        """The objective's batch of the texts, as lm.onnx takes it: `task_batches`' tensors
        (`client.objective_batches`) as int64 arrays."""
        if not len(texts):
            raise ValueError("a batch needs at least one text")
        if self.objective == "next_token":
            ids, mask = self._padded(self.encode(texts, self.max_seq_len),
                                     self.lm.padding_side)
            return {"input_ids": ids, "attention_mask": mask,
                    "labels": np.where(mask == 0, -100, ids).astype(np.int64)}
        # `prompt_batch`: the text cut so the template's tail always fits, right-padded
        if labels is None:
            raise ValueError("a label-words batch needs labels")
        prefix = self.template.split(TEXT_FIELD)[0]
        tail = list(self.lm.prompt_tail)
        rows = [r + tail for r in self.encode([prefix + t for t in texts],
                                              self.max_seq_len - len(tail))]
        ids, mask = self._padded(rows, "right")
        return {"input_ids": ids, "attention_mask": mask, "answer": mask.sum(axis=1) - 1,
                "labels": np.asarray(labels, dtype=np.int64).reshape(-1)}

    def run(self, batch: Mapping[str, np.ndarray], stacked: Mapping[str, np.ndarray],
            ) -> dict[str, np.ndarray]:
        """The graph's outputs (`LM_OUTPUTS`) for C probes: copy c's LoRA tensors are
        stacked[name][c] (each [C, *shape] or [C, numel])."""
        feed = {k: batch[k] for k in self.inputs}
        for i, t in enumerate(self.manifest.tensors):
            value = stacked[t.name]
            feed[f"p{i}"] = np.ascontiguousarray(value.reshape((value.shape[0], *t.shape)),
                                                 dtype=np.float32)
        return dict(zip(self.outputs, self.session.run(list(self.outputs), feed), strict=True))


def open_model(root: str | Path, *, threads: int | None = None) -> OrtModel | OrtLM:
    """The bundle at `root` opened as its kind's model."""
    kind = Manifest.load(Path(root)).kind
    if kind == CAUSAL_LM_LORA:
        return OrtLM(root, threads=threads)
    return OrtModel(root, threads=threads)
