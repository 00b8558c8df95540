"""Tiny model directories and a labelled TSV for the Flower, device and simulation tests.

A BERT classifier and a Llama causal LM (the ternary tasks' model, converted to BitLinear by
the task) small enough that a device round takes milliseconds, so the tests measure the
machinery (catch-up, wire, coordinator) rather than a real model's forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from seedfed.shared.protocol.task import Hyper, TaskSpec

POSITIVE = ("good", "great", "lovely", "fine", "happy", "sunny")
NEGATIVE = ("bad", "awful", "sad", "poor", "dull", "grim")
FILLER = ("the", "a", "film", "day", "was", "very", "quite", "food", "it", "is")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def make_tiny_bert(path: Path, seed: int = 0) -> Path:
    """Save a 2-layer BERT sequence classifier with a word-level vocabulary to `path`."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + POSITIVE + NEGATIVE + FILLER) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    config = BertConfig(vocab_size=len(SPECIAL + POSITIVE + NEGATIVE + FILLER), hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_sentence_bert(path: Path, seed: int = 0, layers: int = 2) -> Path:
    """A sentence-transformers directory (BertModel + mean Pooling + Normalize) of a tiny
    BERT with the word-level vocabulary of `make_tiny_bert`: the shape of the packaged MiniLM,
    which a ternary classifier task and `seedfed ternarize` take."""
    import json

    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    words = SPECIAL + POSITIVE + NEGATIVE + FILLER
    # transformers 5 reads a `vocab` mapping (a `vocab_file` alone leaves every word [UNK])
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, do_lower_case=True)
    config = BertConfig(vocab_size=len(words), hidden_size=32,
                        num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=64)
    model = BertModel(config, add_pooling_layer=False).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    return path


def ternary_cls_spec(model: Path, epoch_rounds: int = 2, **options: Any) -> TaskSpec:
    """A ternary (TerMeZO) sentiment classifier on a sentence-transformers `model`: 5% masks,
    a mask epoch every `epoch_rounds` versions, prototype head from two label texts."""
    return TaskSpec(model_path=str(model), model_kind="seq_cls", num_labels=2,
                    label_texts=("it was bad", "it was good"), scope="ternary",
                    format="ternary", max_seq_len=16,
                    scope_options={"fraction": 0.05, "epoch_rounds": epoch_rounds, **options},
                    hyper=Hyper(lr=1e-2, eps=5e-3, steps=2, perturbations=2, batch_size=4))


def write_sentiment_tsv(path: Path, n: int = 600, seed: int = 0) -> Path:
    """`label<TAB>sentence` with a header: label 1 iff the sentence holds a positive word."""
    rng = np.random.default_rng(seed)
    lines = ["label\tsentence"]
    for i in range(n):
        label = int(rng.integers(0, 2))
        word = (POSITIVE if label else NEGATIVE)[int(rng.integers(0, 6))]
        fill = [FILLER[int(j)] for j in rng.integers(0, len(FILLER), size=3)]
        # a unique tail keeps the split's de-duplication from shrinking the set
        lines.append(f"{label}\t{' '.join(fill[:2])} {word} {fill[2]} {'very ' * (i % 7)}it")
    path.write_text("\n".join(lines) + "\n")
    return path


#: Vocabulary size of the tiny Llama (its character tokenizer uses the first ids only).
LLAMA_VOCAB = 96
#: Characters of the tiny Llama's tokenizer (lower-cased input), after its special tokens.
LLAMA_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-:"


def write_tiny_llama(path: Path, tokenizer: bool = False, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 32, vocab 96) with weights from an explicit generator; with
    `tokenizer`, also a character-level tokenizer (what a device needs to train on text)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    if tokenizer:
        _char_tokenizer().save_pretrained(path)
    return path


#: The causal-LM families `write_tiny_causal_lm` builds.
CAUSAL_LM_FAMILIES = ("llama", "qwen2", "gpt2", "opt")


