"""From a task definition to a model, its tokenizer and its trainable scope.

Both sides call `build_model`: the coordinator with `initialize=True` to create version 0 of the
trainable state (heads and adapters set from an explicit generator, never the global RNG), a
device with `initialize=False` and then loads the coordinator's snapshot, so the two agree bit
for bit without sharing an initialization routine across library versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ScopeError
from .scopes import Scope, build_scope
from .task import LoraOptions, TaskSpec

#: Seed of the generator that initializes version 0 (adapters, heads without label texts).
INIT_SEED = 0x5EEDFED


@dataclass
class ModelBundle:
    model: nn.Module
    tokenizer: Any
    scope: Scope
    spec: TaskSpec


def load_base(spec: TaskSpec) -> tuple[nn.Module, Any]:
    """Load the frozen base model and tokenizer from a local Hugging Face directory."""
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoTokenizer)

    path = Path(spec.model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    if spec.model_kind == "seq_cls":
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=spec.num_labels, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                             "vocab.txt", "tokenizer.model"))


def apply_lora(model: nn.Module, options: LoraOptions, model_kind: str) -> nn.Module:
    """Wrap the model with peft LoRA adapters (dropout 0: both probes must see one function)."""
    from peft import LoraConfig, TaskType, get_peft_model

    task_type = TaskType.SEQ_CLS if model_kind == "seq_cls" else TaskType.CAUSAL_LM
    config = LoraConfig(task_type=task_type, r=options.r, lora_alpha=options.alpha,
                        lora_dropout=0.0, target_modules=list(options.target_modules))
    if model_kind == "seq_cls" and not options.train_head:
        config.modules_to_save = []
    peft_model = get_peft_model(model, config)
    return peft_model.eval()


def classifier_module(model: nn.Module) -> nn.Linear:
    """The final Linear layer producing class logits (BERT's `classifier`, Llama's `score`)."""
    for name in ("classifier", "score"):
        for mod_name, mod in model.named_modules():
            if mod_name.endswith(name) and isinstance(mod, nn.Linear) and "original_module" \
                    not in mod_name:
                return mod
    raise ScopeError(f"{type(model).__name__} has no classifier/score Linear head")


@torch.no_grad()
def init_prototype_head(model: nn.Module, tokenizer: Any, label_texts: tuple[str, ...],
                        scale: float = 10.0) -> None:
    """Set each class row of the head to the normalized feature of its label description.

    ZO crawls from a random head (DESIGN.md learning notes); starting from prototypes gives a
    model that already separates the classes before any training.
    """
    head = classifier_module(model)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, args, _o: captured.append(args[0].detach()))
    try:
        enc = tokenizer(list(label_texts), padding=True, return_tensors="pt")
        model(**enc)
    finally:
        handle.remove()
    feats = captured[-1].float()
    feats = feats - feats.mean(dim=0, keepdim=True)
    feats = feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-8)
    head.weight.copy_(scale * feats)
    if head.bias is not None:
        head.bias.zero_()


@torch.no_grad()
def _init_adapters(model: nn.Module, generator: torch.Generator) -> None:
    """LoRA A from a seeded Kaiming-uniform-like range, B zero: the adapted model starts equal
    to the base model, and version 0 does not depend on torch's global RNG."""
    for name, p in model.named_parameters():
        if "lora_A" in name:
            bound = (1.0 / p.shape[1]) ** 0.5
            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))
        elif "lora_B" in name:
            p.zero_()


def build_model(spec: TaskSpec, *, initialize: bool) -> ModelBundle:
    """The model a task trains, with its scope. `initialize` sets version 0 deterministically."""
    model, tokenizer = load_base(spec)
    generator = torch.Generator().manual_seed(INIT_SEED)
    if initialize and spec.model_kind == "seq_cls":
        head = classifier_module(model)
        if spec.label_texts and tokenizer is not None:
            init_prototype_head(model, tokenizer, spec.label_texts)
        else:
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.02)
                if head.bias is not None:
                    head.bias.zero_()
    if spec.scope == "lora":
        model = apply_lora(model, spec.lora, spec.model_kind)
        if initialize:
            _init_adapters(model, generator)
    for p in model.parameters():
        p.requires_grad_(False)  # ZO never needs autograd; keeps forwards lean
    scope = build_scope(spec.scope, model, **spec.scope_options)
    return ModelBundle(model=model, tokenizer=tokenizer, scope=scope, spec=spec)
