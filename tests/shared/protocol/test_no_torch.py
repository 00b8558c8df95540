"""The protocol layer needs numpy alone: a fresh interpreter that refuses torch, transformers and
peft imports every module of `seedfed.shared.protocol` (found by walking the package, so a new
module is covered without a change here), checks the committed conformance file and the golden
stream vectors with the numpy implementation, and ends with none of those packages loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BLOCKED = ("torch", "transformers", "peft")

SCRIPT = r"""
import importlib, importlib.abc, json, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the protocol layer must not import it")
        return None

sys.meta_path.insert(0, Block())
import seedfed.shared.protocol as protocol

names = [m.name for m in pkgutil.walk_packages(protocol.__path__, protocol.__name__ + ".")]
for name in names:
    importlib.import_module(name)

from seedfed.shared.protocol.conformance import check_conformance
from seedfed.shared.protocol.vectors import check_kat, committed_vectors, compute_vectors

checked = check_conformance()
check_kat()
vectors_match = compute_vectors() == committed_vectors()
print(json.dumps({"modules": names, "checked": checked, "vectors_match": vectors_match,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
"""


def test_every_protocol_module_imports_and_checks_the_kit_without_torch() -> None:
    # Act
    run = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BLOCKED)], capture_output=True,
                         text=True, timeout=300)

    # Assert
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "seedfed.shared.protocol.conformance" in got["modules"]
    assert "seedfed.shared.protocol.wire" in got["modules"]
    assert "philox" in got["checked"] and "replay" in got["checked"]
    assert got["vectors_match"] is True
    assert got["loaded"] == []


def test_the_blocker_refuses_a_torch_import(tmp_path: Path) -> None:
    # Arrange: a module on the path that imports torch, imported the way the script imports
    (tmp_path / "uses_torch.py").write_text("import torch\n", encoding="utf-8")

    # Act
    run = subprocess.run([sys.executable, "-c", SCRIPT.split("import seedfed")[0] +
                          "import uses_torch\n", ",".join(BLOCKED)], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)

    # Assert
    assert run.returncode != 0
    assert "torch is blocked" in run.stderr
