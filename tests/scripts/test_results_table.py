"""scripts/results_table.py: the README's results table is the one the benchmark results give,
every figure follows its JSON file, and `--check` / `--write` find and replace only the table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def table() -> ModuleType:
    return load_script("scripts/results_table.py", "results_table")


def _readme(path: Path, table_text: str) -> Path:
    path.write_text("# title\n\nbefore\n\n<!-- results:begin -->\n" + table_text
                    + "<!-- results:end -->\n\nafter\n")
    return path


def test_the_readme_table_is_the_one_the_results_give(table: ModuleType) -> None:
    # Act
    status = table.main(["--check", str(README)])

    # Assert
    assert status == 0, "run `python scripts/results_table.py --write README.md`"


def test_every_row_reads_its_figures_from_existing_result_files(table: ModuleType) -> None:
    # Arrange
    stems = {stem for row in table.ROWS for stem in row.sources}

    # Act
    missing = [s for s in stems if not (table.RESULTS / f"{s}.json").is_file()]

    # Assert
    assert not missing
    assert all(row.commands for row in table.ROWS)


def test_a_figure_follows_its_json_file(table: ModuleType, tmp_path: Path) -> None:
    # Arrange: the same results, with other accuracies for the SST-2 recipe's training runs
    results = tmp_path / "results"
    shutil.copytree(table.RESULTS, results, ignore=shutil.ignore_patterns("*.png"))
    path = results / "accuracy_head_cosine_p512.json"
    data = json.loads(path.read_text())
    data["repeats"]["fed_zo_head"]["accuracy"] = [0.5, 0.6, 0.7]
    path.write_text(json.dumps(data))

    # Act
    text = table.render(results)

    # Assert
    assert "**0.600** (mean of 3 training runs: 0.500, 0.600, 0.700)" in text
    assert text != table.render()


def test_check_fails_when_the_readme_table_differs(table: ModuleType, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Arrange
    good = table.render()
    readme = _readme(tmp_path / "README.md", good.replace("0.819", "0.900", 1))

    # Act
    status = table.main(["--check", str(readme)])

    # Assert
    assert status == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--write" in err and str(readme) in err


def test_write_replaces_the_table_and_nothing_else(table: ModuleType, tmp_path: Path) -> None:
    # Arrange
    readme = _readme(tmp_path / "README.md", "| old | table |\n")

    # Act
    status = table.main(["--write", str(readme)])

    # Assert
    assert status == 0
    assert readme.read_text() == _readme(tmp_path / "expected.md", table.render()).read_text()
    assert table.main(["--check", str(readme)]) == 0


@pytest.mark.parametrize("text", ["no markers\n", "<!-- results:end -->\n<!-- results:begin -->\n",
                                  "<!-- results:begin -->\n<!-- results:begin -->\n"
                                  "<!-- results:end -->\n"])
def test_a_readme_without_one_pair_of_markers_is_refused(
        table: ModuleType, tmp_path: Path, text: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Arrange
    readme = tmp_path / "README.md"
    readme.write_text(text)

    # Act
    status = table.main(["--write", str(readme)])

    # Assert
    assert status == 2
    assert "results:begin" in capsys.readouterr().err
    assert readme.read_text() == text


def test_a_missing_or_incomplete_result_file_is_named(table: ModuleType, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Arrange
    results = tmp_path / "results"
    shutil.copytree(table.RESULTS, results, ignore=shutil.ignore_patterns("*.png"))
    (results / "fuzz.json").unlink()

    # Act
    missing = table.main(["--results", str(results)])
    err_missing = capsys.readouterr().err
    shutil.copy(table.RESULTS / "fuzz.json", results / "fuzz.json")
    (results / "ort_device.json").write_text(json.dumps({"torch": {}}))
    incomplete = table.main(["--results", str(results)])
    err_incomplete = capsys.readouterr().err

    # Assert
    assert missing == 2 and "fuzz.json: missing" in err_missing
    assert incomplete == 2 and "ort_device.json" in err_incomplete
    assert "seedfed bench ort_device" in err_incomplete
    assert len(err_incomplete.strip().splitlines()) == 1
