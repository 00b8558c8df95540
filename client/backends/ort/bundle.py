"""The ORT bundle: what `export` writes and the torch-free device reads.

    bundle/manifest.json   Manifest (below): the task it was built for, the trainable tensors
    bundle/encoder.onnx    input_ids, attention_mask, token_type_ids [B, T] -> pooled [B, H]
                           (the frozen encoder and the masked mean: the features the torch
                           device caches per sentence)
    bundle/top.onnx        features [B, H] + one input per trainable tensor, stacked per probe
                           [C, *shape] -> logits [C, B, labels] (normalization and the head)
    bundle/tokenizer.json  the base model's tokenizer (HF `tokenizers` format)

The frozen weights live inside the graphs; the trainable tensors are graph inputs, so the
device feeds theta + eps z of C probes in one run and the stored state never changes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.task import TaskSpec

MANIFEST = "manifest.json"
ENCODER = "encoder.onnx"
TOP = "top.onnx"
TOKENIZER = "tokenizer.json"
#: Layout version of the bundle directory.
BUNDLE_VERSION = 1
#: The TaskSpec fields that decide the exported function (the model path does not: each side
#: names its own copy of the base).
SPEC_FIELDS: tuple[str, ...] = ("model_kind", "num_labels", "label_texts", "scope",
                                "scope_options", "format", "max_seq_len")


class BundleError(SeedfedError, ValueError):
    """An ORT bundle that is missing, malformed or built for another task."""


def spec_fingerprint(spec: TaskSpec) -> dict[str, Any]:
    """The part of a task definition a bundle is bound to, as JSON values."""
    d = spec.to_dict()
    return json.loads(json.dumps({k: d[k] for k in SPEC_FIELDS}))


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
class Manifest:
    spec: dict[str, Any]  # spec_fingerprint of the task
    tensors: tuple[TensorInfo, ...]  # canonical (code point) order: top.onnx inputs p0, p1, ..
    hidden_size: int
    pad_id: int
    version: int = BUNDLE_VERSION

    def check_spec(self, spec: TaskSpec) -> None:
        """Refuse a task this bundle was not exported for."""
        got = spec_fingerprint(spec)
        diff = sorted(k for k in SPEC_FIELDS if got.get(k) != self.spec.get(k))
        if diff:
            raise BundleError(f"the ORT bundle was exported for another task definition "
                              f"(differs in {diff}); export it again for this task")

    def save(self, root: Path) -> None:
        d = asdict(self)
        (root / MANIFEST).write_text(json.dumps(d, indent=1, ensure_ascii=False),
                                     encoding="utf-8")

    @classmethod
    def load(cls, root: Path) -> Manifest:
        path = root / MANIFEST
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            if d.get("version") != BUNDLE_VERSION:
                raise BundleError(f"{path}: bundle version {d.get('version')!r}, this "
                                  f"seedfed reads {BUNDLE_VERSION}")
            tensors = tuple(TensorInfo(str(t["name"]), tuple(int(s) for s in t["shape"]))
                            for t in d["tensors"])
            manifest = cls(spec=dict(d["spec"]), tensors=tensors,
                           hidden_size=int(d["hidden_size"]), pad_id=int(d["pad_id"]))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, BundleError):
                raise
            raise BundleError(f"{path}: not an ORT bundle manifest ({e})") from e
        names = [t.name for t in tensors]
        if not names or names != sorted(names) or len(set(names)) != len(names):
            raise BundleError(f"{path}: trainable tensors must be unique and in canonical "
                              f"order, got {names[:5]}")
        for f in (ENCODER, TOP, TOKENIZER):
            if not (root / f).is_file():
                raise BundleError(f"{root} lacks {f}: not a complete ORT bundle")
        return manifest
