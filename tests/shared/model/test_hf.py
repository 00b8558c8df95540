"""Loading a Hugging Face directory: the pooling a sentence-transformers directory declares,
and loads in threads that leave transformers' weight tying intact."""

from __future__ import annotations

import json
from pathlib import Path

from seedfed.shared.model.hf import sentence_pooling
from seedfed.shared.protocol.task import TaskSpec

from tests.shared.model.minilm import MINILM


def test_sentence_transformers_dir_reads_mean_pooling_and_normalize() -> None:
    assert sentence_pooling(Path(MINILM)).normalize is True  # type: ignore[union-attr]


def test_plain_hf_dir_has_no_sentence_pooling(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    assert sentence_pooling(tmp_path) is None


def test_cls_pooling_dir_is_not_mean_pooled(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))

    assert sentence_pooling(tmp_path) is None


def test_loads_in_threads_leave_weight_tying_working(tmp_path: Path) -> None:
    # Arrange: a tied causal LM on disk, loaded by eight threads at once (devices of one process)
    from concurrent.futures import ThreadPoolExecutor

    from seedfed.shared.model.hf import load_base
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    spec = TaskSpec(model_path=str(tmp_path / "lm"), model_kind="causal_lm", scope="full")
    tie_weights = PreTrainedModel.tie_weights

    # Act
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: load_base(spec)[0], range(16)))

    # Assert: every load tied, and a model built afterwards still ties its embeddings
    assert PreTrainedModel.tie_weights is tie_weights
    assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in loaded)
    fresh = LlamaForCausalLM(config)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
