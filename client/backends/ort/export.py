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

A causal LM with scope `lora` (fp32) becomes one graph, `lm.onnx` (MobiZO's setting): the
objective's batch plus every LoRA tensor as an input with a leading copies axis C, the C
per-copy mean losses out. The batch is stacked C times along its first axis (copy-major, as
the torch device's batched probes stack it) and every Linear that owns LoRA tensors runs each
copy's rows through that copy's tensors in one batched matmul; everything else (the frozen base)
runs once over all copies. The losses are `objectives.LabelWords.losses` /
`objectives.causal_lm_losses` written per copy: the label words' logits come from
`objectives.label_words_logits` itself.

Every graph goes through `torch.onnx.export(dynamo=True)` (torch.export, then onnxscript).
A seq_cls task exports only scopes whose tensors all sit above the encoder (the head: the
SST-2 recipe's scope): the encoder is then frozen and cached, which is what makes a ZO step
cheap. A body scope is refused.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from seedfed.client.backends.ort.bundle import (
    CAUSAL_LM_LORA,
    ENCODER,
    LM,
    LM_INPUTS,
    LM_OUTPUTS,
    TOKENIZER,
    TOP,
    BundleError,
    LmInfo,
    Manifest,
    TensorInfo,
    spec_fingerprint,
)
from seedfed.shared.model.classifier import MeanPoolClassifier, mean_pool
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.model.objectives import (
    ANSWER,
    label_word_ids,
    label_words_logits,
    lm_parts,
    word_starts,
)
from seedfed.shared.protocol.objective import TEXT_FIELD
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


#: What the ORT backend exports, for the refusals.
EXPORTS = ("fp32 seq_cls tasks of a non-LoRA scope (a sentence encoder's head) and fp32 "
           "causal_lm tasks of scope lora")


def _classifier_model(spec: TaskSpec) -> tuple[MeanPoolClassifier, Any, list[str]]:
    if spec.model_kind != "seq_cls" or spec.format != "fp32" or spec.scope == "lora":
        raise BundleError(f"the ORT backend exports {EXPORTS} (got {spec.model_kind}, "
                          f"{spec.format}, scope {spec.scope})")
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
    if spec.model_kind == "causal_lm":
        return _export_lm(spec, out, verbose=verbose)
    return _export_head(spec, out, verbose=verbose)


def _export_head(spec: TaskSpec, out: Path, *, verbose: bool) -> Manifest:
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



# -- a causal LM's LoRA scope ----------------------------------------------------------------
class _StackedLinears:
    """The Linears owning scope tensors, each running copy c's rows of its input through copy
    c's tensors (`_fused_linear`'s batched matmul in `client.probes`): while `stacked` holds
    the [C, *shape] tensors by canonical name, a module's input of C * B rows is split
    copy-major into C groups."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        modules = dict(model.named_modules())
        # module path -> (the Linear, {its attribute: the scope tensor's canonical name})
        self.owners: dict[str, tuple[nn.Linear, dict[str, str]]] = {}
        for name in names:
            path, attr = name.rsplit(".", 1)
            module = modules.get(path)
            if type(module) is not nn.Linear or attr not in ("weight", "bias"):
                raise BundleError(f"LoRA tensor {name} is not a Linear's weight or bias; the ORT "
                                  "export stacks copies of Linear layers only")
            self.owners.setdefault(path, (module, {}))[1][attr] = name
        self.stacked: dict[str, torch.Tensor] = {}

    def _forward(self, module: nn.Linear, names: dict[str, str]) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = self.stacked[names["weight"]] if "weight" in names else None
            bias = self.stacked[names["bias"]] if "bias" in names else None
            copies = (weight if weight is not None else bias).shape[0]  # type: ignore[union-attr]
            if weight is None:
                weight = module.weight.expand(copies, *module.weight.shape)
            if bias is None and module.bias is not None:
                bias = module.bias.expand(copies, *module.bias.shape)
            x3 = x.reshape(copies, -1, x.shape[-1])  # (copy, rows x positions, in)
            if bias is None:
                y = torch.bmm(x3, weight.transpose(1, 2))
            else:
                y = torch.baddbmm(bias.unsqueeze(1), x3, weight.transpose(1, 2))
            return y.reshape(*x.shape[:-1], weight.shape[1])
        return forward

    @contextmanager
    def patched(self) -> Iterator[None]:
        for module, names in self.owners.values():
            module.forward = self._forward(module, names)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for module, _ in self.owners.values():
                del module.forward


class _NextTokenLM(nn.Module):
    """(input_ids, attention_mask, labels [B, T], LoRA tensors [C, ...]) -> per-copy mean
    next-token losses [C] (`causal_lm_losses`), per-token losses and top-1 ids [C, B, T-1]."""

    def __init__(self, model: nn.Module, linears: _StackedLinears, names: list[str]) -> None:
        super().__init__()
        self.model, self.linears, self.names = model, linears, names

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor, params: tuple[torch.Tensor, ...],
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.linears.stacked = dict(zip(self.names, params, strict=True))
        copies, rows = params[0].shape[0], input_ids.shape[0]
        out = self.model(input_ids=input_ids.repeat(copies, 1),
                         attention_mask=attention_mask.repeat(copies, 1))
        logits = out.logits[:, :-1].float()
        logits = logits.reshape(copies, rows, logits.shape[1], logits.shape[2])
        target = labels[:, 1:]
        keep = target != -100
        picked = torch.gather(torch.log_softmax(logits, dim=-1), -1,
                              target.clamp_min(0)[None, :, :, None].expand(copies, -1, -1, 1))
        nll = torch.where(keep, -picked[..., 0], torch.zeros((), dtype=logits.dtype))
        # cross_entropy's mean with ignore_index: the sum over kept targets / their count
        losses = nll.sum(dim=(1, 2)) / keep.sum().to(nll.dtype)
        return losses, nll, logits.argmax(dim=-1)


class _LabelWordsLM(nn.Module):
    """(input_ids, attention_mask, answer, labels [B], LoRA tensors [C, ...]) -> per-copy mean
    label-word losses [C] (`LabelWords.losses`) and the label words' logits [C, B, K]."""

    word_ids: torch.Tensor

    def __init__(self, model: nn.Module, linears: _StackedLinears, names: list[str],
                 word_ids: list[int]) -> None:
        super().__init__()
        self.model, self.linears, self.names = model, linears, names
        self.register_buffer("word_ids", torch.tensor(word_ids, dtype=torch.long))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                answer: torch.Tensor, labels: torch.Tensor, params: tuple[torch.Tensor, ...],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self.linears.stacked = dict(zip(self.names, params, strict=True))
        copies, rows = params[0].shape[0], input_ids.shape[0]
        batch = {"input_ids": input_ids.repeat(copies, 1),
                 "attention_mask": attention_mask.repeat(copies, 1),
                 ANSWER: answer.repeat(copies)}
        logits = label_words_logits(self.model, batch, self.word_ids)
        logits = logits.reshape(copies, rows, logits.shape[-1])
        # cross_entropy per example, meaned per copy (its `view(copies, -1)` does not export)
        picked = torch.gather(torch.log_softmax(logits, dim=-1), -1,
                              labels[None, :, None].expand(copies, -1, 1))
        return -picked[..., 0].mean(dim=1), logits


def _lm_model(spec: TaskSpec) -> ModelBundle:
    if spec.scope != "lora" or spec.format != "fp32":
        raise BundleError(f"the ORT backend exports {EXPORTS} (got {spec.model_kind}, "
                          f"{spec.format}, scope {spec.scope})")
    bundle = build_model(spec, initialize=False)
    if bundle.tokenizer is None or not getattr(bundle.tokenizer, "is_fast", False):
        raise BundleError(f"{spec.model_path} has no fast tokenizer ({TOKENIZER}) to ship")
    if spec.objective.kind == "label_words":
        try:
            lm_parts(bundle.model)
        except ValueError as e:
            raise BundleError(str(e)) from e
    return bundle


def _base_config(bundle: ModelBundle) -> Any:
    """The HF config of the model under the peft wrapper."""
    peft_model: Any = bundle.model
    return peft_model.get_base_model().config


def _lm_info(spec: TaskSpec, bundle: ModelBundle) -> LmInfo:
    tokenizer, config = bundle.tokenizer, _base_config(bundle)
    kind = str(spec.objective.kind)
    info: dict[str, Any] = {}
    if kind == "label_words":
        suffix = spec.objective.template.split(TEXT_FIELD)[1]
        tail = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
        if spec.max_seq_len - len(tail) < 2:
            raise BundleError(f"max_seq_len {spec.max_seq_len} leaves no room for text beside "
                              f"the template's {len(tail)} tokens")
        try:
            words = label_word_ids(tokenizer, spec.objective)
        except ValueError as e:
            raise BundleError(str(e)) from e
        info = {"prompt_tail": tuple(int(t) for t in tail), "word_ids": tuple(words)}
    else:
        info = {"word_starts": LmInfo.pack_starts(word_starts(tokenizer).numpy())}
    return LmInfo(objective=kind, vocab_size=int(config.vocab_size),
                  num_layers=int(config.num_hidden_layers),
                  padding_side=str(tokenizer.padding_side),
                  truncation_side=str(tokenizer.truncation_side), **info)


def _export_lm(spec: TaskSpec, out: Path, *, verbose: bool) -> Manifest:
    bundle = _lm_model(spec)
    info = _lm_info(spec, bundle)
    names = bundle.scope.names
    params = {t.name: t.tensor.detach() for t in bundle.scope}
    linears = _StackedLinears(bundle.model, names)
    graph: nn.Module = (_NextTokenLM(bundle.model, linears, names) if info.objective ==
                        "next_token" else
                        _LabelWordsLM(bundle.model, linears, names, list(info.word_ids)))
    out.mkdir(parents=True, exist_ok=True)
    batch, seq, copies = (torch.export.Dim("batch"), torch.export.Dim("seq"),
                          torch.export.Dim("copies"))
    # Sizes that differ from each other and from 0 and 1, and a padded row, so nothing
    # specializes to the example.
    ids = torch.full((2, 7), int(bundle.tokenizer.pad_token_id or 0) + 1, dtype=torch.int64)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    stacked = tuple(params[n].unsqueeze(0).repeat(3, *([1] * params[n].dim())) for n in names)
    if info.objective == "next_token":
        args: tuple[Any, ...] = (ids, mask, ids.masked_fill(mask == 0, -100), stacked)
        dynamic: dict[str, Any] = {"labels": {0: batch, 1: seq}}
    else:
        args = (ids, mask, mask.sum(1) - 1, torch.tensor([0, 1]), stacked)
        dynamic = {"answer": {0: batch}, "labels": {0: batch}}
    inputs = LM_INPUTS[info.objective]
    with torch.no_grad(), linears.patched():
        program = torch.onnx.export(
            graph.eval(), args, dynamo=True, opset_version=OPSET, verbose=verbose,
            input_names=[*inputs, *(f"p{i}" for i in range(len(names)))],
            output_names=list(LM_OUTPUTS[info.objective]),
            dynamic_shapes={"input_ids": {0: batch, 1: seq},
                            "attention_mask": {0: batch, 1: seq}, **dynamic,
                            "params": tuple({0: copies} for _ in names)})
    assert program is not None
    program.save(str(out / LM))
    (out / TOKENIZER).write_text(bundle.tokenizer.backend_tokenizer.to_str(), encoding="utf-8")
    config = _base_config(bundle)
    manifest = Manifest(spec=spec_fingerprint(spec, CAUSAL_LM_LORA),
                        tensors=tuple(TensorInfo(n, tuple(params[n].shape)) for n in names),
                        hidden_size=int(config.hidden_size),
                        pad_id=int(bundle.tokenizer.pad_token_id or 0),
                        kind=CAUSAL_LM_LORA, lm=info)
    manifest.save(out)
    return manifest
