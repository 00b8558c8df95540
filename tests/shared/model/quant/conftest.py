from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig


@pytest.fixture
def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       max_position_embeddings=64)


@pytest.fixture
def token_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
