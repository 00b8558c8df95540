"""Schemathesis against a real coordinator process (CI-sized; `seedfed bench fuzz
--requests 30000` is the full run): no 5xx, no answer outside the OpenAPI document, no
traceback in the server's log. The negative controls show the checks are live: a doctored
document (a status left out, a field's type changed) makes the same fuzzing fail."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from seedfed.bench import fuzz

REQUESTS = 600  # ~30 s of fuzzing on the 2-core CI machine
LOG = "/v1/tasks/{task_id}/log"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any, Path]]:
    with fuzz.serve("sqlite") as served:
        yield served


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_contract_violation(
        served: tuple[str, Any, Path]) -> None:
    base, world, log = served

    result = fuzz.fuzz(base, world, requests=REQUESTS, seed=0)

    assert result["requests"] >= REQUESTS
    assert result["server_errors"] == 0, result["statuses"]
    assert result["violations"] == 0, result["violation_examples"]
    assert fuzz.tracebacks(log) == (0, None)
    # The fixed task id and tokens make the requests reach real data and pass auth.
    assert sum(v for k, v in result["statuses"].items() if k.startswith("2")) > 0


@pytest.mark.slow
@pytest.mark.parametrize("doctor", ["drop the 422", "ErrorBody.error is an integer"])
def test_the_checks_fail_on_a_document_that_lies(served: tuple[str, Any, Path],
                                                 doctor: str) -> None:
    base, world, _ = served
    doc = copy.deepcopy(httpx.get(base + "/openapi.json").json())
    if doctor == "drop the 422":
        del doc["paths"][LOG]["get"]["responses"]["422"]
    else:
        doc["components"]["schemas"]["ErrorBody"]["properties"]["error"] = {"type": "integer"}

    result = fuzz.fuzz(base, world, requests=40, seed=1, doc=doc, only={f"GET {LOG}"})

    assert result["violations"] > 0
