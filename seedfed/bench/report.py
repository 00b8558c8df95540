"""How a benchmark reports: its JSON result file and its fixed-width text tables."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def write_json(path: Path, result: Any, *, indent: int = 2, sort_keys: bool = False,
               newline: bool = True, default: Callable[[Any], Any] | None = None) -> None:
    """Write a benchmark's `result` to `path` as JSON (`json.dumps` with `indent`,
    `sort_keys` and `default`; a final newline when `newline`), making its folder first.
    Each benchmark keeps its own layout, so its committed result files diff line by line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=indent, sort_keys=sort_keys, default=default)
    path.write_text(text + "\n" if newline else text)


def text_table(columns: Sequence[tuple[str, str, str]],
               rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A header line, then one line per row: each column is (header, row key, format spec),
    cells run together (the widths keep them apart) and a header takes its column's
    alignment and width, e.g. ("p99 ms", "p99_ms", ">9.1f")."""
    header = ""
    for title, _, spec in columns:
        match = re.match(r"[<>^]?\d*", spec)
        header += format(title, match.group() if match else "")
    return [header] + ["".join(format(row[key], spec) for _, key, spec in columns)
                       for row in rows]
