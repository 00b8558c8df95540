"""Smoke test of `seedfed bench accuracy` on a tiny BERT and a generated sentiment file: every
method runs (the federated ZO one through `seedfed simulate`'s in-process engine, the first-order
references on the simulated devices' own partitions) and the JSON, table and PNG come out with
counts that follow from the settings. The MiniLM figures are the full run's (docs/accuracy.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seedfed.bench import accuracy as bench
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_every_method_runs_and_reports_its_budget(tmp_path: Path) -> None:
    model = make_tiny_bert(tmp_path / "model")
    data = write_sentiment_tsv(tmp_path / "data.tsv", n=600)
    out = tmp_path / "acc.json"
    methods = "zero_shot,fo_full,fedavg_fo_lora,fed_zo_head"  # probe: MiniLM (mean pooling) only

    code = bench.main(["--data", str(data), "--model", str(model), "--methods", methods,
                         "--devices", "3", "--pool", "0", "--test-size", "40", "--rounds", "2",
                         "--eval-every", "1", "--fedavg-rounds", "1", "--fedavg-steps", "1",
                         "--out", str(out)])

    result = json.loads(out.read_text())
    assert code == 0 and result["split"] == "test"
    assert set(result["methods"]) == set(methods.split(","))
    fed = result["methods"]["fed_zo_head"]
    hyper = fed["extra"]["hyper"]
    calls = 2 * 3 * 2 * hyper["steps"] * hyper["perturbations"]  # rounds x devices x 2P x steps
    assert fed["model_calls"] == calls
    assert fed["example_forwards"] == calls * hyper["batch_size"]
    assert [p["round"] for p in fed["points"]] == [0, 1, 2]
    assert all(0 <= m["final_accuracy"] <= 1 for m in result["methods"].values())
    assert result["methods"]["fedavg_fo_lora"]["model_calls"] == 3  # 1 round x 3 devices x 1
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
