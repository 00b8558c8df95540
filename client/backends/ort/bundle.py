"""The ORT bundle: what `export` writes and the torch-free device reads.

A bundle is one of two kinds (`Manifest.kind`):

`head`, a sentence encoder's classification head (scope above the encoder):

    bundle/manifest.json   Manifest (below): the task it was built for, the trainable tensors
    bundle/encoder.onnx    input_ids, attention_mask, token_type_ids [B, T] -> pooled [B, H]
                           (the frozen encoder and the masked mean: the features the torch
                           device caches per sentence)
    bundle/top.onnx        features [B, H] + one input per trainable tensor, stacked per probe
                           [C, *shape] -> logits [C, B, labels] (normalization and the head)
    bundle/tokenizer.json  the base model's tokenizer (HF `tokenizers` format)

`causal_lm_lora`, a causal LM's LoRA adapters (MobiZO's setting: the adapters are the graph's
inputs, the base is frozen inside it):

    bundle/manifest.json   Manifest, with `lm` (LmInfo: the objective's token ids, how texts
                           are padded and truncated)
    bundle/lm.onnx         the objective's batch [B, T] + one input per LoRA tensor, stacked
                           per probe [C, *shape] -> losses [C] (the per-copy mean loss of the
                           task's objective) and what scoring reads (`LM_OUTPUTS`)
    bundle/tokenizer.json  the tokenizer the torch device uses (HF `tokenizers` format)

The frozen weights live inside the graphs; the trainable tensors are graph inputs, so the
device feeds theta + eps z of C probes in one run and the stored state never changes.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.task import TaskSpec

MANIFEST = "manifest.json"
ENCODER = "encoder.onnx"
TOP = "top.onnx"
LM = "lm.onnx"
TOKENIZER = "tokenizer.json"
#: Layout version of the bundle directory.
BUNDLE_VERSION = 2
#: Bundle kinds: a sentence encoder's head, a causal LM's LoRA adapters.
HEAD = "head"
CAUSAL_LM_LORA = "causal_lm_lora"
KINDS: tuple[str, ...] = (HEAD, CAUSAL_LM_LORA)
#: The graphs each kind holds.
GRAPHS: dict[str, tuple[str, ...]] = {HEAD: (ENCODER, TOP), CAUSAL_LM_LORA: (LM,)}
#: The TaskSpec fields that decide the exported function (the model path does not: each side
#: names its own copy of the base).
SPEC_FIELDS: tuple[str, ...] = ("model_kind", "num_labels", "label_texts", "scope",
                                "scope_options", "format", "max_seq_len")
#: A causal LM's function also depends on its adapters and its objective.
LM_SPEC_FIELDS: tuple[str, ...] = SPEC_FIELDS + ("lora", "objective")
#: lm.onnx's inputs before the LoRA tensors (p0, p1, ...), per objective, and its outputs.
LM_INPUTS: dict[str, tuple[str, ...]] = {
    "next_token": ("input_ids", "attention_mask", "labels"),
    "label_words": ("input_ids", "attention_mask", "answer", "labels")}
LM_OUTPUTS: dict[str, tuple[str, ...]] = {
    # losses [C]; the per-token loss (0 where the label is -100) and the top-1 next token
    # [C, B, T - 1]: perplexity and the keyboard metric
    "next_token": ("losses", "token_nll", "top1"),
    # losses [C]; the label words' logits [C, B, K]: accuracy and per-example loss
    "label_words": ("losses", "logits")}


class BundleError(SeedfedError, ValueError):
    """An ORT bundle that is missing, malformed or built for another task."""


def fingerprint_fields(kind: str) -> tuple[str, ...]:
    return LM_SPEC_FIELDS if kind == CAUSAL_LM_LORA else SPEC_FIELDS


def spec_fingerprint(spec: TaskSpec, kind: str = HEAD) -> dict[str, Any]:
    """The part of a task definition a bundle of `kind` is bound to, as JSON values."""
    d = {**spec.to_dict(), "objective": spec.objective.to_dict()}  # resolved, always present
    return json.loads(json.dumps({k: d[k] for k in fingerprint_fields(kind)}))


@dataclass(frozen=True)
class TensorInfo:
    name: str  # canonical name (the scope's, the snapshot's)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LmInfo:
    """What a causal-LM bundle's device needs beside the graph to build the torch device's
    batches and scores from text (all read from the HF tokenizer at export)."""

    objective: str  # "next_token" | "label_words"
    vocab_size: int  # the LM head's rows (the logits' last dimension)
    num_layers: int
    padding_side: str  # the HF tokenizer's ("right" | "left")
    truncation_side: str
    #: label_words: the template's text after {text}, as token ids (no special tokens)
    prompt_tail: tuple[int, ...] = ()
    #: label_words: the first token of each label word, in label order
    word_ids: tuple[int, ...] = ()
    #: next_token: `objectives.word_starts` of the tokenizer, np.packbits then base64
    word_starts: str = ""

    def __post_init__(self) -> None:
        if self.objective not in LM_INPUTS:
            raise ValueError(f"objective {self.objective!r} is not one a causal-LM bundle "
                             f"trains ({', '.join(LM_INPUTS)})")
        if self.padding_side not in ("right", "left") or \
                self.truncation_side not in ("right", "left"):
            raise ValueError(f"padding/truncation side must be right or left, got "
                             f"{self.padding_side!r}/{self.truncation_side!r}")

    @staticmethod
    def pack_starts(bits: Any) -> str:
        """`word_starts` (bools, one per token id) as the manifest stores them."""
        return base64.b64encode(np.packbits(np.asarray(bits, dtype=bool)).tobytes()).decode()

    def starts(self) -> np.ndarray:
        """The word-start bools by token id (the packing's last byte pads with False)."""
        raw = np.frombuffer(base64.b64decode(self.word_starts), dtype=np.uint8)
        return np.unpackbits(raw).astype(bool)


@dataclass(frozen=True)
class Manifest:
    spec: dict[str, Any]  # spec_fingerprint of the task
    tensors: tuple[TensorInfo, ...]  # canonical (code point) order: graph inputs p0, p1, ..
    hidden_size: int
    pad_id: int
    kind: str = HEAD
    lm: LmInfo | None = None  # a causal_lm_lora bundle's
    version: int = BUNDLE_VERSION

    def check_spec(self, spec: TaskSpec) -> None:
        """Refuse a task this bundle was not exported for."""
        got = spec_fingerprint(spec, self.kind)
        diff = sorted(k for k in fingerprint_fields(self.kind) if got.get(k) != self.spec.get(k))
        if diff:
            raise BundleError(f"the ORT bundle was exported for another task definition "
                              f"(differs in {diff}); export it again for this task")

    def save(self, root: Path) -> None:
        d = asdict(self)
        (root / MANIFEST).write_text(json.dumps(d, indent=1, ensure_ascii=False),
                                     encoding="utf-8")

    @classmethod
    def load(cls, root: Path, kind: str | None = None) -> Manifest:
        """The manifest of the bundle at `root`; `kind`: refuse a bundle of another kind."""
        path = root / MANIFEST
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            if d.get("version") != BUNDLE_VERSION:
                raise BundleError(f"{path}: bundle version {d.get('version')!r}, this "
                                  f"seedfed reads {BUNDLE_VERSION}; export it again with "
                                  "`seedfed ort-export`")
            tensors = tuple(TensorInfo(str(t["name"]), tuple(int(s) for s in t["shape"]))
                            for t in d["tensors"])
            found = str(d["kind"])
            if found not in KINDS:
                raise BundleError(f"{path}: unknown bundle kind {found!r} (this seedfed reads "
                                  f"{', '.join(KINDS)})")
            lm = None
            if found == CAUSAL_LM_LORA:
                raw = dict(d["lm"])
                lm = LmInfo(**{**raw, "prompt_tail": tuple(int(i) for i in raw["prompt_tail"]),
                               "word_ids": tuple(int(i) for i in raw["word_ids"])})
            manifest = cls(spec=dict(d["spec"]), tensors=tensors,
                           hidden_size=int(d["hidden_size"]), pad_id=int(d["pad_id"]),
                           kind=found, lm=lm)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, BundleError):
                raise
            raise BundleError(f"{path}: not an ORT bundle manifest ({e})") from e
        if kind is not None and found != kind:
            raise BundleError(f"{root} is a {found} bundle, this needs a {kind} bundle")
        names = [t.name for t in tensors]
        if not names or names != sorted(names) or len(set(names)) != len(names):
            raise BundleError(f"{path}: trainable tensors must be unique and in canonical "
                              f"order, got {names[:5]}")
        for f in GRAPHS[found] + (TOKENIZER,):
            if not (root / f).is_file():
                raise BundleError(f"{root} lacks {f}: not a complete ORT bundle")
        return manifest
