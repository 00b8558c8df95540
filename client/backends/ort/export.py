"""Export a task's forward to an ORT bundle (packaging time: torch, onnx, onnxscript).

    seedfed ort-export --task task.json --model MODEL_DIR --out BUNDLE_DIR

The model is what `shared.model.factory.build_model` builds for the task (the device's own copy
of the base), split where the torch device splits it for its feature cache:

- `encoder.onnx`: the frozen encoder and the masked mean pooling, exported once per sentence
  batch (dynamic batch and length);
- `top.onnx`: everything above the features with the trainable tensors as graph inputs.
  `torch.vmap` over a leading copies axis of every trainable tensor, so one run evaluates C
  probes (theta + scale z for each), the batched probes of `client.probes` on an inference
  engine; the features are shared by every copy, not repeated.

Both go through `torch.onnx.export(dynamo=True)` (torch.export, then onnxscript). Only scopes
whose tensors all sit above the encoder (the head: the SST-2 recipe's scope) are exported: the
encoder is then frozen and cached, which is what makes a ZO step cheap. A body scope is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from seedfed.client.backends.ort.bundle import (
    ENCODER,
    TOKENIZER,
    TOP,
    BundleError,
    Manifest,
    TensorInfo,
    spec_fingerprint,
)
from seedfed.shared.model.classifier import MeanPoolClassifier, mean_pool
from seedfed.shared.model.factory import build_model
from seedfed.shared.protocol.task import TaskSpec
from torch import nn

#: ONNX opset of both graphs (ONNX Runtime 1.17+ runs it).
OPSET = 18


class _Encoder(nn.Module):
    """Token ids -> mean-pooled token states (before normalization), the cached features."""

    def __init__(self, model: MeanPoolClassifier) -> None:
        super().__init__()
        self.encoder = model.encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids)
        return mean_pool(out.last_hidden_state, attention_mask)


class _Top(nn.Module):
    """Pooled features -> logits: `MeanPoolClassifier.forward` above the pooled features."""

    def __init__(self, model: MeanPoolClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        pooled = nn.functional.normalize(features, dim=-1) if self.model.normalize else features
        return self.model.classifier(pooled)


class _StackedTop(nn.Module):
    """`_Top` with the trainable tensors as inputs, each stacked along a copies axis."""

    def __init__(self, top: _Top, names: list[str]) -> None:
        super().__init__()
        self.top = top
        self.keys = [f"model.{n}" for n in names]

    def forward(self, features: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        def one(*ps: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.top, dict(zip(self.keys, ps, strict=True)),
                                              (features,))

        return torch.vmap(one)(*params)


def _classifier_model(spec: TaskSpec) -> tuple[MeanPoolClassifier, Any, list[str]]:
    if spec.model_kind != "seq_cls" or spec.format != "fp32" or spec.scope == "lora":
        raise BundleError("the ORT backend exports fp32 seq_cls tasks of a non-LoRA scope "
                          f"(got {spec.model_kind}, {spec.format}, scope {spec.scope})")
    bundle = build_model(spec, initialize=False)
    model = bundle.model
    if not isinstance(model, MeanPoolClassifier):
        raise BundleError("the ORT backend exports sentence-transformers (mean pooling) "
                          f"models; {spec.model_path} loads as {type(model).__name__}")
    if model.frozen_prefix < model.num_layers:
        raise BundleError(f"scope {spec.scope!r} trains tensors inside the encoder "
                          f"({bundle.scope.names[0]}); the ORT backend exports scopes above "
                          "it (the head: scope 'named', patterns ['classifier'])")
    return model, bundle.tokenizer, bundle.scope.names


def export_bundle(spec: TaskSpec, out: Path, *, verbose: bool = False) -> Manifest:
    """Write the ORT bundle of `spec` (its `model_path` is the base model to export) to `out`."""
    model, tokenizer, names = _classifier_model(spec)
    if tokenizer is None or not (Path(spec.model_path) / TOKENIZER).is_file():
        raise BundleError(f"{spec.model_path} has no {TOKENIZER} (a fast tokenizer) to ship")
    out.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    batch, seq, copies = (torch.export.Dim("batch"), torch.export.Dim("seq"),
                          torch.export.Dim("copies"))
    ids = torch.full((2, 5), int(tokenizer.pad_token_id or 0) + 1, dtype=torch.int64)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        enc = torch.onnx.export(
            _Encoder(model).eval(), (ids, mask, torch.zeros_like(ids)), dynamo=True,
            opset_version=OPSET, verbose=verbose,
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["features"], dynamic_shapes=({0: batch, 1: seq},) * 3)
        assert enc is not None
        enc.save(str(out / ENCODER))
        hidden = int(model.config.hidden_size)
        stacked = tuple(params[n].detach().unsqueeze(0).repeat(2, *([1] * params[n].dim()))
                        for n in names)
        top = torch.onnx.export(
            _StackedTop(_Top(model), names).eval(), (torch.zeros(2, hidden), stacked),
            dynamo=True, opset_version=OPSET, verbose=verbose,
            input_names=["features"] + [f"p{i}" for i in range(len(names))],
            output_names=["logits"],
            dynamic_shapes={"features": {0: batch},
                            "params": tuple({0: copies} for _ in names)})
        assert top is not None
        top.save(str(out / TOP))
    shutil.copyfile(Path(spec.model_path) / TOKENIZER, out / TOKENIZER)
    manifest = Manifest(spec=spec_fingerprint(spec),
                        tensors=tuple(TensorInfo(n, tuple(params[n].shape)) for n in names),
                        hidden_size=hidden, pad_id=int(tokenizer.pad_token_id or 0))
    manifest.save(out)
    return manifest

