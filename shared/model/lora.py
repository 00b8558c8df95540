"""LoRA adapters: wrapping a model with peft, and version 0's adapters from a seeded generator."""

from __future__ import annotations

import torch
from seedfed.shared.model.classifier import MeanPoolClassifier
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.task import LoraOptions
from torch import nn

#: LoraOptions' default targets (BERT's attention query and value).
DEFAULT_TARGETS = LoraOptions().target_modules


def _matches(target: str, names: list[str]) -> bool:
    return any(n == target or n.endswith(f".{target}") for n in names)


def default_targets(model: nn.Module, names: list[str]) -> tuple[str, ...]:
    """The targets a task that names none wraps: the attention query and value. They are
    BERT's `query`/`value` by default; a model without those (a causal LM) takes peft's
    targets for its architecture (q_proj/v_proj for Llama, Qwen2 and OPT, c_attn for GPT-2),
    the same on every device and the coordinator, as both run the same peft."""
    if all(_matches(t, names) for t in DEFAULT_TARGETS):
        return DEFAULT_TARGETS
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return tuple(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type or "",
                                                                       DEFAULT_TARGETS))



def apply_lora(model: nn.Module, options: LoraOptions, model_kind: str) -> nn.Module:
    """Wrap the model with peft LoRA adapters (dropout 0: both probes must see one function)."""
    from peft import LoraConfig, TaskType, get_peft_model

    names = [n for n, _ in model.named_modules()]
    targets = default_targets(model, names) if options.target_modules == DEFAULT_TARGETS \
        else options.target_modules
    # peft's rule: a target names a module exactly or ends its dotted path.
    unmatched = [t for t in targets if not _matches(t, names)]
    if unmatched:
        raise ScopeError(f"LoRA target_modules {unmatched} match no module of "
                         f"{type(model).__name__} (e.g. {names[-1]!r}); name modules by their "
                         "last path components, e.g. 'query' or 'layer.5.attention.self.query'")
    config = LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=0.0,
                        target_modules=list(targets))
    if isinstance(model, MeanPoolClassifier):
        # A custom module: no peft task type; the head trains as a modules_to_save copy.
        config.modules_to_save = ["classifier"] if options.train_head else []
    else:
        config.task_type = TaskType.SEQ_CLS if model_kind == "seq_cls" else TaskType.CAUSAL_LM
        if model_kind == "seq_cls" and not options.train_head:
            config.modules_to_save = []
    peft_model = get_peft_model(model, config)
    return peft_model.eval()


@torch.no_grad()
def init_adapters(model: nn.Module, generator: torch.Generator) -> None:
    """LoRA A from a seeded Kaiming-uniform-like range, B zero: the adapted model starts equal
    to the base model, and version 0 does not depend on torch's global RNG."""
    for name, p in model.named_parameters():
        if "lora_A" in name:
            bound = (1.0 / p.shape[1]) ** 0.5
            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))
        elif "lora_B" in name:
            p.zero_()
