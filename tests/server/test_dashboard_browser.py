"""The dashboard in headless Chromium, against API payloads built from the coordinator's own
response schemas (so they cannot drift from what the API returns).

These tests exercise the page's logic (auth prompt, charts, tables, refresh) on shapes the real
coordinator rarely produces (expired rounds, DP, many rounds); test_dashboard_e2e.py drives the
real coordinator end to end.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi import FastAPI, Header, HTTPException
from playwright.sync_api import expect
from seedfed.server.dashboard import router
from seedfed.server.schemas import RoundMetrics, TaskStats, TaskStatus

from tests.server.dashboard_harness import Browser, Page, browser_fixture, open_dashboard, serve

__all__ = ["browser_fixture"]  # the `browser` fixture, used by name

pytestmark = pytest.mark.browser

TOKEN = "fixture-admin-token"
HOSTILE_NAME = '<img src=x onerror="document.body.dataset.pwned=1">'  # must show as text
T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
FEDAVG_PER_PARTICIPANT = 2 * 4 * 36_866


def make_round(number: int, *, state: str = "closed", participants: int = 3,
               reason: str | None = None) -> RoundMetrics:
    closed = state == "closed"
    return RoundMetrics(
        round=number, version=number + 1 if closed else None, base_version=number, state=state,
        participants=participants,
        loss=0.69 * math.exp(-number / 9) if participants else None,
        upload_bytes=participants * 420, download_bytes=(participants * 700) if closed else 0,
        fedavg_bytes=participants * FEDAVG_PER_PARTICIPANT,
        opened_at=T0 + timedelta(minutes=number),
        closed_at=T0 + timedelta(minutes=number, seconds=30) if state != "open" else None,
        aggregation_seconds=0.012 if closed else None, abandon_reason=reason)


class FixtureApi:
    """Two tasks; rounds of the first may be appended while the page is open."""

    def __init__(self, *, public: bool = False) -> None:
        self.public = public  # like the coordinator's `public_stats` setting
        # rounds 0-8 closed with 2-4 participants, 9 expired (nobody came), 10 open
        self.rounds = [make_round(i, participants=2 + i % 3) for i in range(9)]
        self.rounds.append(make_round(9, state="expired", participants=0))
        self.rounds.append(make_round(10, state="open", participants=1))

    def status(self, task_id: str) -> TaskStatus:
        if task_id == "b":
            return TaskStatus(
                task_id="b", name=HOSTILE_NAME, version=0, checksum="00" * 32, round=None,
                state="idle", devices=0, devices_seen=0, quorum=1, round_timeout_s=60.0,
                devices_per_round=None, scope="full", scope_numel=1000, format="fp16",
                aggregation="median", epsilon=None, delta=None, created_at=T0,
                schedule="auto", waiting_for="devices", waiting="no device enrolled: the first "
                "round opens when one enrolls with the task's join token")
        closed = [r for r in self.rounds if r.version is not None]
        last = self.rounds[-1]
        return TaskStatus(
            task_id="a", name="sst2-lora", version=closed[-1].version or 0,
            checksum="ab12" * 16, round=last.round, state="open", devices=5,
            devices_seen=4, quorum=2, round_timeout_s=600.0, devices_per_round=None,
            scope="lora", scope_numel=36_866, format="int8", aggregation="mean",
            epsilon=1.25, delta=1e-5, created_at=T0, schedule="auto", max_rounds=40,
            uploads=last.participants, deadline=T0 + timedelta(hours=1),
            waiting_for="uploads", waiting=f"round {last.round}: {last.participants} of 2 "
            "uploads for the quorum (5 device(s) enrolled)", **self.abandoned())

    def abandoned(self) -> dict[str, Any]:
        gone = [r for r in self.rounds if r.state == "abandoned"]
        return {} if not gone else {"abandoned_round": gone[-1].round,
                                    "abandon_reason": gone[-1].abandon_reason}

    def stats(self, task_id: str) -> TaskStats:
        status = self.status(task_id)
        rounds = self.rounds if task_id == "a" else []
        return TaskStats(task_id=task_id, name=status.name, version=status.version,
                         scope_numel=status.scope_numel, devices_enrolled=status.devices + 1,
                         devices_revoked=1, devices_seen=status.devices_seen,
                         fedavg_bytes_per_participant=FEDAVG_PER_PARTICIPANT,
                         epsilon=status.epsilon, rounds=rounds)

    def app(self) -> FastAPI:
        app = FastAPI()
        app.include_router(router)

        def check(authorization: str | None) -> None:
            if not self.public and authorization != f"Bearer {TOKEN}":
                raise HTTPException(401, "admin token required")

        @app.get("/v1/tasks")
        def tasks(authorization: str | None = Header(None)) -> list[dict[str, Any]]:
            check(authorization)
            return [self.status(t).model_dump(mode="json") for t in ("a", "b")]

        @app.get("/v1/tasks/{task_id}")
        def task(task_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
            check(authorization)
            return self.status(task_id).model_dump(mode="json")

        @app.get("/v1/tasks/{task_id}/stats")
        def stats(task_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
            check(authorization)
            return self.stats(task_id).model_dump(mode="json")

        return app


@pytest.fixture(scope="module")
def fixture_api() -> FixtureApi:
    return FixtureApi()


@pytest.fixture(scope="module")
def base_url(fixture_api: FixtureApi):  # type: ignore[no-untyped-def]
    with serve(fixture_api.app()) as url:
        yield url


def attr(page: Page, selector: str, name: str = "data-value") -> str:
    value = page.get_attribute(selector, name)
    assert value is not None, f"{selector} has no {name}"
    return value


def text(page: Page, selector: str) -> str:
    return page.text_content(selector) or ""


def values(page: Page, selector: str, attr: str = "data-value") -> list[str]:
    return page.eval_on_selector_all(selector, f"els => els.map(e => e.getAttribute('{attr}'))")


def test_page_asks_for_the_token_and_refuses_a_wrong_one(browser: Browser, base_url: str) -> None:
    # Arrange
    page = browser.new_page()
    page.goto(base_url + "/")
    page.wait_for_selector("body[data-state=auth]")

    # Act
    page.fill("#token-input", "wrong")
    page.click("#auth-form button")
    expect(page.locator("#auth-error")).to_contain_text("token refused")
    refused = text(page, "#auth-error")
    page.fill("#token-input", TOKEN)
    page.click("#auth-form button")
    page.wait_for_selector("body[data-state=ready]")

    # Assert
    assert "token refused" in refused
    assert "admin token required" in refused
    assert page.is_hidden("#auth")
    assert page.evaluate("sessionStorage.getItem('seedfed.dashboard.token')") == TOKEN
    assert page.locator("#tasks tbody tr").count() == 2
    page.close()


def test_charts_and_tables_match_the_payload(browser: Browser, base_url: str,
                                              fixture_api: FixtureApi) -> None:
    # Arrange
    rounds = fixture_api.rounds
    status = fixture_api.status("a")

    # Act
    page, problems = open_dashboard(browser, base_url, TOKEN)

    # Assert: one bar per round (an expired round's bar has zero height), the task's quorum
    part = page.locator("#chart-participation rect.bar")
    assert part.count() == len(rounds)
    assert values(page, "#chart-participation rect.bar") == [str(r.participants) for r in rounds]
    assert attr(page, "#chart-participation line.ref-line") == "2"
    # loss: a point for each round that has a loss, the expired round leaves a gap in the line
    with_loss = [r for r in rounds if r.loss is not None]
    assert [float(v) for v in values(page, "#chart-loss circle.pt.loss")] == \
        pytest.approx([r.loss for r in with_loss])
    assert attr(page, "#chart-loss path.line.loss", "d").count("M") == 2
    assert page.locator("#chart-loss .pt.accuracy").count() == 0
    # bytes: log scale, no bar for zero bytes, FedAvg's bar taller than the upload's
    for cls, field in (("upload", "upload_bytes"), ("download", "download_bytes"),
                       ("fedavg", "fedavg_bytes")):
        drawn = [int(v) for v in values(page, f"#chart-bytes rect.bar.{cls}")]
        assert drawn == [getattr(r, field) for r in rounds if getattr(r, field) > 0], cls
    ticks = page.eval_on_selector_all("#chart-bytes .axis.y text:not(.axis-title)",
                                      "els => els.map(e => e.textContent)")
    assert ticks[0] == "100 B" and "1 kB" in ticks and "1 MB" in ticks
    tops = page.eval_on_selector_all(
        "#chart-bytes rect.bar",
        "els => els.map(e => [e.classList[1], e.dataset.category, +e.getAttribute('y')])")
    top = {(c, int(r)): y for c, r, y in tops}
    assert all(top[("fedavg", r.round)] < top[("upload", r.round)] for r in with_loss)
    # cards
    assert attr(page, '[data-field="version"]') == str(status.version)
    assert text(page, '[data-field="checksum"]') == status.checksum
    assert attr(page, '[data-field="devices"]') == "4"
    assert "6 enrolled, 1 revoked" in text(page, '[data-field="devices-note"]')
    assert int(attr(page, '[data-field="upload-bytes"]')) == \
        sum(r.upload_bytes for r in rounds)
    assert int(attr(page, '[data-field="fedavg-bytes"]')) == \
        sum(r.fedavg_bytes for r in rounds)
    assert "ε = 1.25" in text(page, "#facts")
    # rounds table, newest first, one row per round
    assert values(page, "#rounds tbody tr", "data-round") == [str(r.round) for r in rounds][::-1]
    assert page.is_hidden("#devices-section")
    assert page.is_hidden("#personal-figure")  # no device reported accuracies
    assert problems == []
    page.close()


def with_accuracy(r: RoundMetrics) -> RoundMetrics:
    """`r` as if 10 devices (8 with a personal part) reported their held-out accuracies."""
    k = r.round / 10
    return r.model_copy(update={
        "metric_devices": 10, "personal_devices": 8, "shared_accuracy_mean": 0.55 + k / 4,
        "shared_accuracy_worst_decile": 0.2 + k / 5, "personal_accuracy_mean": 0.7 + k / 5,
        "personal_accuracy_worst_decile": 0.45 + k / 4})


def test_shared_vs_personalized_accuracy_chart_shows_the_reported_rounds(
        browser: Browser, base_url: str, fixture_api: FixtureApi) -> None:
    # Arrange: rounds 2..8 carry the devices' reports; the others (and the idle task) none
    saved = list(fixture_api.rounds)
    fixture_api.rounds[2:9] = [with_accuracy(r) for r in saved[2:9]]
    reported = fixture_api.rounds[2:9]
    series = {"shared-mean": "shared_accuracy_mean",
              "shared-worst": "shared_accuracy_worst_decile",
              "personal-mean": "personal_accuracy_mean",
              "personal-worst": "personal_accuracy_worst_decile"}
    try:
        # Act
        page, problems = open_dashboard(browser, base_url, TOKEN)
        drawn = {cls: [float(v) for v in values(page, f"#chart-personal circle.pt.{cls}")]
                 for cls in series}
        rounds_of_points = values(page, "#chart-personal circle.pt.personal-mean",
                                  "data-category")
        dashed = page.eval_on_selector(
            "#chart-personal path.line.personal-worst",
            "e => getComputedStyle(e).strokeDasharray")
        ticks = page.eval_on_selector_all("#chart-personal .axis.y text:not(.axis-title)",
                                          "els => els.map(e => e.textContent)")
        note = text(page, "#personal-note")
        row = text(page, '#rounds tbody tr[data-round="8"]')
        page.click('#tasks tbody tr[data-task-id="b"]')
        expect(page.locator("#task-title")).to_have_text("b · " + HOSTILE_NAME)
        hidden_for_idle = page.is_hidden("#personal-figure")
    finally:
        fixture_api.rounds[:] = saved

    # Assert: one point per reported round and series, the payload's numbers, on a 0..1 axis
    assert page.locator("#personal-figure").count() == 1
    for cls, field in series.items():
        assert drawn[cls] == pytest.approx([getattr(r, field) for r in reported]), cls
    assert rounds_of_points == [str(r.round) for r in reported]
    assert dashed not in ("", "none")
    assert ticks[0] == "0%" and ticks[-1] == "100%"
    assert "round 8: 10 devices reported, 8 with a personal part" in note
    last = reported[-1]
    assert f"{last.shared_accuracy_mean * 100:.1f}% → {last.personal_accuracy_mean * 100:.1f}%" \
        in row
    assert hidden_for_idle
    assert problems == []
    page.close()


def test_the_page_says_what_each_task_waits_for_and_why_a_round_was_abandoned(
        browser: Browser, base_url: str, fixture_api: FixtureApi) -> None:
    # Arrange: round 9 was abandoned by an operator
    saved = list(fixture_api.rounds)
    fixture_api.rounds[9] = make_round(9, state="abandoned", participants=2,
                                       reason="labels were swapped")
    try:
        # Act
        page, problems = open_dashboard(browser, base_url, TOKEN)
        waiting = (text(page, '[data-field="waiting"]'), attr(page, "#waiting",
                                                              "data-waiting-for"))
        listed = [text(page, f'#tasks tbody tr[data-task-id="{t}"] td.waiting-for')
                  for t in ("a", "b")]
        abandoned = text(page, "#abandoned")
        note = text(page, '#rounds tbody tr[data-round="9"] td.note')
        facts = text(page, "#facts")
        page.click('#tasks tbody tr[data-task-id="b"]')
        expect(page.locator("#task-title")).to_have_text("b · " + HOSTILE_NAME)
        idle = (text(page, '[data-field="waiting"]'), attr(page, "#waiting",
                                                           "data-waiting-for"))
        idle_abandoned_hidden = page.is_hidden("#abandoned")
    finally:
        fixture_api.rounds[:] = saved

    # Assert: the coordinator's words, its keyword, the reason kept with the round
    status = fixture_api.status("a")
    assert waiting == (status.waiting, "uploads")
    assert listed == ["uploads 1/2", "devices"]
    assert abandoned == "round 9 was abandoned: labels were swapped"
    assert note == "labels were swapped" and "rounds: automatic until v40" in facts
    assert idle[1] == "devices" and "first round opens when one enrolls" in idle[0]
    assert idle_abandoned_hidden
    assert problems == []
    page.close()


def test_the_quorum_line_shows_when_every_round_met_it_and_bytes_face_fedavg_both_ways(
        browser: Browser, base_url: str, fixture_api: FixtureApi) -> None:
    # Arrange: every round exactly at the quorum (2), the case that hid the line on the
    # axis' top, along the bars' tops
    saved = list(fixture_api.rounds)
    fixture_api.rounds[:] = [make_round(i, participants=2) for i in range(5)]
    try:
        # Act
        page, problems = open_dashboard(browser, base_url, TOKEN)
        line_y = float(attr(page, "#chart-participation line.ref-line", "y1"))
        bar_tops = {float(v) for v in values(page, "#chart-participation rect.bar", "y")}
        ticks = page.eval_on_selector_all(
            "#chart-participation .axis.y text:not(.axis-title)",
            "els => els.map(e => [e.textContent, +e.getAttribute('y')])")
        label = text(page, "#chart-participation .ref-label")
        cards = {f: attr(page, f'[data-field="{f}"]') for f in (
            "upload-bytes", "download-bytes", "fedavg-bytes", "upload-saving",
            "download-saving", "saving")}
        notes = {f: text(page, f'[data-field="{f}"]') for f in (
            "upload-saving", "download-saving")}
        rounds = list(fixture_api.rounds)
    finally:
        fixture_api.rounds[:] = saved

    # Assert: the line lies on the bars' tops but below the axis' top, and says what it is
    assert len(bar_tops) == 1 and bar_tops.pop() == pytest.approx(line_y, abs=0.01)
    assert max(int(t) for t, _ in ticks) == 3 and min(y for _, y in ticks) < line_y
    assert label == "quorum 2"
    up, down, fed = (sum(getattr(r, f) for r in rounds)
                     for f in ("upload_bytes", "download_bytes", "fedavg_bytes"))
    assert (int(cards["upload-bytes"]), int(cards["download-bytes"]),
            int(cards["fedavg-bytes"])) == (up, down, fed)
    assert float(cards["upload-saving"]) == pytest.approx(fed / 2 / up)
    assert float(cards["download-saving"]) == pytest.approx(fed / 2 / down)
    assert float(cards["saving"]) == pytest.approx(fed / (up + down))
    assert notes["upload-saving"].startswith("FedAvg uploads ")
    assert notes["download-saving"].startswith("FedAvg downloads ")
    assert problems == []
    page.close()


def test_selecting_an_idle_task_shows_empty_charts(browser: Browser, base_url: str) -> None:
    # Arrange
    page, problems = open_dashboard(browser, base_url, TOKEN)

    # Act
    page.click('#tasks tbody tr[data-task-id="b"]')
    expect(page.locator("#task-title")).to_have_text("b · " + HOSTILE_NAME)

    # Assert
    assert page.locator("#chart-participation .empty").text_content() == "no rounds yet"
    assert page.locator("svg[data-chart]").count() == 0
    assert text(page, '[data-field="round-state"]') == "no round yet"
    assert "#task=b" in page.url
    assert page.locator("img").count() == 0  # the name went in as text, not as markup
    assert page.get_attribute("body", "data-pwned") is None
    # and back to the first task from the keyboard
    page.focus('#tasks tbody tr[data-task-id="a"]')
    page.keyboard.press("Enter")
    expect(page.locator("#task-title")).to_have_text("a · sst2-lora")
    assert problems == []
    page.close()


def test_page_refreshes_by_itself(browser: Browser, base_url: str,
                                  fixture_api: FixtureApi) -> None:
    # Arrange
    page, problems = open_dashboard(browser, base_url, TOKEN, refresh_s=1)
    before = page.locator("#chart-participation rect.bar").count()

    saved = list(fixture_api.rounds)

    # Act: the open round closes and the next one opens, with no reload of the page
    try:
        fixture_api.rounds[-1] = make_round(10, participants=2)
        fixture_api.rounds.append(make_round(11, state="open", participants=1))
        expect(page.locator("#chart-participation rect.bar")).to_have_count(before + 1,
                                                                         timeout=10_000)
        version = attr(page, '[data-field="version"]')
    finally:
        fixture_api.rounds[:] = saved

    # Assert
    assert version == "11"
    assert int(attr(page, "body", "data-refreshes")) >= 2
    assert problems == []
    page.close()


def test_public_stats_need_no_token(browser: Browser) -> None:
    # Arrange: a coordinator with `public_stats` on answers the dashboard's reads openly
    with serve(FixtureApi(public=True).app()) as url:
        page = browser.new_page()

        # Act
        page.goto(url + "/")
        page.wait_for_selector("body[data-state=ready]")

        # Assert
        assert page.is_hidden("#auth")
        assert page.is_hidden("#forget-token")
        assert page.locator("#chart-participation rect.bar").count() == 11
        page.close()


def test_chart_helpers(browser: Browser, base_url: str) -> None:
    # Arrange
    page, _ = open_dashboard(browser, base_url, TOKEN)

    # Act
    got = page.evaluate("""() => {
      const C = window.SeedfedCharts;
      return {
        ticks: C.linearTicks(0, 7, 5, true), flat: C.linearTicks(3, 3, 5),
        frac: C.linearTicks(0.1, 0.93, 5), log: C.logTicks(420, 3.1e6),
        bytes: [999, 1000, 1536, 2.5e6, 7.3e12].map(C.formatBytes),
        nums: [0.75419999, 3, 1e-7].map((x) => C.formatNumber(x, 4)),
        ratio: [26.83, 13912.7].map(C.formatRatio),
      };
    }""")

    # Assert
    assert got["ticks"] == [0, 2, 4, 6, 8]
    assert got["flat"][0] < 3 < got["flat"][-1]
    assert got["frac"] == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert got["log"] == [100, 1e3, 1e4, 1e5, 1e6, 1e7]
    assert got["bytes"] == ["999 B", "1 kB", "1.54 kB", "2.5 MB", "7.3 TB"]
    assert got["nums"] == ["0.7542", "3", "1e-7"]
    assert got["ratio"] == ["26.8", "13,913"]
    page.close()
