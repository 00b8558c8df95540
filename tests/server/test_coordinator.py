"""Facade behaviour beyond the storage contract: DP accounting, robust rules, batching."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
from seedfed.server import privacy, service
from seedfed.server.coordinator import Coordinator
from seedfed.server.errors import InvalidUploadError
from seedfed.server.schemas import UploadReceipt
from seedfed.shared.protocol.aggregate import AggregationConfig
from seedfed.shared.protocol.wire import Upload

from tests.server.conftest import tiny_spec


def test_dp_task_reports_epsilon_over_the_rounds_run(coord: Coordinator,
                                                     tiny_bert: Path) -> None:
    cfg = AggregationConfig(dp_clip=1.0, dp_noise_multiplier=1.3)
    task_id = coord.create_task(tiny_spec(tiny_bert, aggregation=cfg))
    dev, _ = coord.enroll(task_id)
    assert coord.task_status(task_id).epsilon == 0.0
    for r in range(2):
        plan = coord.open_round(task_id)
        coord.submit(task_id, dev, Upload.build(plan, np.full((plan.steps, plan.perturbations),
                                                              5.0 + r), 4, 0.1))
        coord.close_round(task_id)

    status = coord.task_status(task_id)

    assert status.epsilon == pytest.approx(privacy.epsilon(1.3, 2, coord.settings.dp_delta))
    assert status.delta == coord.settings.dp_delta


def test_median_rule_ignores_an_outlier(coord: Coordinator, tiny_bert: Path) -> None:
    task_id = coord.create_task(tiny_spec(tiny_bert, aggregation=AggregationConfig(
        rule="median")))
    devs = [coord.enroll(task_id)[0] for _ in range(3)]
    plan = coord.open_round(task_id)
    shape = (plan.steps, plan.perturbations)
    for dev, value in zip(devs, (1.0, 1.0, 9000.0), strict=True):
        coord.submit(task_id, dev, Upload.build(plan, np.full(shape, value), 4, 0.1))

    entry = coord.close_round(task_id)

    coefs = entry.to_entry().coefs
    assert np.allclose(coefs, -(plan.lr / plan.perturbations) * 1.0)


def test_revoked_device_cannot_upload_in_process(coord: Coordinator, tiny_bert: Path) -> None:
    task_id = coord.create_task(tiny_spec(tiny_bert))
    dev, _ = coord.enroll(task_id)
    plan = coord.open_round(task_id)
    coord.revoke(task_id, dev)

    with pytest.raises(InvalidUploadError, match="revoked"):
        coord.submit(task_id, dev, Upload.build(plan, np.zeros((plan.steps,
                                                                plan.perturbations)), 4, 0.1))


def test_tick_expires_an_empty_round_past_its_deadline(coord: Coordinator,
                                                       tiny_bert: Path) -> None:
    task_id = coord.create_task(tiny_spec(tiny_bert), round_timeout_s=1e-3)
    coord.open_round(task_id)
    import time

    time.sleep(0.01)
    coord.tick()

    assert coord.round_metrics(task_id)[0].state == "expired"
    assert coord.open_round(task_id).round == 2


def test_writer_batches_concurrent_uploads_each_with_its_outcome(coord: Coordinator,
                                                                 tiny_bert: Path) -> None:
    task_id = coord.create_task(tiny_spec(tiny_bert), quorum=1000)
    devs = [coord.enroll(task_id)[0] for _ in range(40)]
    plan = coord.open_round(task_id)
    pending = [service.check_upload(
        coord.rt, task_id=task_id, round_number=plan.round, device_id=d,
        upload=Upload.build(plan, np.full((plan.steps, plan.perturbations), i / 10), 3, 0.1),
        wire_bytes=100) for i, d in enumerate(devs)]
    writer = service.UploadWriter(coord.rt)
    pending.append(pending[0])  # a retry inside the same batch
    futures = [writer.submit(p) for p in pending]  # all queued before the writer starts
    writer.start()
    try:
        done = [f.result(timeout=30) for f in concurrent.futures.as_completed(futures)]
    finally:
        writer.stop()

    assert all(isinstance(r, UploadReceipt) for r in done)
    assert writer.batches == 1
    assert coord.round_metrics(task_id)[0].participants == 40


def test_an_in_process_upload_counts_its_binary_form_like_the_rest_route(
        coord: Coordinator, tiny_bert: Path) -> None:
    task_id = coord.create_task(tiny_spec(tiny_bert))
    dev, _ = coord.enroll(task_id)
    plan = coord.open_round(task_id)

    coord.submit(task_id, dev, Upload.build(plan, np.ones((plan.steps, plan.perturbations)),
                                            4, 0.1))
    coord.close_round(task_id)

    # bytes on the wire: the 16-byte header and 4 bytes per scalar, not the JSON form
    assert coord.round_metrics(task_id)[0].upload_bytes == 16 + 4 * plan.steps * plan.perturbations


def test_a_given_task_secret_repeats_the_rounds_seeds_and_a_default_one_does_not(
        coord: Coordinator, tiny_bert: Path) -> None:
    secret = "0123456789abcdef" * 2  # simulations and tests only (seedfed simulate --seed)
    fixed = [coord.create_task(tiny_spec(tiny_bert), secret=secret) for _ in range(2)]
    drawn = [coord.create_task(tiny_spec(tiny_bert)) for _ in range(2)]

    seeds = [coord.open_round(t).seeds for t in fixed + drawn]

    assert seeds[0] == seeds[1]
    assert seeds[2] != seeds[3] and seeds[2] != seeds[0]


@pytest.mark.parametrize("secret", ["", "0123", "0123456789ABCDEF" * 2, "g" * 32])
def test_a_malformed_task_secret_is_refused(coord: Coordinator, tiny_bert: Path,
                                            secret: str) -> None:
    from seedfed.server.errors import InvalidTaskError

    with pytest.raises(InvalidTaskError, match="secret"):
        coord.create_task(tiny_spec(tiny_bert), secret=secret)


def test_submit_many_stores_a_rounds_uploads_and_refuses_each_bad_one_alone(
        coord: Coordinator, tiny_bert: Path) -> None:
    task_id = coord.create_task(tiny_spec(tiny_bert))
    honest, twice, stale, revoked = (coord.enroll(task_id)[0] for _ in range(4))
    plan = coord.open_round(task_id)
    shape = (plan.steps, plan.perturbations)
    coord.submit(task_id, twice, Upload.build(plan, np.full(shape, 1.0), 4, 0.1))
    coord.revoke(task_id, revoked)
    old = Upload.build(plan, np.full(shape, 3.0), 4, 0.1).model_copy(
        update={"version": plan.version + 1})

    outcomes = coord.submit_many(task_id, [
        (honest, Upload.build(plan, np.full(shape, 2.0), 4, 0.1), None),
        (twice, Upload.build(plan, np.full(shape, 5.0), 4, 0.1), None),  # a different second
        (stale, old, None),
        (revoked, Upload.build(plan, np.full(shape, 4.0), 4, 0.1), None),
    ])

    assert isinstance(outcomes[0], UploadReceipt) and outcomes[0].device_id == honest
    assert [type(o).__name__ for o in outcomes[1:]] == [
        "DuplicateUploadError", "StaleVersionError", "InvalidUploadError"]
    assert coord.task_status(task_id).devices_seen == 2  # the honest one and the first
