"""`seedfed ternarize`: distil a (tiny) fp32 sentence encoder into a ternary base.

The CI-sized base: a 2-layer hidden-32 BERT in the sentence-transformers layout, 96 sentences,
3 epochs of batch 16 (18 steps, a few seconds). The checks: the distillation lowers its loss,
the directory is a normal model directory a ternary task converts to exactly the distilled
ternary forward, the metadata holds the scores, and a second call with the same settings reuses
the directory instead of distilling again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from seedfed.client.data import tokenize
from seedfed.shared.model.classifier import MeanPoolClassifier
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.ternary import bitlinear_modules
from typer.testing import CliRunner

from seedfed import ternarize as tz
from seedfed.cli import app
from tests.fleet_helpers import make_tiny_sentence_bert, ternary_cls_spec, write_sentiment_tsv

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LABELS = ("it was bad", "it was good")
CONFIG = tz.TernarizeConfig(sentences=96, epochs=3, batch_size=16, max_len=16, lr=3e-3,
                            probe_train=100, eval_size=100)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ternarize")
    model = make_tiny_sentence_bert(root / "fp32")
    data = write_sentiment_tsv(root / "data.tsv", n=1400)
    losses: list[float] = []
    students: list[torch.nn.Module] = []
    distill = tz.distill

    def keep(*args: Any, **kwargs: Any) -> torch.nn.Module:
        students.append(distill(*args, **kwargs))
        return students[-1]

    tz.distill = keep  # type: ignore[assignment]
    try:
        meta = tz.ternarize(model, data, root / "base", CONFIG, LABELS,
                            on_step=lambda _s, _t, loss: losses.append(loss))
    finally:
        tz.distill = distill  # type: ignore[assignment]
    return {"root": root, "model": model, "data": data, "out": root / "base", "meta": meta,
            "losses": losses, "student": students[0]}


def test_distillation_lowers_the_embedding_loss(made: dict) -> None:
    losses = made["losses"]

    assert len(losses) == 3 * 6  # ceil(96 / 16) steps per epoch
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3


def test_the_base_is_a_model_directory_whose_ternary_task_is_the_distilled_model(
        made: dict) -> None:
    out: Path = made["out"]
    bundle = build_model(ternary_cls_spec(out), initialize=True)
    student = MeanPoolClassifier(made["student"], 2, normalize=True).eval()
    batch = tokenize(bundle.tokenizer, ["the film was good", "a grim day"], None, 16)

    with torch.no_grad():
        task = bundle.model.embed(**batch)  # type: ignore[operator]
        distilled = student.embed(**batch)

    # the task's conversion recomputes gamma = mean |W| from the saved latents: the gamma the
    # distillation ended on, so the task's ternary forward is the distilled model's, bit for bit
    assert (out / "modules.json").is_file() and (out / "model.safetensors").is_file()
    assert torch.equal(task, distilled)
    assert len(bitlinear_modules(bundle.model)) == 12


def test_the_metadata_holds_scores_of_fp32_undistilled_and_distilled(made: dict) -> None:
    meta = json.loads((made["out"] / tz.META_FILE).read_text())

    assert set(meta["accuracy"]) == {"fp32", "ternary_undistilled", "ternary_distilled"}
    for scores in meta["accuracy"].values():
        assert 0.0 <= scores["zero_shot"] <= 1.0 and 0.0 <= scores["linear_probe"] <= 1.0
    # the synthetic task is linearly separable from the words: the probe reads it
    assert meta["accuracy"]["fp32"]["linear_probe"] > 0.8
    assert meta["distill_seconds"] > 0 and meta["sentences"] == 96


def test_the_same_settings_reuse_the_base(made: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_distill(*_: object, **__: object) -> None:
        raise AssertionError("distilled again")

    monkeypatch.setattr(tz, "distill", no_distill)

    meta = tz.ensure_base(made["model"], made["data"], made["out"], CONFIG, LABELS)

    assert meta["key"] == made["meta"]["key"]


def test_the_cli_refuses_a_directory_without_mean_pooling(made: dict, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    result = CliRunner().invoke(app, ["ternarize", "--model", str(tmp_path), "--data",
                                      str(made["data"]), "--out", str(tmp_path / "o")])

    assert result.exit_code != 0 and "sentence-transformers" in result.output