def tiny_causal_lm_config(family: str) -> Any:
    """A 2-layer, hidden-32, vocab-96 config of a causal-LM `family` (CAUSAL_LM_FAMILIES)."""
    from transformers import GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

    if family == "llama":
        return LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)
    if family == "qwen2":
        return Qwen2Config(vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)
    if family == "gpt2":  # GPT-2's default bos/eos (50256) lie outside the tiny vocabulary
        return GPT2Config(vocab_size=LLAMA_VOCAB, n_embd=32, n_layer=2, n_head=4,
                          n_positions=64, bos_token_id=2, eos_token_id=3)
    if family == "opt":
        return OPTConfig(vocab_size=LLAMA_VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64,
                         word_embed_proj_dim=32)
    raise ValueError(f"family must be one of {CAUSAL_LM_FAMILIES}, got {family!r}")


def write_tiny_causal_lm(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny causal LM of `family` (`tiny_causal_lm_config`) with weights from an explicit
    generator and a character tokenizer, saved to `path`: `write_tiny_llama`'s, except for
    qwen2, whose directory transformers always loads as a byte-level Qwen2Tokenizer (no
    lower-casing, a space is 'Ġ'), so it gets the same characters in byte-level form."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config(family))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.eval().save_pretrained(path)
    _char_tokenizer(byte_level=family == "qwen2").save_pretrained(path)
    return path


def ternary_spec(model: Path, epoch_rounds: int = 2) -> TaskSpec:
    """A ternary (TerMeZO) causal-LM task on `model`: 5% masks, a mask epoch every
    `epoch_rounds` versions, 2 steps x 2 perturbations of 2 examples."""
    return TaskSpec(model_path=str(model), model_kind="causal_lm", scope="ternary",
                    format="ternary", max_seq_len=16,
                    scope_options={"fraction": 0.05, "epoch_rounds": epoch_rounds},
                    hyper=Hyper(lr=1e-2, eps=5e-3, steps=2, perturbations=2, batch_size=2))


def _char_tokenizer(byte_level: bool = False) -> Any:
    """One token per character of LLAMA_CHARS (lower-cased). `byte_level`: the same ids with
    the space spelled 'Ġ', plus upper-case letters after them (a byte-level tokenizer neither
    lower-cases nor sees a bare space)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    chars = (LLAMA_CHARS.replace(" ", "Ġ") + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if byte_level
             else LLAMA_CHARS)
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    assert len(vocab) <= LLAMA_VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    if not byte_level:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


class _FixedRate:
    """A `client.catchup.RateMeter` that keeps its rate whatever it observes."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def observe(self, units: float, seconds: float) -> None:
        pass


def replay_when_allowed(device: Any) -> Any:
    """Pin an HTTP device's measured rates so that its catch-up replays whenever the
    coordinator allows it (a download only where forced, e.g. across a mask epoch start).

    A device chooses replay or download by timing itself (`client.catchup`); on a tiny test
    model both cost microseconds, so the measured choice flips with machine load. Tests of
    the cost rule itself live in tests/client/test_catchup.py and leave the meters alone."""
    device.meters.replay = _FixedRate(1e15)  # element-seeds per second
    device.meters.load = _FixedRate(1.0)  # snapshot bytes per second
    return device


class FakeGrid:
    """The one call the seedfed strategy makes of a Flower Grid (in-process tests)."""

    def __init__(self, nodes: tuple[int, ...]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def deliver(app: Any, contexts: dict[int, Any], messages: list[Any],
            before_each: Callable[[], None] | None = None) -> list[Any]:
    """Run a ClientApp on each message (in process); an exception becomes an error reply, as
    Flower's runtime does. `before_each` runs first for every message (e.g. a fresh process)."""
    from flwr.app import Error, Message

    replies = []
    for m in messages:
        if before_each is not None:
            before_each()
        try:
            replies.append(app(m, contexts[m.metadata.dst_node_id]))
        except Exception as e:  # noqa: BLE001 - mirrors Flower's catch-all
            replies.append(Message(Error(code=0, reason=f"{type(e).__name__}: {e}"),
                                   reply_to=m))
    return replies
