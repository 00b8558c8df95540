"""The benchmarks' reporting helpers: JSON result files and fixed-width text tables."""

from __future__ import annotations

import json
from pathlib import Path

from seedfed.bench.report import text_table, write_json


def test_write_json_makes_the_folder_and_keeps_the_layout_asked_for(tmp_path: Path) -> None:
    result = {"b": 1, "a": [1.5, 2]}
    path = tmp_path / "new" / "r.json"

    write_json(path, result, indent=1, sort_keys=True, newline=False)

    assert path.read_text() == json.dumps(result, indent=1, sort_keys=True)


def test_write_json_ends_with_a_newline_by_default(tmp_path: Path) -> None:
    path = tmp_path / "r.json"

    write_json(path, {"when": Path("x")}, default=str)

    assert path.read_text() == '{\n  "when": "x"\n}\n'


def test_text_table_aligns_headers_like_their_cells() -> None:
    columns = (("name", "name", "<6"), ("p99 ms", "p99", ">8.1f"), ("ok", "ok", ">4"))

    lines = text_table(columns, [{"name": "lite", "p99": 12.345, "ok": "yes"}])

    assert lines == ["name    p99 ms  ok", "lite      12.3 yes"]
