import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, tie: bool = True) -> LlamaForCausalLM:
    """A 2-layer Llama small enough for property tests; weights from an explicit generator."""
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@pytest.fixture
def llama() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture
def token_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids}
