from __future__ import annotations

import pytest
import torch
from transformers import BitNetConfig, BitNetForCausalLM, LlamaForCausalLM

from tests.shared.conftest import random_weights
from tests.shared.conftest import tiny_llama as shared_tiny_llama


def tiny_llama(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    """A 2-layer Llama with weights from an explicit generator (the fp32 latents to convert)."""
    return shared_tiny_llama(seed, tie, vocab_size=64, intermediate_size=48,
                             max_position_embeddings=32)


def tiny_bitnet(seed: int = 0) -> BitNetForCausalLM:
    cfg = BitNetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       bos_token_id=0, eos_token_id=1)
    return random_weights(BitNetForCausalLM(cfg), seed, skip=lambda name: "norm" in name)


@pytest.fixture
def llama() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture
def bitnet() -> BitNetForCausalLM:
    return tiny_bitnet()


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
