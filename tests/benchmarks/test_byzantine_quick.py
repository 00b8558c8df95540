"""Smoke test of `seedfed bench byzantine` on synthetic features (no model, seconds): it writes
its JSON and PNG, the mean is steered by 20% Byzantine devices, the median (which weighs every
device the same) is not, and claims buy the median nothing. The MiniLM figures are the full
run's (docs/reliability.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from seedfed.bench import byzantine


def test_robust_rule_bounds_what_the_mean_does_not(tmp_path: Path) -> None:
    out, png = tmp_path / "byz.json", tmp_path / "byz.png"

    code = byzantine.main(["--synthetic", "--rounds", "30", "--fractions", "0.2",
                             "--attacks", "extreme", "inflated", "--rules", "mean", "mean_nk",
                             "median", "--json", str(out), "--png", str(png)])

    def final(rule: str, attack: str) -> dict[str, Any]:
        (row,) = [r for r in result["rows"] if r["rule"] == rule and r["attack"] == attack]
        return row  # type: ignore[no-any-return]

    result = json.loads(out.read_text())
    assert code == 0 and result["rows"] and png.stat().st_size > 0
    # extreme values steer the mean below where it started; the median keeps training
    mean, med = final("mean", "extreme"), final("median", "extreme")
    assert mean["val_loss"][-1] > mean["val_loss"][0] and mean["val_accuracy"][-1] < 0.6
    assert med["val_loss"][-1] < med["val_loss"][0]
    assert med["val_accuracy"][-1] > mean["val_accuracy"][-1] + 0.1 and med["target_met"]
    # 4 of 20 liars claiming 2**31 - 1 examples: with max_num_examples the only cap they buy
    # the mean (nearly all of its weight); capped at the median claim they hold a little more
    # than their count, and the median weighs them as exactly their count
    bought, capped = final("mean_nk", "inflated"), final("mean", "inflated")
    assert bought["liar_weight_share"] > 0.9 and bought["val_accuracy"][-1] < 0.6
    assert 0.2 < capped["liar_weight_share"] < 0.35
    assert capped["val_accuracy"][-1] > bought["val_accuracy"][-1] + 0.1
    assert final("median", "inflated")["liar_weight_share"] == pytest.approx(0.2)
