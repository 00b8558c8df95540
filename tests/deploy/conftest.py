"""The `cluster` fixture: start processes on 127.0.0.1, each in its own process group with its
own log file, and kill every one of them (with their children) in teardown."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.procs import stop


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict]:
    for tool in ("flower-superlink", "flower-supernode", "flwr", "seedfed"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH (install seedfed[fleet])")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "HF_HUB_OFFLINE": "1", "FLWR_HOME": str(tmp_path / "flwr-home"),
           "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    procs: list[tuple[str, subprocess.Popen, str]] = []

    def start(name: str, args: list[str], extra: dict[str, str] | None = None
              ) -> subprocess.Popen:
        logf = str(tmp_path / f"{name}.log")
        with open(logf, "w") as out:
            p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                 env={**env, **(extra or {})}, start_new_session=True)
        procs.append((name, p, logf))
        return p

    try:
        yield {"tmp": tmp_path, "env": env, "start": start, "procs": procs}
    finally:
        stop([p for _, p, _ in reversed(procs)])
