"""Every command's failure paths against a real coordinator: each ends in one `error:` line on
stderr with a non-zero status, no traceback, and no token (admin, join, device) anywhere in the
output; a device that fails its checks enrolls nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from click.testing import Result
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import META_FILE, DeviceConfig, HttpDevice
from seedfed.server.app import create_app
from seedfed.shared.protocol.task import Hyper, TaskSpec
from typer.testing import CliRunner

from seedfed.admin_client import AdminClient
from seedfed.cli import app
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv
from tests.live_coordinator import ADMIN_TOKEN, live_settings, serve

#: Wrong tokens are secrets too: a near miss of the real one must not be echoed.
WRONG_TOKEN = "wrong-admin-" + "z" * 20
WRONG_JOIN = "wrong-join-" + "w" * 20


@dataclass
class World:
    url: str
    task: str
    join: str
    model: Path
    data: Path
    tmp: Path
    admin: AdminClient

    def enrolled(self) -> int:
        stats = self.admin.request("GET", f"/v1/tasks/{self.task}/stats").json()
        return len(stats["devices"])

    def file(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.write_text(text, encoding="utf-8")
        return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("secrets")
    model = make_tiny_bert(tmp / "bert")
    data = write_sentiment_tsv(tmp / "data.tsv", n=120)
    with serve(create_app(live_settings(tmp))) as url, httpx.Client(base_url=url) as http:
        admin = AdminClient(http, ADMIN_TOKEN)
        spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"), max_seq_len=16,
                        hyper=Hyper(lr=1e-3, eps=1e-2, steps=1, perturbations=2, batch_size=4))
        created = admin.create_task(spec.to_dict(), quorum=50)
        yield World(url, created["task_id"], created["join_token"], model, data, tmp, admin)


def secrets_of(world: World, *more: str) -> list[str]:
    return [ADMIN_TOKEN, world.join, WRONG_TOKEN, WRONG_JOIN, *more]


def assert_one_clean_error(output: str, stderr: str, code: int, secrets: list[str]) -> str:
    """The failure is one `error:` line on stderr, without traceback or secret; its text."""
    assert code != 0, output
    assert "Traceback" not in output and "locals" not in output, output
    for secret in secrets:
        assert secret not in output, f"a token leaked: {output}"
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, list(args), env={"SEEDFED_ADMIN_TOKEN": "", **(env or {})})


def device_args(world: World, state: str, *extra: str, data: Path | None = None) -> list[str]:
    return ["device", "--url", world.url, "--task", world.task, "--state-dir",
            str(world.tmp / state), "--model", str(world.model), "--data",
            str(data or world.data), *extra]


# -- the device: checked before it enrolls -------------------------------------------------------
@pytest.mark.parametrize("case, content, needle", [
    ("csv", "label,sentence\n0,bad film\n", "comma-separated"),
    ("empty", "", "empty"),
    ("header only", "label\tsentence\n", "no labelled examples"),
    ("no header", "0\tbad film\n1\tgood film\n", "no header line"),
    ("other label words", "label\tsentence\nneg\tbad film\npos\tgood film\n",
     "label 'neg' is not"),
    ("label out of range", "label\tsentence\n0\tbad film\n7\tgood film\n",
     "outside the task's 2 labels"),
    ("bad JSON line", '{"label": 0, "text": "ok"}\n{"label": 1,\n', ":2: not JSON"),
])
def test_a_device_with_bad_data_stops_in_one_line_and_enrolls_nothing(
        world: World, case: str, content: str, needle: str) -> None:
    path = world.file(f"{case.replace(' ', '_')}.{'jsonl' if 'JSON' in case else 'tsv'}",
                      content)
    before = world.enrolled()

    r = cli(*device_args(world, f"d-{case}", "--join-token", world.join, data=path))

    line = assert_one_clean_error(r.output, r.stderr, r.exit_code, secrets_of(world))
    assert needle in line and str(path) in line
    assert world.enrolled() == before
    assert not (world.tmp / f"d-{case}").exists()  # no state directory left behind


@pytest.mark.parametrize("case", ["missing model", "no config", "broken config"])
def test_a_device_without_a_usable_model_stops_and_enrolls_nothing(world: World,
                                                                   case: str) -> None:
    model = world.tmp / case.replace(" ", "_")
    if case != "missing model":
        model.mkdir(exist_ok=True)
        (model / ("config.json" if case == "broken config" else "notes.txt")).write_text("{not")
    args = device_args(world, f"m-{case}", "--join-token", world.join)
    args[args.index("--model") + 1] = str(model)
    before = world.enrolled()

    r = cli(*args)

    line = assert_one_clean_error(r.output, r.stderr, r.exit_code, secrets_of(world))
    assert str(model) in line and "--model" in line
    assert world.enrolled() == before


@pytest.mark.parametrize("case", ["wrong join token", "unknown task", "unreachable", "not http"])
def test_a_device_that_cannot_reach_its_task_stops_and_enrolls_nothing(world: World,
                                                                       case: str) -> None:
    args = device_args(world, f"c-{case}", "--join-token",
                       WRONG_JOIN if case == "wrong join token" else world.join)
    if case == "unknown task":
        args[args.index("--task") + 1] = "no-such-task"
    if case in ("unreachable", "not http"):
        args[args.index("--url") + 1] = ("http://127.0.0.1:1" if case == "unreachable"
                                         else "ftp://127.0.0.1")
    before = world.enrolled()

    r = cli(*args)

    line = assert_one_clean_error(r.output, r.stderr, r.exit_code, secrets_of(world))
    # a join token is a task's: for an unknown task the coordinator refuses it (401, not 404)
    assert {"wrong join token": "refused the join token", "unknown task": "--task",
            "unreachable": "cannot reach the coordinator at http://127.0.0.1:1",
            "not http": "--url"}[case] in line
    assert world.enrolled() == before


def test_a_revoked_device_is_told_so_without_any_token(world: World) -> None:
    # Arrange: a device enrolled (its token in its state directory), then revoked
    state = world.tmp / "revoked"
    dev = HttpDevice(DeviceConfig(url=world.url, task_id=world.task, join_token=world.join,
                                  state_dir=state, model=str(world.model),
                                  data=DeviceData(source=str(world.data))))
    device_id = dev.enroll()
    device_token = json.loads((state / META_FILE).read_text())["token"]
    world.admin.revoke_device(world.task, device_id)

    # Act
    r = cli(*device_args(world, "revoked", "--join-token", world.join))

    # Assert
    line = assert_one_clean_error(r.output, r.stderr, r.exit_code,
                                  secrets_of(world, device_token))
    assert "refused this device's token" in line and "--state-dir" in line


def test_label_words_of_the_task_are_read_as_its_labels(world: World) -> None:
    words = world.file("words.tsv", "label\tsentence\n" + "".join(
        f"{'Good' if i % 2 else 'bad.'}\tsentence number {i}\n" for i in range(60)))
    dev = HttpDevice(DeviceConfig(url=world.url, task_id=world.task, join_token=world.join,
                                  state_dir=world.tmp / "words", model=str(world.model),
                                  data=DeviceData(source=str(words))))

    dev.prepare()

    assert set(dev.examples().labels.tolist()) == {0, 1}
    assert "token" not in dev.meta  # checked, not enrolled


# -- the operator's commands, protocol check ------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (("task", "list", "--admin-token", WRONG_TOKEN), "401 AuthenticationError"),
    (("task", "show", "no-such-task", "--admin-token", ADMIN_TOKEN), "404 NotFoundError"),
    (("devices", "revoke", "TASK", "nobody", "--admin-token", ADMIN_TOKEN), "404"),
    (("round", "close", "TASK", "--round", "99", "--admin-token", ADMIN_TOKEN), "round"),
    (("task", "list"), "--admin-token"),
    (("task", "create", "--model", "/no/such/model", "--admin-token", ADMIN_TOKEN), "model"),
])
def test_operator_commands_fail_in_one_line(world: World, args: tuple[str, ...],
                                            needle: str) -> None:
    argv = [a.replace("TASK", world.task) for a in args] + ["--url", world.url]

    r = cli(*argv)

    assert needle in assert_one_clean_error(r.output, r.stderr, r.exit_code, secrets_of(world))


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "not-a-url"])
def test_protocol_check_of_an_unreachable_coordinator_is_one_line(world: World,
                                                                  url: str) -> None:
    r = cli("protocol", "check", "--url", url, "--admin-token", ADMIN_TOKEN)

    line = assert_one_clean_error(r.output, r.stderr, r.exit_code, secrets_of(world))
    assert "cannot reach the coordinator" in line


# -- the coordinator: what stops a start -----------------------------------------------------------
def test_coordinator_start_failures_name_the_option(world: World) -> None:
    db_password = "pw-" + "k" * 16
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    sqlite = f"sqlite:///{world.tmp / 'start.db'}"
    try:
        cases = {
            "--db": cli("coordinator", "--db", f"postgresql+psycopg://u:{db_password}@127.0.0.1"
                        ":1/x", "--port", "0", "--store", str(world.tmp / "s1")),
            "--db ": cli("coordinator", "--db", "not a url", "--port", "0"),
            "--admin-token": cli("coordinator", "--production", "--admin-token", "tiny-tok1",
                                 "--db", sqlite),
            "--port": cli("coordinator", "--port", port, "--db", sqlite),
            "--tls-cert": cli("coordinator", "--tls-cert", "/no/cert.pem", "--tls-key",
                              "/no/key.pem", "--db", sqlite),
        }
    finally:
        busy.close()

    for option, r in cases.items():
        line = assert_one_clean_error(r.output, r.stderr, r.exit_code,
                                      secrets_of(world, db_password, "tiny-tok1"))
        assert option.strip() in line, line


# -- simulate, evaluate, ternarize, ort-export: bad input before any work -----------------------
def test_data_and_model_commands_fail_in_one_line(world: World) -> None:
    csv = world.file("bad.csv", "label,sentence\n0,x\n")
    one_label = world.file("one_label.tsv", "label\tsentence\n" + "".join(
        f"0\tsentence {i}\n" for i in range(40)))
    spec = world.file("task.json", json.dumps(TaskSpec(model_path=str(world.model)).to_dict()))
    out = world.tmp / "out"
    cases = {
        "comma-separated": cli("simulate", "--data", str(csv), "--out", str(out / "a")),
        "one label": cli("simulate", "--data", str(one_label), "--out", str(out / "b")),
        "--set db": cli("simulate", "--data", str(world.data), "--set", "db=nonsense", "--out",
                    str(out / "c")),
        "not a task definition": cli("evaluate", "--data", str(world.data), "--task",
                       str(world.file("t.json", "{not json"))),
        "no labelled data file": cli("evaluate", "--data", str(world.tmp / "nope.tsv"),
                                     "--task", str(spec)),
        "comma-separated ": cli("ternarize", "--data", str(csv), "--out", str(out / "t")),
        "no such": cli("ort-export", "--task", str(world.tmp / "nope.json"), "--out",
                       str(out / "o")),
    }

    for needle, r in cases.items():
        line = assert_one_clean_error(r.output, r.stderr, r.exit_code, secrets_of(world))
        assert needle.strip().lower() in line.lower(), line


# -- the real entry point, as a user runs it ----------------------------------------------------
def test_the_installed_command_fails_in_one_line_without_traceback(world: World) -> None:
    env = {**os.environ, "SEEDFED_JOIN_TOKEN": world.join, "SEEDFED_ADMIN_TOKEN": ADMIN_TOKEN}
    script = Path(sys.executable).parent / "seedfed"
    runs = [
        [str(script), "device", "--url", "http://127.0.0.1:1", "--task", world.task, "--data",
         str(world.data), "--state-dir", str(world.tmp / "sub")],
        [str(script), "task", "list", "--url", world.url, "--admin-token", WRONG_TOKEN],
    ]

    for argv in runs:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)

        assert_one_clean_error(p.stdout + p.stderr, p.stderr, p.returncode, secrets_of(world))
