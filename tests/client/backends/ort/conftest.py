"""A tiny sentence-transformers model, its head-scope task and its ORT bundle, built once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from seedfed.shared.protocol.task import Hyper, TaskSpec

HEAD = {"patterns": ["classifier"]}


def make_sentence_model(path: Path) -> Path:
    """The tiny BERT of the fleet tests as a sentence-transformers directory (mean pooling,
    normalized), which loads as the recipe's MeanPoolClassifier."""
    from tests.fleet_helpers import make_tiny_bert

    make_tiny_bert(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


def head_spec(model: Path, **hyper: object) -> TaskSpec:
    settings = {"lr": 0.1, "eps": 1e-2, "steps": 3, "perturbations": 4, "batch_size": 8, **hyper}
    return TaskSpec(model_path=str(model), label_texts=("bad", "good"), scope="named",
                    scope_options=HEAD, hyper=Hyper(**settings),  # type: ignore[arg-type]
                    max_seq_len=16)


@pytest.fixture(scope="session")
def ort_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{model, data, bundle}: export runs once per session (tens of seconds with dynamo)."""
    import torch
    from seedfed.client.backends.ort.export import export_bundle

    from tests.fleet_helpers import write_sentiment_tsv

    root = tmp_path_factory.mktemp("ort")
    model = make_sentence_model(root / "model")
    data = write_sentiment_tsv(root / "data.tsv")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        export_bundle(head_spec(model), root / "bundle")
    finally:
        torch.set_num_threads(threads)
    return {"model": model, "data": data, "bundle": root / "bundle"}
