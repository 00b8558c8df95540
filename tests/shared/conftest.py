from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

M = TypeVar("M", bound=nn.Module)


def random_weights(model: M, seed: int, skip: Callable[[str], bool] = lambda _: False) -> M:
    """`model` (in eval mode) with every parameter whose name `skip` refuses drawn as
    N(0, 0.05^2) from an explicit generator, in parameter order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not skip(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def tiny_llama(seed: int = 0, tie: bool = True, **config: Any) -> LlamaForCausalLM:
    """A 2-layer Llama small enough for property tests; weights from an explicit generator.
    `config` overrides LlamaConfig fields."""
    cfg = LlamaConfig(**{"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, **config}, tie_word_embeddings=tie)
    return random_weights(LlamaForCausalLM(cfg), seed)


def lora_llama(targets: tuple[str, ...], r: int = 4,
               seed: int = 5) -> tuple[nn.Module, Any]:
    """`tiny_llama()` with LoRA on `targets` (every base weight frozen) and its lora scope;
    the adapters drawn from an explicit generator (peft drew A from the global RNG; a nonzero
    B makes A matter)."""
    from seedfed.shared.model.lora import apply_lora
    from seedfed.shared.model.scopes import build_scope
    from seedfed.shared.protocol.task import LoraOptions

    model = apply_lora(tiny_llama(), LoraOptions(r=r, target_modules=targets), "causal_lm")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(False)
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model, build_scope("lora", model)


@pytest.fixture
def llama() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture
def token_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids}
