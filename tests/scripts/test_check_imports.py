"""scripts/check_imports.py: the tree has no import cycle, no forbidden import, no relative
import and no torch in the protocol layer, and the checker sees function-level imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_imports.py"


def _checker() -> ModuleType:
    return load_script("scripts/check_imports.py", "check_imports")


def test_the_tree_has_no_import_cycle_and_no_client_server_import() -> None:
    # Act
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)

    # Assert
    assert done.returncode == 0, done.stdout + done.stderr


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in ("seedfed", "shared", "client", "server"):
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "__init__.py").touch()
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    # Arrange
    root = _tree(tmp_path, {
        "server/app.py": "from seedfed.server.api import ingest\n",
        "server/api/__init__.py": "",
        "server/api/ingest.py": "def f():\n    from seedfed.server.app import x\n",
    })

    # Act
    found = _checker().problems(root)

    # Assert
    assert len(found) == 1 and "import cycle" in found[0]
    assert "seedfed.server.api.ingest -> seedfed.server.app" in found[0]


def test_a_client_importing_the_server_is_found(tmp_path: Path) -> None:
    # Arrange
    root = _tree(tmp_path, {"client/device.py": "import seedfed.server.runtime\n",
                            "server/runtime.py": ""})

    # Act
    found = _checker().problems(root)

    # Assert
    assert len(found) == 1 and "client must not import server" in found[0]


def test_a_relative_import_is_found(tmp_path: Path) -> None:
    # Arrange
    root = _tree(tmp_path, {"client/device.py": "from .sync import x\n", "client/sync.py": ""})

    # Act
    found = _checker().problems(root)

    # Assert
    assert found == ["client/device.py:1: relative import (write `from seedfed... import`)"]


def test_the_protocol_layer_importing_torch_or_the_model_layer_is_found(tmp_path: Path) -> None:
    # Arrange: one lazy torch import, one import of the model layer
    root = _tree(tmp_path, {
        "shared/protocol/__init__.py": "", "shared/model/__init__.py": "",
        "shared/model/stream.py": "",
        "shared/protocol/wire.py": "def f():\n    import torch.nn\n",
        "shared/protocol/task.py": "from seedfed.shared.model import stream\n",
    })

    # Act
    found = _checker().problems(root)

    # Assert
    assert any("wire.py:2" in p and "must run without torch" in p for p in found)
    assert any("protocol must not import model" in p for p in found)
    assert len(found) == 2
