"""scripts/check_imports.py: the tree has no import cycle and no client <-> server import, and
the checker sees function-level imports."""

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
        "server/app.py": "from .api import ingest\n",
        "server/api/__init__.py": "",
        "server/api/ingest.py": "def f():\n    from ..app import x\n",
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
