"""Type-check seedfed as one package: mypy over a tree of links laid out as the import names.

The folders map to import names as setup.py maps them (shared/ -> seedfed.shared, ...), a
layout mypy cannot follow through the editable install's import hook: there every
`seedfed.*` import would be an unknown module, typed Any. Linked into one `seedfed/` tree,
each import resolves to its source file, so calls across packages are checked too.

    python scripts/typecheck.py          # mypy's exit status; its report on stdout
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: folder -> place under the linked `seedfed/` package, as in setup.py's ROOTS
SIDES = ("shared", "client", "server")


def link_tree(into: Path) -> Path:
    """`into/seedfed`, its entries links to seedfed/'s files and to the three side folders."""
    package = into / "seedfed"
    package.mkdir()
    for entry in (ROOT / "seedfed").iterdir():
        if entry.name not in SIDES and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for side in SIDES:
        (package / side).symlink_to(ROOT / side)
    return package


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="seedfed-typecheck-") as tmp:
        link_tree(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "seedfed"]
        return subprocess.run(cmd, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
