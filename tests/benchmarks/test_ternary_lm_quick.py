"""Smoke test of `seedfed.bench.ternary_lm` on a tiny causal-LM base: the devices' file holds only
sentences the base never saw, and a 2-round federated run through the real round code reaches
version 2 with finite perplexities on every device's held-out sentences. No accuracy claims."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from seedfed.client.device_data import dataset_splits

from seedfed import ternarize as tz
from seedfed.bench import ternary_lm as bench
from tests.fleet_helpers import write_sentiment_tsv

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = tz.CausalLMConfig(vocab=300, hidden=32, layers=2, heads=4, intermediate=64,
                           sentences=96, max_len=16, batch_size=32, pretrain_epochs=1,
                           distill_epochs=1, eval_size=20)


def test_the_fleet_gets_unseen_sentences_and_a_run_scores_before_and_after(
        tmp_path: Path) -> None:
    data = write_sentiment_tsv(tmp_path / "data.tsv", n=1400)
    meta = tz.ternarize_causal(data, tmp_path / "base", CONFIG)
    budget = bench.LMBudget(rounds=2, devices=2, per_round=2, perturbations=2, batch_size=4,
                            device_sentences=300, eval_size=20, lr=1e-2, eps=5e-3)
    train = dataset_splits(str(data)).train
    seen = {train.texts[i] for i in tz.training_order(len(train), 0)[:CONFIG.sentences]}

    device_file = bench.write_device_file(data, meta, budget.device_sentences,
                                          tmp_path / "devices.tsv")
    run = bench.one_run(tmp_path / "base", device_file, "threshold", 0, budget,
                        tmp_path / "run")

    fleet = dataset_splits(str(device_file))
    assert not seen & set(fleet.train.texts + fleet.test.texts)
    assert run.final_version == 2
    for scores in (run.before, run.after):
        assert len(scores["devices"]) == 2
        assert all(math.isfinite(p) and p > 1 for p in [*scores["devices"], scores["test"]])
