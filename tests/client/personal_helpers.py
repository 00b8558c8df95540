"""What the personal-part tests share: a tiny sentence BERT whose embeddings keep the words, a
device whose owner means the opposite of the labels, and a part trained on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from seedfed.client import data as data_mod
from seedfed.client.personal import PersonalConfig, PersonalPart
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.protocol.task import Hyper, TaskSpec

from tests.fleet_helpers import make_tiny_sentence_bert, write_sentiment_tsv


def _informative(path: Path) -> Path:
    """The tiny sentence BERT with unit LayerNorm gains and no biases: its random weights
    then keep which words a sentence holds, so a linear head can separate the sentiment
    words (with the helper's 0.05-scaled gains every sentence embeds almost alike)."""
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
    model.save_pretrained(path)
    return path


def build_assets(root: Path) -> tuple[Path, Path, Path]:
    """(model, another model, labelled TSV) under root."""
    return (_informative(make_tiny_sentence_bert(root / "model")),
            _informative(make_tiny_sentence_bert(root / "other", seed=1)),
            write_sentiment_tsv(root / "data.tsv", n=240))


def spec(model: Path) -> TaskSpec:
    return TaskSpec(model_path=str(model), label_texts=("bad", "good"), max_seq_len=16,
                    scope="named", scope_options={"patterns": ["classifier"]},
                    hyper=Hyper(lr=1e-2, eps=1e-2, steps=1, perturbations=2, batch_size=8))


def bundle_of(model: Path) -> ModelBundle:
    return build_model(spec(model), initialize=False)


def flipped(path: Path) -> tuple[data_mod.Examples, data_mod.Examples]:
    """A device whose owner means the opposite of the labels: the shared (prototype) head is
    wrong for it, so only a personal part can fit it."""
    ex = data_mod.load_labelled(path)
    ex = data_mod.Examples(ex.texts, 1 - ex.labels)
    return ex.subset(range(160)), ex.subset(range(160, 240))


def trained(bundle: ModelBundle, train: data_mod.Examples, rounds: int = 20,
             **options: object) -> PersonalPart:
    part = PersonalPart(PersonalConfig(**options), bundle, "task-a")  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        part.train(train, rng)
    return part
