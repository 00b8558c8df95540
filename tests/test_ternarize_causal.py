"""`seedfed ternarize --model-kind causal_lm`: a (tiny) Llama made, pretrained and distilled.

The CI-sized base: a 300-token BPE, a 2-layer hidden-32 Llama, 96 sentences, 3 epochs of
batch 16 for each phase (18 + 18 steps, seconds). The checks: pretraining lowers the
next-token loss, the directory is a model directory a ternary causal task converts to exactly
the distilled ternary forward (coordinator side and a packed device), the metadata holds the
perplexities, and a second call with the same settings reuses the directory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from seedfed.client.data import tokenize
from seedfed.client.ternary import PackedTernary
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.ternary import bitlinear_modules
from seedfed.shared.protocol.task import Hyper, TaskSpec
from typer.testing import CliRunner

from seedfed import ternarize as tz
from seedfed.cli import app
from tests.fleet_helpers import write_sentiment_tsv

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = tz.CausalLMConfig(vocab=300, hidden=32, layers=2, heads=4, intermediate=64,
                           sentences=96, max_len=16, batch_size=16, pretrain_epochs=3,
                           distill_epochs=3, pretrain_lr=1e-2, distill_lr=3e-3, eval_size=100)
TEXTS = ["the film was good", "a grim day it"]


def causal_spec(model: Path) -> TaskSpec:
    return TaskSpec(model_path=str(model), model_kind="causal_lm", scope="ternary",
                    format="ternary", max_seq_len=16,
                    scope_options={"fraction": 0.05, "epoch_rounds": 2},
                    hyper=Hyper(lr=1e-2, eps=5e-3, steps=1, perturbations=2, batch_size=4))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ternarize_causal")
    data = write_sentiment_tsv(root / "data.tsv", n=1400)
    losses: dict[str, list[float]] = {"pretrain": [], "distill": []}
    students: list[torch.nn.Module] = []
    distill = tz.distill_causal

    def keep(*args: Any, **kwargs: Any) -> torch.nn.Module:
        students.append(distill(*args, **kwargs))
        return students[-1]

    tz.distill_causal = keep  # type: ignore[assignment]
    try:
        meta = tz.ternarize_causal(data, root / "base", CONFIG,
                                   on_step=lambda p, _s, _t, loss: losses[p].append(loss))
    finally:
        tz.distill_causal = distill  # type: ignore[assignment]
    return {"root": root, "data": data, "out": root / "base", "meta": meta, "losses": losses,
            "student": students[0]}


def _logits(model: torch.nn.Module, tokenizer: Any) -> torch.Tensor:
    batch = tokenize(tokenizer, TEXTS, None, 16)
    with torch.no_grad():
        return model(**batch).logits


def test_pretraining_and_distillation_run_their_steps_and_pretraining_learns(
        made: dict) -> None:
    pre, dis = made["losses"]["pretrain"], made["losses"]["distill"]

    assert len(pre) == len(dis) == 3 * 6  # ceil(96 / 16) steps per epoch, 3 epochs each
    assert sum(pre[-3:]) / 3 < 0.7 * sum(pre[:3]) / 3


def test_the_base_is_a_model_directory_whose_ternary_causal_task_is_the_student(
        made: dict) -> None:
    out: Path = made["out"]
    bundle = build_model(causal_spec(out), initialize=True)

    task = _logits(bundle.model, bundle.tokenizer)
    student = _logits(made["student"], bundle.tokenizer)

    # the task's conversion recomputes gamma = mean |W| from the saved latents: the gamma the
    # distillation ended on, so the task's ternary forward is the student's, bit for bit
    assert torch.equal(task, student)
    assert len(bitlinear_modules(bundle.model)) == 2 * 7  # q k v o gate up down per layer
    assert "lm_head" not in dict(bitlinear_modules(bundle.model))


def test_a_packed_device_from_the_coordinators_snapshot_runs_the_student(
        made: dict, tmp_path: Path) -> None:
    spec = causal_spec(made["out"])
    with Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                   store_dir=tmp_path / "store")) as coord:
        task = coord.create_task(spec)
        snap, chk = coord.snapshot(task, 0, "ternary")
    device = PackedTernary(spec)

    device.load_snapshot(snap, 0, chk)

    assert torch.equal(_logits(device.model, device.tokenizer),
                       _logits(made["student"], device.tokenizer))
    assert not any(m.weight is not None for _, m in bitlinear_modules(device.model))


def test_the_metadata_holds_perplexities_and_times(made: dict) -> None:
    meta = json.loads((made["out"] / tz.META_FILE).read_text())

    assert set(meta["perplexity"]) == {"fp32", "ternary_undistilled", "ternary_distilled"}
    for ppl in meta["perplexity"].values():
        assert 1.0 < ppl < CONFIG.vocab and math.isfinite(ppl)
    assert meta["model_kind"] == "causal_lm" and meta["sentences"] == 96
    assert meta["make_seconds"] >= meta["pretrain_seconds"] > 0


def test_the_same_settings_reuse_the_base(made: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pretrain(*_: object, **__: object) -> None:
        raise AssertionError("made again")

    monkeypatch.setattr(tz, "pretrain", no_pretrain)

    meta = tz.ensure_causal_base(made["data"], made["out"], CONFIG)

    assert meta["key"] == made["meta"]["key"]


def test_perplexity_pools_token_weighted(made: dict) -> None:
    student = made["student"]
    tok = build_model(causal_spec(made["out"]), initialize=False).tokenizer
    a, na = tz.next_token_nll(student, tok, TEXTS[:1], 16)
    b, nb = tz.next_token_nll(student, tok, TEXTS[1:], 16)

    both = tz.perplexity(student, tok, TEXTS, 16)

    assert both == pytest.approx(math.exp((a + b) / (na + nb)), rel=1e-5)


def test_the_cli_refuses_a_source_model_for_a_causal_base(made: dict, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["ternarize", "--model-kind", "causal_lm", "--model",
                                      str(tmp_path), "--data", str(made["data"]), "--out",
                                      str(tmp_path / "o")])

    assert result.exit_code != 0 and "builds its model" in result.output
    assert not (tmp_path / "o").exists()
