"""`seedfed.estimate`: the run's plans, and a ternary task's duration measured per plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from seedfed.client.device_data import DeviceData, load_device_examples

from seedfed.estimate import DurationEstimate, estimate_duration, plan_kinds
from seedfed.features import SharedFeatures, prefill
from seedfed.simulate.config import SimulationConfig, task_spec_for
from tests.fleet_helpers import make_tiny_sentence_bert, ternary_cls_spec, write_sentiment_tsv


def test_a_task_with_one_hyper_plans_one_kind(tmp_path: Path) -> None:
    spec = ternary_cls_spec(tmp_path, epoch_rounds=5, selection="none", train_head=True)

    kinds = plan_kinds(spec, rounds=12)

    assert kinds == [(0, spec.hyper.steps, spec.hyper.perturbations, 12)]


def test_alternate_mask_epochs_plan_a_head_kind_and_a_latent_kind(tmp_path: Path) -> None:
    spec = ternary_cls_spec(tmp_path, epoch_rounds=5, train_head=True, alternate=True,
                            head_perturbations=64, head_steps=3)

    kinds = plan_kinds(spec, rounds=12)

    # versions 0-4 and 10-11 are head epochs (7 rounds), 5-9 the first latent epoch
    assert kinds == [(0, 3, 64, 7), (5, spec.hyper.steps, spec.hyper.perturbations, 5)]


def test_a_ternary_estimate_times_both_kinds_of_plan(tmp_path: Path) -> None:
    model = make_tiny_sentence_bert(tmp_path / "m")
    data = load_device_examples(DeviceData(source=str(write_sentiment_tsv(
        tmp_path / "d.tsv", n=60))))[0]
    spec = ternary_cls_spec(model, epoch_rounds=2, train_head=True, alternate=True,
                            head_perturbations=32)

    estimate = estimate_duration(spec, data, data, rounds=4, per_round=3, parallel=1, evals=1,
                                 repeats=1)

    assert estimate.device_steps == 4 * 3 * spec.hyper.steps
    assert estimate.step_s > 0 and estimate.eval_s > 0
    assert estimate.seconds == pytest.approx(estimate.step_s * estimate.device_steps
                                             + estimate.eval_s + estimate.startup_s)


def test_scoring_counts_the_first_encoding_once(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_tiny_sentence_bert(tmp_path / "m")
    data = load_device_examples(DeviceData(source=str(write_sentiment_tsv(
        tmp_path / "d.tsv", n=60))))[0]
    spec = ternary_cls_spec(model, epoch_rounds=5, selection="none", train_head=True)
    timings = iter([1.0, 0.25])  # the first scoring of the sample, then a repeat
    monkeypatch.setattr("seedfed.estimate._timed", lambda *_: next(timings))

    estimate = estimate_duration(spec, data, data, rounds=2, per_round=1, parallel=1, evals=5,
                                 repeats=1)

    scale = len(data) / min(len(data), 64)
    assert estimate.eval_s == pytest.approx((1.0 + 4 * 0.25) * scale)


def test_a_fast_step_is_described_in_milliseconds() -> None:
    text = DurationEstimate(step_s=0.0042, device_steps=6000, parallel=2, eval_s=3.0).describe()

    assert "4.2 ms x 6,000 device steps / 2 at once" in text


def test_every_part_of_the_run_is_in_the_total_and_named(tmp_path: Path) -> None:
    # Arrange: a head task with a personal part, sync phases and a cold feature cache
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=300))
    config = SimulationConfig(out=tmp_path / "run", data=data,
                              model=str(make_tiny_sentence_bert(tmp_path / "m")))
    spec = task_spec_for(config, ("bad", "good"))
    train = load_device_examples(DeviceData(source=data))[0]
    # Act
    estimate = estimate_duration(spec, train, train, rounds=2, per_round=2, parallel=2,
                                 evals=1, repeats=1, sentences=100_000, personal="residual",
                                 syncs=2, store=SharedFeatures(tmp_path / "cache"))
    # Assert
    parts = (estimate.encode_s, estimate.round_rest_s, estimate.sync_s, estimate.startup_s)
    assert all(p > 0 for p in parts) and estimate.uncached == 1.0
    assert estimate.seconds == pytest.approx(estimate.step_s * estimate.device_steps / 2
                                             + estimate.eval_s + sum(parts))
    assert "encoding the 100% of the fleet's sentences" in estimate.describe()


def test_the_description_names_each_part_of_a_second_or_more() -> None:
    text = DurationEstimate(step_s=0.15, device_steps=6000, parallel=2, eval_s=15.0,
                            round_rest_s=130.0, sync_s=0.4, startup_s=6.0).describe()

    assert text.startswith("expected duration ~10.0 min: one device step measured at 0.15 s")
    assert "+ 2.2 min catch-up, personal parts" in text and "+ 15 s held-out scoring" in text
    assert "sync phases" not in text  # 0.4 s: not worth a word


def test_sentences_the_feature_cache_holds_are_not_counted_again(tmp_path: Path) -> None:
    # Arrange: the cache holds the training split (as after an earlier run)
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=300))
    config = SimulationConfig(out=tmp_path / "run", data=data,
                              model=str(make_tiny_sentence_bert(tmp_path / "m")))
    spec = task_spec_for(config, ("bad", "good"))
    train = load_device_examples(DeviceData(source=data))[0]
    store = SharedFeatures(tmp_path / "cache")
    prefill(store, spec, train.texts, 1)
    # Act
    estimate = estimate_duration(spec, train, train, rounds=2, per_round=2, parallel=1,
                                 evals=0, repeats=1, sentences=100_000, store=store)
    # Assert
    assert estimate.uncached == 0.0 and estimate.encode_s == 0.0
    assert "encoding" not in estimate.describe()
