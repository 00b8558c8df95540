"""From a task definition to a model, its tokenizer and its trainable scope.

Both sides call `build_model`: the coordinator with `initialize=True` to create version 0 of the
trainable state (heads and adapters set from an explicit generator, never the global RNG), a
device with `initialize=False` and then loads the coordinator's snapshot, so the two agree bit
for bit without sharing an initialization routine across library versions. The pieces live by
concern: `hf` (loading a directory), `classifier` (the mean-pooled sentence classifier and its
feature cache), `head` (prototype heads), `lora` (adapters), `quant` (int8/int4 formats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from seedfed.shared.model.classifier import MeanPoolClassifier, frozen_prefix_depth
from seedfed.shared.model.head import classifier_module, init_prototype_head
from seedfed.shared.model.hf import load_base
from seedfed.shared.model.lora import apply_lora, init_adapters
from seedfed.shared.model.scopes import Scope, build_scope
from seedfed.shared.protocol.task import TaskSpec
from torch import nn

#: Seed of the generator that initializes version 0 (adapters, heads without label texts).
INIT_SEED = 0x5EEDFED


@dataclass
class ModelBundle:
    """What `build_model` returns: the model, its tokenizer (None for a directory without
    one), its trainable scope and the task it was built for."""

    model: nn.Module
    tokenizer: Any
    scope: Scope
    spec: TaskSpec


def build_model(spec: TaskSpec, *, initialize: bool) -> ModelBundle:
    """The model a task trains, with its scope. `initialize` sets version 0 deterministically."""
    model, tokenizer = load_base(spec)
    generator = torch.Generator().manual_seed(INIT_SEED)
    if spec.model_kind == "seq_cls":
        head = classifier_module(model)
        if spec.label_texts and tokenizer is not None:
            # Both sides compute the prototype head: when the head trains, snapshot 0
            # overwrites it exactly; when it stays frozen (outside the scope), devices still
            # hold the coordinator's head (bit-identical on the same kind of CPU).
            init_prototype_head(model, tokenizer, spec.label_texts)
        else:
            # Seeded even without `initialize`: a device's head is overwritten by snapshot 0,
            # but nothing should ever depend on torch's global RNG.
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.02)
                if head.bias is not None:
                    head.bias.zero_()
    if spec.scope == "lora":
        model = apply_lora(model, spec.lora, spec.model_kind)
        if initialize:
            init_adapters(model, generator)
    if spec.format in ("int8", "int4"):
        model = _quantize(model, spec)
    for p in model.parameters():
        p.requires_grad_(False)  # ZO never needs autograd; keeps forwards lean
    scope = build_scope(spec.scope, model, spec.scope_options)
    if spec.step_scales:
        scope.set_step_scales(spec.step_scales)
    if spec.scope == "ternary" and spec.model_kind == "seq_cls" and spec.label_texts and \
            tokenizer is not None:
        # The scope converted the encoder to BitLinear: the prototypes must be the features
        # of the ternary forward the devices run (set in place; the scope keeps its tensors).
        init_prototype_head(model, tokenizer, spec.label_texts)
    inner = getattr(getattr(model, "base_model", model), "model", model)
    if isinstance(inner, MeanPoolClassifier):
        inner.frozen_prefix = frozen_prefix_depth(model, scope)
    return ModelBundle(model=model, tokenizer=tokenizer, scope=scope, spec=spec)


def _quantize(model: nn.Module, spec: TaskSpec) -> nn.Module:
    """Group-wise int8/int4 Linear layers (heads stay float): the QZO `scales` scope's model."""
    from seedfed.shared.model.quant.model import DEFAULT_SKIP, QuantConfig, quantize_model

    bits = 8 if spec.format == "int8" else 4
    group_size = getattr(spec.scope_options, "group_size", None) or 64  # ScalesOptions
    # LoRA adapters (and peft's head copies) stay float: only the base weights under them are
    # quantized, so the shared base is int8/int4 while the adapters train in float32.
    skip = DEFAULT_SKIP + (("lora_A", "lora_B", "modules_to_save", "original_module")
                           if spec.scope == "lora" else ())
    return quantize_model(model, QuantConfig(bits=bits, group_size=group_size, skip=skip))
