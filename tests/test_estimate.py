"""`seedfed.estimate`: the run's plans, and a ternary task's duration measured per plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from seedfed.client.device_data import DeviceData, load_device_examples

from seedfed.estimate import DurationEstimate, estimate_duration, plan_kinds
from seedfed.simulate import SimulationConfig, task_spec_for
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
                                             + estimate.eval_s)


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


def test_a_cached_head_estimates_its_one_off_encoding_apart(tmp_path: Path) -> None:
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=300))
    config = SimulationConfig(out=tmp_path / "run", data=data,
                              model=str(make_tiny_sentence_bert(tmp_path / "m")))
    spec = task_spec_for(config, ("bad", "good"))
    train = load_device_examples(DeviceData(source=data))[0]

    estimate = estimate_duration(spec, train, train, rounds=2, per_round=2, parallel=2,
                                 evals=1, repeats=1, sentences=100_000)

    assert estimate.encode_s > 0
    assert estimate.seconds == pytest.approx(estimate.step_s * estimate.device_steps / 2
                                             + estimate.eval_s)  # encoding is not in it
