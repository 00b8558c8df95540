"""server/README.md and the service agree: every route the app serves is in the README's route
table (and nothing else is), every status the README's error paragraph names is one the error
table gives, and each documented case answers its status with the one error body whose `error`
names a type of that status."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from httpx import Response
from seedfed.server import errors as server_errors
from seedfed.server.app import create_app
from seedfed.shared.protocol import errors as shared_errors
from seedfed.shared.protocol.wire import RoundPlan, Upload, pack_binary

from tests.server.conftest import make_settings, tiny_spec
from tests.server.test_api import ADMIN, bearer, enroll, new_task

README = Path(__file__).resolve().parents[2] / "server" / "README.md"
PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
LIMIT = 16384


@dataclass
class World:
    client: TestClient
    task: str  # quorum 10, round 1 open, `device` uploaded once
    plan: RoundPlan
    device: str
    empty_task: str  # round 1 open, no upload
    small_task: str  # its join token enrolled the one device it allows
    small_join: str
    foreign: str  # a device token of `empty_task`


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("documented")
    settings = make_settings(f"sqlite:///{tmp / 'c.db'}", tmp / "store", max_body_bytes=LIMIT,
                             auto_open_rounds=False)
    spec = tiny_spec(tiny_bert)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        task, join = new_task(client, spec, quorum=10)
        empty, empty_join = new_task(client, spec, quorum=10)
        small, small_join = new_task(client, spec, quorum=10, max_devices_per_token=1)
        enroll(client, small, small_join)
        device = enroll(client, task, join)[1]
        foreign = enroll(client, empty, empty_join)[1]
        plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task}/rounds",
                                                    headers=ADMIN).json())
        client.post(f"/v1/tasks/{empty}/rounds", headers=ADMIN)
        first = Upload.build(plan, np.zeros((plan.steps, plan.perturbations)), 3, 0.5)
        assert client.post(f"/v1/tasks/{task}/rounds/1/uploads", headers=bearer(device),
                           content=first.model_dump_json()).status_code == 200
        yield World(client, task, plan, device, empty, small, small_join, foreign)


JSON = {"Content-Type": "application/json"}


def _upload(w: World, body: bytes | str, **headers: str) -> Response:
    return w.client.post(f"/v1/tasks/{w.task}/rounds/1/uploads", content=body,
                         headers={**bearer(w.device), **JSON, **headers})


def _binary(w: World, data: bytes, **headers: str) -> Response:
    return _upload(w, data, **{"Content-Type": "application/octet-stream",
                               "X-Seedfed-Version": "0", "X-Seedfed-Num-Examples": "3",
                               "X-Seedfed-Loss": "0.5", **headers})


def _g(w: World, value: float = 0.0) -> np.ndarray:
    return np.full((w.plan.steps, w.plan.perturbations), value, dtype=np.float32)


# (request, status, the `error` of the body)
CASES: dict[str, tuple[Callable[[World], Response], int, str]] = {
    "task body not JSON": (lambda w: w.client.post("/v1/tasks", content=b'{"spec": ',
                                                   headers={**ADMIN, **JSON}),
                           400, "MalformedRequestError"),
    "enrollment body not JSON": (lambda w: w.client.post(
        f"/v1/tasks/{w.task}/devices", content=b"{join_token", headers=JSON),
        400, "MalformedRequestError"),
    "join-token body not JSON": (lambda w: w.client.post(
        f"/v1/tasks/{w.task}/join-tokens", content=b"[", headers={**ADMIN, **JSON}),
        400, "MalformedRequestError"),
    "upload body not JSON": (lambda w: _upload(w, b'{"task_id": '), 400,
                             "MalformedRequestError"),
    "binary header not a number": (lambda w: _binary(w, pack_binary(_g(w)),
                                                     **{"X-Seedfed-Loss": "0,5"}),
                                   400, "MalformedRequestError"),
    "binary header missing": (lambda w: _upload(w, pack_binary(_g(w)), **{
        "Content-Type": "application/octet-stream"}), 400, "MalformedRequestError"),
    "upload content type": (lambda w: _upload(w, b"x", **{"Content-Type": "text/plain"}), 400,
                            "MalformedRequestError"),
    "no token": (lambda w: w.client.get(f"/v1/tasks/{w.task}"), 401, "AuthenticationError"),
    "wrong admin token": (lambda w: w.client.post(f"/v1/tasks/{w.task}/rounds",
                                                  headers=bearer(w.device)),
                          401, "AuthenticationError"),
    "unknown join token": (lambda w: w.client.post(f"/v1/tasks/{w.task}/devices",
                                                   json={"join_token": "guess"}),
                           401, "AuthenticationError"),
    "device of another task": (lambda w: w.client.get(f"/v1/tasks/{w.task}/log",
                                                      params={"since": 0},
                                                      headers=bearer(w.foreign)),
                               403, "PermissionDeniedError"),
    "join token at its limit": (lambda w: w.client.post(
        f"/v1/tasks/{w.small_task}/devices", json={"join_token": w.small_join}),
        403, "PermissionDeniedError"),
    "unknown task": (lambda w: w.client.get("/v1/tasks/nope", headers=ADMIN), 404,
                     "NotFoundError"),
    "unknown version": (lambda w: w.client.get(f"/v1/tasks/{w.task}/snapshots/7",
                                               headers=ADMIN), 404, "NotFoundError"),
    "no open round": (lambda w: w.client.get(f"/v1/tasks/{w.small_task}/rounds/current",
                                             headers=ADMIN), 404, "NotFoundError"),
    "unknown path": (lambda w: w.client.get("/v1/nothing-here"), 404, "HTTPException"),
    "method": (lambda w: w.client.delete("/v1/tasks", headers=ADMIN), 405, "HTTPException"),
    "different second upload": (lambda w: _upload(w, Upload.build(
        w.plan, _g(w, 1.0), 3, 0.5).model_dump_json()), 409, "DuplicateUploadError"),
    "close an empty round": (lambda w: w.client.post(f"/v1/tasks/{w.empty_task}/rounds/1/close",
                                                     headers=ADMIN), 409, "EmptyRoundError"),
    "stale version": (lambda w: _binary(w, pack_binary(_g(w)), **{"X-Seedfed-Version": "3"}),
                      409, "StaleVersionError"),
    "body above max_body_bytes": (lambda w: _upload(w, b" " * (LIMIT + 1)), 413,
                                  "PayloadTooLargeError"),
    "field of the wrong type": (lambda w: w.client.post("/v1/tasks", json={
        "spec": {}, "quorum": "3"}, headers=ADMIN), 422, "RequestValidationError"),
    "round out of range": (lambda w: w.client.post(f"/v1/tasks/{w.task}/rounds/{2**31}/close",
                                                   headers=ADMIN), 422,
                           "RequestValidationError"),
    "round mismatch": (lambda w: _upload(w, Upload.build(w.plan, _g(w), 3, 0.5).model_copy(
        update={"round": 2}).model_dump_json()), 422, "InvalidUploadError"),
    "metrics of a version the task never had": (lambda w: w.client.post(
        f"/v1/tasks/{w.task}/rounds/1/metrics", headers=bearer(w.device), json={
            "version": 5, "num_examples": 4, "shared_accuracy": 0.5}), 422,
        "InvalidMetricsError"),
    "bad task definition": (lambda w: w.client.post("/v1/tasks", json={
        "spec": {"model_path": "x", "format": "int3"}}, headers=ADMIN), 422,
        "InvalidTaskError"),
    "binary magic": (lambda w: _binary(w, b"SFS2" + pack_binary(_g(w))[4:]), 422,
                     "WireFormatError"),
    "NaN scalar": (lambda w: _binary(w, pack_binary(_g(w, float("nan")))), 422,
                   "NonFiniteScalarError"),
    "snapshot in a format the task does not publish": (lambda w: w.client.get(
        f"/v1/tasks/{w.task}/snapshots/0", params={"format": "int4"}, headers=ADMIN), 404,
        "FormatNotPublishedError"),
    "catch-up from beyond the current version": (lambda w: w.client.get(
        f"/v1/tasks/{w.task}/catchup", params={"from": 5}, headers=bearer(w.device)), 409,
        "VersionAheadError"),
    "log since beyond the current version": (lambda w: w.client.get(
        f"/v1/tasks/{w.task}/log", params={"since": 3}, headers=bearer(w.device)), 409,
        "VersionAheadError"),
    "abandon a round that never opened": (lambda w: w.client.post(
        f"/v1/tasks/{w.small_task}/rounds/4/abandon", json={"reason": "r"}, headers=ADMIN),
        404, "NotFoundError"),
    "abandon without a reason": (lambda w: w.client.post(
        f"/v1/tasks/{w.task}/rounds/1/abandon", json={"reason": " "}, headers=ADMIN),
        422, "RequestValidationError"),
}


def _error_class(name: str) -> type[BaseException] | None:
    return getattr(server_errors, name, None) or getattr(shared_errors, name, None)


@pytest.mark.parametrize("case", list(CASES))
def test_each_documented_case_answers_its_status_with_the_one_error_body(world: World,
                                                                         case: str) -> None:
    send, status, error = CASES[case]

    r = send(world)

    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) <= {"detail", "error", "errors"} and body["detail"], body
    assert body["error"] == error, body
    cls = _error_class(error)
    if cls is not None:  # a domain error: the one table gives it this status
        assert server_errors.status_of(cls("x")) == status
    if status == 401:
        assert r.headers["WWW-Authenticate"] == "Bearer"
    if error in ("RequestValidationError", "MalformedRequestError") and "errors" in body:
        assert all(set(i) == {"loc", "msg", "type"} for i in body["errors"])


def _readme() -> str:
    return README.read_text("utf-8")


def _norm(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path.split("?")[0].split("[")[0])


def test_the_route_table_is_the_routes_the_app_serves(tmp_path: Path) -> None:
    # Arrange
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "s"))
    served = {(m.upper(), _norm(p)) for p, ops in app.openapi()["paths"].items() for m in ops}
    table = [line for line in _readme().splitlines() if line.startswith("| `")]

    # Act
    documented = {(m, _norm(p)) for line in table
                  for m, p in re.findall(r"`(GET|POST|DELETE|PUT|PATCH) (/[^`\s]*)", line)}

    # Assert
    assert documented == served


def test_the_error_paragraph_names_exactly_the_statuses_the_service_gives() -> None:
    text = _readme()
    paragraph = text[text.index("Errors: every error answer"):text.index("On the upload path")]
    named = {int(s) for s in re.findall(r"(?<![\w.])([45]\d\d)(?!\w)", paragraph)}
    # the error table's statuses, plus routing's 405 (FastAPI's own, with the same body)
    assert named == set(server_errors.STATUS.values()) | {405}


# -- the error tables of server/README.md and docs/protocol.md section 8 -------------------------
#: Error names the app answers that are not exception classes of the service.
FRAMEWORK = {"RequestValidationError": {422}, "HTTPException": {404, 405}}


def _tables() -> dict[str, dict[int, set[str]]]:
    """Per document, status -> the `error` names its table gives that status."""
    readme = _readme()
    protocol = PROTOCOL.read_text("utf-8")
    sections = {"server/README.md": readme[readme.index("Errors: every error answer"):
                                           readme.index("On the upload path")],
                "docs/protocol.md": protocol[protocol.index("## 8. "):
                                             protocol.index("## 9. ")]}
    return {doc: {int(code): set(re.findall(r"`(\w+)`", names))
                  for code, names in re.findall(r"^\| (\d{3}) \| ([^|]*) \|", text, re.M)}
            for doc, text in sections.items()}


def _answered_types() -> set[str]:
    """Every error type the service answers with: the coordinator's errors (but their two
    abstract bases), the protocol errors the status table names, the framework's."""
    own = {c.__name__ for c in vars(server_errors).values() if isinstance(c, type)
           and issubclass(c, server_errors.CoordinatorError)
           and c not in (server_errors.CoordinatorError, server_errors.UnavailableError)}
    shared = {c.__name__ for c in server_errors.STATUS
              if c.__module__ == shared_errors.__name__ and c is not shared_errors.SeedfedError}
    return own | shared | set(FRAMEWORK)


@pytest.mark.parametrize("doc", ["server/README.md", "docs/protocol.md"])
def test_each_error_table_gives_every_error_the_status_the_service_gives(doc: str) -> None:
    table = _tables()[doc]

    wrong = {(status, name) for status, names in table.items() for name in names
             if status not in FRAMEWORK.get(name, set()) and (
                 _error_class(name) is None
                 or server_errors.status_of(_error_class(name)("x")) != status)}  # type: ignore[misc]

    assert table and wrong == set(), f"{doc}: {sorted(wrong)}"


@pytest.mark.parametrize("doc", ["server/README.md", "docs/protocol.md"])
def test_each_error_table_names_every_error_type_the_service_answers(doc: str) -> None:
    named = set().union(*_tables()[doc].values())

    assert named == _answered_types(), (f"missing: {_answered_types() - named}, "
                                        f"unknown: {named - _answered_types()}")


@pytest.mark.parametrize("doc", ["server/README.md", "docs/protocol.md"])
def test_each_documented_case_is_a_row_of_each_error_table(doc: str) -> None:
    table = _tables()[doc]

    missing = {case for case, (_send, status, error) in CASES.items()
               if error not in table.get(status, set())}

    assert missing == set()
