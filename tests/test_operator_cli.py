"""The operator's commands (`seedfed task|round|devices`) against a real coordinator over HTTP:
a task created from the command line is the task the coordinator serves, a round opened and
closed from it commits a version, and `task show` reports the participation and loss."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from seedfed.server.app import create_app
from seedfed.shared.protocol.coordinator_client import CoordinatorClient, CoordinatorHttpError
from seedfed.shared.protocol.task import Hyper, TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.operator_cli import CreateOptions, build_spec
from tests.fleet_helpers import make_tiny_bert
from tests.live_coordinator import ADMIN_TOKEN, live_settings, serve

ENV = {"SEEDFED_ADMIN_TOKEN": ADMIN_TOKEN}


@dataclass
class Live:
    url: str
    model: Path


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("operator")
    model = make_tiny_bert(tmp / "bert")
    with serve(create_app(live_settings(tmp, auto_open_rounds=False))) as url:
        yield Live(url, model)


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args), env=ENV if env is None else env)
    return r.exit_code, r.stdout, r.stderr


def create(live: Live, *extra: str) -> dict[str, str]:
    code, out, err = cli("task", "create", "--url", live.url, "--model", str(live.model),
                         "--scope", "head", "--set", "steps=1", "--set", "perturbations=2",
                         "--set", "lr=0.5", "--set", "quorum=2", *extra, "--json")
    assert code == 0, err
    return dict(json.loads(out))


def test_task_create_makes_the_task_the_options_describe(live: Live) -> None:
    # Act
    created = create(live, "--set", "rule=median", "--name", "cli-made", "--label", "bad",
                     "--label", "good")

    # Assert: the coordinator serves exactly that definition
    with httpx.Client(base_url=live.url) as http:
        spec = TaskSpec.from_dict(CoordinatorClient(http, ADMIN_TOKEN).spec(created["task_id"]))
        status = CoordinatorClient(http, ADMIN_TOKEN).status(created["task_id"])
    assert created["join_token"] and created["version"] == 0
    assert (spec.scope, spec.scope_options.to_dict()) == ("named", {"patterns": ["classifier"]})
    assert (spec.hyper.lr, spec.hyper.steps, spec.hyper.perturbations) == (0.5, 1, 2)
    assert spec.aggregation.rule == "median" and spec.label_texts == ("bad", "good")
    assert (status.name, status.quorum, status.checksum) == ("cli-made", 2, created["checksum"])


def test_a_table_by_default_and_the_task_in_the_list(live: Live) -> None:
    def ids() -> set[str]:
        return {t["task_id"] for t in json.loads(cli("task", "list", "--url", live.url,
                                                     "--json")[1])}

    before = ids()
    code, out, _ = cli("task", "create", "--url", live.url, "--model", str(live.model),
                       "--scope", "head")
    (task_id,) = ids() - before
    _, table, _ = cli("task", "list", "--url", live.url)

    assert code == 0 and "join token" in out and task_id in out
    assert task_id in table


def test_a_round_opened_and_closed_from_the_cli_commits_a_version_show_reports(
        live: Live) -> None:
    # Arrange: a task and an enrolled device
    created = create(live)
    task_id = created["task_id"]
    with httpx.Client(base_url=live.url) as http:
        device_id, token = CoordinatorClient(http).enroll(task_id, created["join_token"])

        # Act: open from the CLI, one device uploads, close from the CLI
        code, out, err = cli("round", "open", task_id, "--url", live.url, "--json")
        assert code == 0, err
        plan = json.loads(out)
        CoordinatorClient(http, token).upload(task_id, plan["round"], plan["version"],
                                              np.full((1, 2), 0.25, dtype=np.float32), 12, 0.625)
        code, closed, err = cli("round", "close", task_id, "--url", live.url, "--json")
    _, shown, _ = cli("task", "show", task_id, "--url", live.url, "--json")
    _, table, _ = cli("task", "show", task_id, "--url", live.url)

    # Assert
    assert code == 0, err
    assert json.loads(closed)["base_version"] == 0
    info = json.loads(shown)
    assert info["version"] == 1 and info["round"] == 1
    assert [(r["round"], r["state"], r["participants"], r["loss"]) for r in info["rounds"]] == \
        [(1, "closed", 1, 0.625)]
    assert "0.6250" in table and device_id


def test_devices_list_and_revoke(live: Live) -> None:
    created = create(live)
    task_id = created["task_id"]
    with httpx.Client(base_url=live.url) as http:
        device_id, token = CoordinatorClient(http).enroll(task_id, created["join_token"])
        code, out, err = cli("devices", "revoke", task_id, device_id, "--url", live.url)
        assert code == 0, err
        with pytest.raises(CoordinatorHttpError) as refused:
            CoordinatorClient(http, token).status(task_id)
    _, listed, _ = cli("devices", "list", task_id, "--url", live.url, "--json")

    assert refused.value.status == 401 and refused.value.error == "AuthenticationError"
    assert [(d["device_id"], d["revoked_at"] is not None) for d in json.loads(listed)] == \
        [(device_id, True)]


def test_a_refusal_prints_the_coordinators_reason_and_exits_1(live: Live) -> None:
    code, _, err = cli("task", "show", "no-such-task", "--url", live.url)
    bad_token, _, err401 = cli("task", "list", "--url", live.url,
                               env={"SEEDFED_ADMIN_TOKEN": "wrong"})
    no_round, _, err_round = cli("round", "close", create(live)["task_id"], "--url", live.url)

    assert code == 1 and "404 NotFoundError" in err and "no-such-task" in err
    assert bad_token == 1 and "401 AuthenticationError" in err401
    assert no_round == 1 and "no open round" in err_round


def test_no_admin_token_is_a_usage_error(live: Live) -> None:
    code, _, err = cli("task", "list", "--url", live.url, env={"SEEDFED_ADMIN_TOKEN": ""})
    assert code == 2 and "SEEDFED_ADMIN_TOKEN" in err


# -- who opens rounds, abandoning one -------------------------------------------------------------
def test_task_create_sets_who_opens_rounds_and_show_says_what_the_task_waits_for(
        live: Live) -> None:
    # Act (this coordinator runs no automatic schedule: the auto task waits for an operator)
    auto = create(live, "--rounds", "4")["task_id"]
    manual = create(live, "--manual")["task_id"]
    _, auto_shown, _ = cli("task", "show", auto, "--url", live.url, "--json")
    _, manual_table, _ = cli("task", "show", manual, "--url", live.url)
    _, auto_table, _ = cli("task", "show", auto, "--url", live.url)

    # Assert
    info = json.loads(auto_shown)
    assert (info["schedule"], info["max_rounds"], info["waiting_for"]) == ("auto", 4, "operator")
    assert "automatic, back to back until v4" in auto_table and "auto_open_rounds" in auto_table
    assert "by hand" in manual_table and f"seedfed round open {manual}" in manual_table


def test_round_schedule_hands_rounds_back_and_changes_the_limit(live: Live) -> None:
    task_id = create(live, "--manual")["task_id"]

    code, out, err = cli("round", "schedule", task_id, "--auto", "--rounds", "3", "--url",
                         live.url, "--json")
    _, cleared, _ = cli("round", "schedule", task_id, "--no-limit", "--url", live.url, "--json")
    both, _, both_err = cli("round", "schedule", task_id, "--rounds", "2", "--no-limit",
                            "--url", live.url)

    assert code == 0, err
    assert (json.loads(out)["schedule"], json.loads(out)["max_rounds"]) == ("auto", 3)
    assert (json.loads(cleared)["schedule"], json.loads(cleared)["max_rounds"]) == ("auto", None)
    assert both == 2 and "--no-limit" in both_err


def test_round_open_takes_an_automatic_task_over_and_says_so(live: Live) -> None:
    task_id = create(live)["task_id"]

    code, _, err = cli("round", "open", task_id, "--url", live.url)
    _, shown, _ = cli("task", "show", task_id, "--url", live.url, "--json")

    assert code == 0 and "runs its rounds by hand" in err
    assert json.loads(shown)["schedule"] == "manual"


def test_round_abandon_ends_the_open_round_with_its_reason_shown(live: Live) -> None:
    # Arrange: a round with an upload
    created = create(live, "--manual")
    task_id = created["task_id"]
    with httpx.Client(base_url=live.url) as http:
        _, token = CoordinatorClient(http).enroll(task_id, created["join_token"])
        plan = json.loads(cli("round", "open", task_id, "--url", live.url, "--json")[1])
        CoordinatorClient(http, token).upload(task_id, plan["round"], plan["version"],
                                              np.full((1, 2), 0.25, dtype=np.float32), 12, 0.5)

    # Act: the round by default (the open one), then again
    code, out, err = cli("round", "abandon", task_id, "--reason", "labels were swapped",
                         "--url", live.url, "--json")
    again, _, again_err = cli("round", "abandon", task_id, "1", "--reason", "twice", "--url",
                              live.url)
    none_open, _, none_err = cli("round", "abandon", task_id, "--reason", "x", "--url",
                                 live.url)
    _, table, _ = cli("task", "show", task_id, "--url", live.url)
    _, shown, _ = cli("task", "show", task_id, "--url", live.url, "--json")

    # Assert
    assert code == 0, err
    done = json.loads(out)
    assert (done["round"], done["uploads"], done["version"]) == (1, 1, 0)
    assert again == 1 and "409 RoundClosedError" in again_err and "abandoned" in again_err
    assert none_open == 1 and "no open or aggregating round" in none_err
    info = json.loads(shown)
    assert (info["abandoned_round"], info["abandon_reason"]) == (1, "labels were swapped")
    assert info["rounds"][0]["state"] == "abandoned"
    assert "round 1: labels were swapped" in table


# -- build_spec, a pure function ------------------------------------------------------------------
def test_a_recipe_with_overrides_keeps_what_was_not_overridden(tmp_path: Path) -> None:
    spec, settings = build_spec(CreateOptions(
        recipe="preference", model=str(tmp_path),
        sets=("perturbations=8", "rule=trimmed_mean", "trim=0.2", "quorum=3")))

    assert settings.quorum == 3 and settings.devices_per_round is None
    assert spec.model_path == str(tmp_path) and spec.hyper.perturbations == 8
    assert spec.hyper.lr == 1.0 and spec.scope == "named"  # the recipe's
    assert (spec.aggregation.rule, spec.aggregation.trim) == ("trimmed_mean", 0.2)


def test_another_scope_starts_from_the_conservative_lr_and_a_spec_file_is_a_base(
        tmp_path: Path) -> None:
    lora, _ = build_spec(CreateOptions(recipe="preference", model=str(tmp_path), scope="lora"))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(lora.to_dict()))
    from_file, _ = build_spec(CreateOptions(recipe=None, spec_file=path, fmt="fp16"))

    assert (lora.scope, lora.hyper.lr, lora.hyper.eps) == ("lora", Hyper().lr, Hyper().eps)
    assert from_file.scope == "lora" and from_file.format == "fp16"


def test_an_lr_schedule_from_the_command_line_and_none_on_another_scope(
        tmp_path: Path) -> None:
    scheduled, _ = build_spec(CreateOptions(recipe="preference", model=str(tmp_path),
                                            sets=("decay_rounds=50", "lr_final_ratio=0.2")))
    lora, _ = build_spec(CreateOptions(recipe="sst2", model=str(tmp_path), scope="lora"))

    assert (scheduled.hyper.decay_rounds, scheduled.hyper.lr_final_ratio) == (50, 0.2)
    assert scheduled.hyper.lr_of_round(50) == pytest.approx(0.2 * scheduled.hyper.lr)
    assert lora.hyper.decay_rounds is None  # the sst2 recipe's schedule was the head's


def test_invalid_options_are_refused_before_any_request(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no recipe 'imagenet'; recipes: tastes"):
        CreateOptions(recipe="imagenet")
    with pytest.raises(ValueError, match="--set rule: expected one of mean"):
        build_spec(CreateOptions(recipe=None, model=str(tmp_path), sets=("rule=mode",)))
    with pytest.raises(ValueError, match="no key 'learning_rate'; keys: "):
        build_spec(CreateOptions(recipe=None, model=str(tmp_path),
                                 sets=("learning_rate=1",)))
    code, _, err = cli("task", "create", "--url", "http://127.0.0.1:9", "--model",
                       str(tmp_path), "--set", "lr=-1")
    recipe_as_scope, _, scope_err = cli("task", "create", "--url", "http://127.0.0.1:9",
                                        "--scope", "tastes")
    assert code == 2 and "hyper.lr must be in" in err
    assert recipe_as_scope == 2 and "--recipe tastes" in scope_err


def test_the_admin_token_as_an_option_and_a_recipe_shown_as_what_it_is(live: Live) -> None:
    # Act: no token in the environment, the option instead; a task from a recipe
    code, out, err = cli("task", "create", "--url", live.url, "--recipe", "preference",
                         "--model", str(live.model), "--admin-token", ADMIN_TOKEN, "--json",
                         env={"SEEDFED_ADMIN_TOKEN": ""})
    task_id = json.loads(out)["task_id"] if code == 0 else ""
    _, listed, _ = cli("task", "list", "--url", live.url, "--json")
    _, table, _ = cli("task", "show", task_id, "--url", live.url)

    # Assert: named after its recipe, its scope the recipe's head (not "named")
    assert code == 0, err
    (mine,) = [t for t in json.loads(listed) if t["task_id"] == task_id]
    assert (mine["name"], mine["scope"], mine["scope_label"]) == ("preference", "named", "head")
    assert "head (" in table and "(preference)" in table


def test_the_scope_label_names_what_a_scope_trains() -> None:
    from seedfed.operator_cli import scope_label

    assert scope_label({"scope": "named", "scope_options": {"patterns": ["classifier"]}}) == "head"
    assert scope_label({"scope": "named", "scope_options": {"patterns": ["a", "b"]}}) == \
        "named (a, b)"
    assert scope_label({"scope": "lora", "lora": {"r": 8, "target_modules": ["dense"],
                                                  "train_head": True}}) == \
        "lora r8 (dense + head)"
    assert scope_label({"scope": "full"}) == "full"


def test_every_operator_command_takes_the_admin_token_as_an_option() -> None:
    import click
    import typer.main

    root = typer.main.get_command(app)
    assert isinstance(root, click.Group)
    commands = [(f"{group} {name}", cmd) for group in ("task", "round", "devices")
                for name, cmd in root.commands[group].commands.items()]  # type: ignore[attr-defined]

    for path, cmd in commands:
        (option,) = [p for p in cmd.params if "--admin-token" in p.opts]
        assert option.envvar == "SEEDFED_ADMIN_TOKEN", path
        assert "SEEDFED_ADMIN_TOKEN" in (option.help or ""), path  # type: ignore[attr-defined]
    assert len(commands) >= 7


# -- what reaches the terminal -------------------------------------------------------------------
#: A name and a reason as an older coordinator may have stored them: ANSI escapes (clear the
#: screen, colours), a carriage return and newline that forge a line, a bidirectional override,
#: a C1 control (CSI) and rich markup.
NASTY_NAME = "ev\x1b[2J\x1b[31mil\r\n[bold]x[/bold]\u202e\x9b"
NASTY_REASON = "stop\nround 9  closed\x1b[0m\x07"


class OldCoordinator(httpx.BaseTransport):
    """The live coordinator over HTTP, its task names and abandon reasons replaced by what an
    older coordinator, which did not refuse control characters, may answer."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.inner.handle_request(request)
        answer.read()
        if request.method != "GET" or answer.status_code != 200:
            return answer
        body = answer.json()
        for item in body if isinstance(body, list) else [body]:
            if isinstance(item, dict):
                item.update({k: v for k, v in (("name", NASTY_NAME),
                                               ("abandon_reason", NASTY_REASON)) if k in item})
        return httpx.Response(200, json=body)


