"""Load a repository script (benchmarks/*.py, scripts/*.py) as a module, for tests that call its
functions: the scripts are run as files, not installed as a package. The script's folder goes on
sys.path first, as when it runs as `python benchmarks/x.py` (benchmarks import their siblings)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str) -> ModuleType:
    """The module of the script at ROOT / `relative`, registered in sys.modules as `name`."""
    path = ROOT / relative
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
