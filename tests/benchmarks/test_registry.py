"""The benchmark registry and `seedfed bench`: every benchmark module is listed and runnable by
name, arguments reach its own parser, and listing imports none of the benchmarks."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from seedfed.bench import registry

BENCH_DIR = Path(registry.__file__).parent
#: Modules of seedfed/bench that are not benchmarks: workers, shared setup, the registry,
#: the reporting helpers.
HELPERS = {"__init__", "registry", "report", "coordinator_process", "core_setup", "core_worker",
           "probes_worker", "sweep_data"}


def _has_main(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


def test_every_benchmark_module_is_registered_and_every_name_is_a_module() -> None:
    modules = {p.stem for p in BENCH_DIR.glob("*.py")} - HELPERS

    assert modules == set(registry.BENCHMARKS)
    assert all(_has_main(BENCH_DIR / f"{name}.py") for name in modules)


def test_load_rejects_an_unknown_name() -> None:
    with pytest.raises(KeyError):
        registry.load("no_such_benchmark")


def test_listing_has_one_line_per_benchmark() -> None:
    lines = registry.listing().splitlines()

    assert [line.split()[0] for line in lines] == list(registry.BENCHMARKS)


def seedfed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from seedfed.cli import app; app()", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_list_imports_no_benchmark_and_no_heavy_dependency() -> None:
    code = ("import sys\nfrom seedfed.cli import app\n"
            "try:\n    app(['bench', '--list'])\nexcept SystemExit:\n    pass\n"
            "heavy = ('torch', 'matplotlib', 'flwr', 'schemathesis', 'psycopg')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy\n"
            "             or (m.startswith('seedfed.bench.') and m != 'seedfed.bench.registry')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)

    assert proc.returncode == 0, proc.stderr[-2000:]
    *listing, imported = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in listing] == list(registry.BENCHMARKS)
    assert imported == "[]"


@pytest.mark.parametrize("name", ["catchup", "crash"])
def test_arguments_reach_the_benchmarks_own_parser(name: str) -> None:
    proc = seedfed("bench", name, "--help")

    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: seedfed bench {name} ")


def test_a_bad_argument_is_the_benchmarks_usage_error() -> None:
    proc = seedfed("bench", "core", "--repeats", "0")

    assert proc.returncode == 2
    assert "seedfed bench core: error: argument --repeats: must be >= 1" in proc.stderr


def test_the_module_runs_as_python_m(tmp_path: Path) -> None:
    out = tmp_path / "bytes.json"

    proc = subprocess.run([sys.executable, "-m", "seedfed.bench.flower_bytes", "--json",
                           str(out)], capture_output=True, text=True, timeout=300, check=False)

    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["rows"]
