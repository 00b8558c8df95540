"""CI-sized crash campaign: `seedfed bench crash` SIGKILLs a real coordinator twice under
uploads (once at a random moment, once right after a round reached its quorum, so inside the
close that follows), restarts it, and must find every accepted upload stored once, versions
contiguous and replay from v0 equal to every checksum. The full campaign (>= 100 kills per
backend) is `seedfed bench crash`; docs/reliability.md has its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_two_sigkills_on_sqlite_lose_nothing(tmp_path: Path) -> None:
    # Arrange: seed 1 draws one kill after quorum and one at a random moment
    out = tmp_path / "crash.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    # Act
    proc = subprocess.run(
        [sys.executable, "-c", "from seedfed.cli import app; app()", "bench", "crash",
         "--db", "sqlite", "--kills", "2", "--seed", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False, env=env)

    # Assert
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["kills"] == 2 and row["kill_kinds"] == {"random": 1, "at_close": 1}
    assert row["receipts"] > 0 and row["lost"] == 0 and row["duplicate_rows"] == 0
    assert row["versions"] >= 1 and row["replayed_ok"] == row["versions"]
    assert row["reaggregated_ok"] == row["versions"] and row["ok"], row["problems"]
