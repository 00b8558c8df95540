"""Smoke test of benchmarks/byzantine.py on synthetic features (no model, seconds): it writes
its JSON and PNG, the plain weighted mean is steered by 20% Byzantine devices, the uniform
median is not. The MiniLM figures are the full run's (docs/reliability.md)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts_loader import load_script


@pytest.fixture(scope="module")
def byzantine() -> ModuleType:
    return load_script("benchmarks/byzantine.py", "bench_byzantine")


def test_robust_rule_bounds_what_the_mean_does_not(byzantine: ModuleType,
                                                   tmp_path: Path) -> None:
    out, png = tmp_path / "byz.json", tmp_path / "byz.png"

    result = byzantine.main(["--synthetic", "--rounds", "30", "--fractions", "0.2",
                             "--attacks", "extreme", "inflated", "--rules", "mean",
                             "median_uniform", "--json", str(out), "--png", str(png)])

    def final(rule: str, attack: str) -> tuple[float, float, float]:
        (row,) = [r for r in result["rows"] if r["rule"] == rule and r["attack"] == attack]
        return row["val_accuracy"][-1], row["val_loss"][-1], row["val_loss"][0]

    assert json.loads(out.read_text())["rows"] and png.stat().st_size > 0
    for attack in ("extreme", "inflated"):
        acc_mean, loss_mean, loss0 = final("mean", attack)
        acc_med, loss_med, _ = final("median_uniform", attack)
        assert loss_mean > loss0 and acc_mean < 0.6  # steered: worse than where it started
        assert loss_med < loss0 and acc_med > acc_mean + 0.1  # still training
