"""The API layer reaches the runtime's state only through service functions."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "server" / "api"
#: Runtime attributes only the service layer may touch (caches, metrics, storage).
OWNED = {"tokens", "rounds", "close_failures", "metrics", "engine", "store", "faults",
         "state_lock", "transaction"}


def test_routes_and_dependencies_use_no_runtime_cache_directly() -> None:
    # Arrange
    found: list[str] = []

    # Act
    for path in sorted(API.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in OWNED and \
                    isinstance(node.value, ast.Name) and node.value.id == "rt":
                found.append(f"{path.relative_to(API.parent)}:{node.lineno}: rt.{node.attr}")

    # Assert
    assert found == []