def test_printable_escapes_control_format_and_separator_characters() -> None:
    from seedfed.operator_cli import printable

    assert printable("a\x1b[31mb\r\n\t\x00\x7f\x9b\u202e\u200b\u2028c") == \
        "a\\x1b[31mb\\r\\n\\t\\x00\\x7f\\x9b\\u202e\\u200b\\u2028c"
    assert printable("ßeta café 42 [bold]") == "ßeta café 42 [bold]"


def test_names_and_reasons_from_an_old_coordinator_are_printed_escaped(
        live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: a task with an abandoned round, read through an old coordinator's answers
    import seedfed.operator_cli as operator_cli

    task_id = create(live, "--manual")["task_id"]
    assert cli("round", "open", task_id, "--url", live.url)[0] == 0
    assert cli("round", "abandon", task_id, "--reason", "x", "--url", live.url)[0] == 0
    monkeypatch.setattr(operator_cli, "http_factory", lambda url: httpx.Client(
        base_url=url, transport=OldCoordinator()))

    # Act
    shown = cli("task", "show", task_id, "--url", live.url)
    listed = cli("task", "list", "--url", live.url)
    as_json = cli("task", "show", task_id, "--url", live.url, "--json")

    # Assert: no control character reaches the terminal, each is shown as its escape, and
    # rich markup is printed as written
    for code, out, err in (shown, listed, as_json):
        assert code == 0, err
        assert not any(ch in out for ch in "\x1b\r\x07\u202e\x9b"), out
    assert "ev\\x1b[2J\\x1b[31mil\\r\\n[bold]x[/bold]\\u202e\\x9b" in shown[1]
    assert "round 1: stop\\nround 9  closed\\x1b[0m\\x07" in shown[1]
    assert "(stop\\nround 9  closed\\x1b[0m\\x07)" in shown[1]
    assert "ev\\x1b[2J" in listed[1]
    assert json.loads(as_json[1])["name"] == NASTY_NAME  # --json: escaped by JSON itself


def test_a_causal_lm_takes_the_label_words_recipe_and_its_lora_settings(
        tmp_path: Path) -> None:
    # Arrange: a directory whose config names a causal LM
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    # Act: the default recipe, a LoRA setting and the objective's words from the command line
    spec, _ = build_spec(CreateOptions(model=str(tmp_path),
                                       sets=("target_modules=q_proj,k_proj", "words=bad,good")))
    # Assert
    assert (spec.model_kind, spec.scope, spec.objective.kind) == ("causal_lm", "lora",
                                                                 "label_words")
    assert spec.lora.target_modules == ("q_proj", "k_proj")
    assert spec.objective.words == ("bad", "good")
