"""A tiny BERT classifier directory and a labelled TSV for the Flower and simulation tests.

The model is small enough that a device round takes milliseconds, so the Flower tests measure
the machinery (catch-up, wire, coordinator) rather than MiniLM's forward pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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
