"""Plain-HTTP devices on a ternary classifier task (TerMeZO + the float head) against the app.

A tiny sentence-transformers BERT converted to BitLinear, the head in the scope, mask epochs
every 2 versions: the devices hold the packed encoder, take the head with every published
snapshot, replay inside an epoch and end every round on the coordinator's checksum.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from seedfed.client.backends.torch import TorchBackend
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import DeviceConfig, HttpDevice
from seedfed.client.ternary import PackedTernary
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.ternary import bitlinear_modules

from tests.fleet_helpers import (
    make_tiny_sentence_bert,
    replay_when_allowed,
    ternary_cls_spec,
    write_sentiment_tsv,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EPOCH_ROUNDS = 2
#: c_t of the head's bias and weight, and of layer 0's masked latents
STEP_SCALES = (("classifier.bias", 0.5), ("classifier", 4.0), ("layer.0.", 0.25))

def _packed(d: HttpDevice) -> PackedTernary | None:
    """The device's packed ternary model, once it built its device."""
    backend = None if d.device is None else d.device.backend
    return backend.packed if isinstance(backend, TorchBackend) else None



@pytest.fixture(params=[(), STEP_SCALES], ids=["unscaled", "step_scales"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict]:
    model = make_tiny_sentence_bert(tmp_path / "model")
    data = write_sentiment_tsv(tmp_path / "data.tsv", n=300)
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    spec = replace(ternary_cls_spec(model, EPOCH_ROUNDS, train_head=True),
                   step_scales=request.param)
    task_id, join = coord.create_task_with_token(spec, quorum=50)
    with TestClient(create_app(runtime=coord.rt)) as client:

        def device(i: int) -> HttpDevice:
            cfg = DeviceConfig(url="http://testserver", task_id=task_id, join_token=join,
                               state_dir=tmp_path / f"dev{i}", model=str(model),
                               data=DeviceData(source=str(data), partition_id=i,
                                               num_partitions=2, alpha=1.0))
            return replay_when_allowed(HttpDevice(cfg, client=client))

        yield {"coord": coord, "task": task_id, "device": device, "scales": request.param}
    coord.close()


def test_two_devices_train_the_masked_latents_and_the_head_across_epoch_starts(
        world: dict) -> None:
    coord, task = world["coord"], world["task"]
    devices = [world["device"](0), world["device"](1)]
    for d in devices:
        d.enroll()
    synced = []
    head_v0 = None

    for r in range(1, 5):
        plan = coord.open_round(task)
        for d in devices:
            d.train_and_upload(plan)
            if head_v0 is None:
                head_v0 = _packed(d).model.classifier.weight.clone()  # type: ignore[union-attr]
        coord.close_round(task)
        results = [d.sync() for d in devices]
        status = coord.task_status(task)
        # Assert (per round): both devices hold the coordinator's version, bit for bit
        assert [(x.version, x.checksum) for x in results] == [(r, status.checksum)] * 2
        assert all(_packed(d) is not None and _packed(d).scope is not None
                   and checksum(_packed(d).scope) == status.checksum for d in devices)
        synced.append([x.method for x in results])

    assert synced == [["replay"] * 2, ["snapshot"] * 2, ["replay"] * 2, ["snapshot"] * 2]
    for d in devices:
        t = _packed(d)
        assert t is not None and t.scope is not None
        assert "classifier.weight" in t.scope.names
        assert all(m.weight is None and m.packed is not None
                   for _, m in bitlinear_modules(t.model)), "the encoder stays packed"
        assert not torch.equal(t.model.classifier.weight, head_v0), "the head trained"
        want = {n: next((c for p, c in world["scales"] if p in n), 1.0) for n in t.scope.names}
        assert {x.name: x.step_scale for x in t.scope} == want


def test_alternate_epochs_train_the_head_and_the_latents_in_turn(tmp_path: Path) -> None:
    # Arrange: head epochs (even) plan the head's lr and seeds; latent epochs (odd) the task's
    model = make_tiny_sentence_bert(tmp_path / "model")
    data = write_sentiment_tsv(tmp_path / "data.tsv", n=300)
    spec = replace(ternary_cls_spec(model, EPOCH_ROUNDS, train_head=True, alternate=True,
                                    head_lr=0.5, head_perturbations=6, head_steps=3),
                   step_scales=(("classifier.bias", 0.1),))
    with Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                   store_dir=tmp_path / "store")) as coord:
        task, join = coord.create_task_with_token(spec, quorum=50)
        with TestClient(create_app(runtime=coord.rt)) as client:
            devices = [replay_when_allowed(HttpDevice(DeviceConfig(
                url="http://testserver", task_id=task, join_token=join,
                state_dir=tmp_path / f"dev{i}", model=str(model),
                data=DeviceData(source=str(data), partition_id=i, num_partitions=2,
                                alpha=1.0)), client=client)) for i in range(2)]
            for d in devices:
                d.enroll()
            seen = []

            # Act: six rounds, epochs head / latents / head
            for r in range(1, 7):
                plan = coord.open_round(task)
                for d in devices:
                    d.train_and_upload(plan)
                coord.close_round(task)
                results = [d.sync() for d in devices]
                status = coord.task_status(task)
                t = _packed(devices[0])
                assert t is not None and t.scope is not None
                seen.append(((plan.steps, plan.perturbations), plan.lr, tuple(t.scope.names),
                             t.model.classifier.weight.clone(),  # type: ignore[union-attr]
                             sum(m.latent.numel() for _, m in bitlinear_modules(t.model)
                                 if m.latent is not None)))
                # Assert (per round): both devices hold the coordinator's version, bit for bit
                assert [(x.version, x.checksum) for x in results] == [(r, status.checksum)] * 2

    # Assert: the plans, each version's scope (epoch = version // 2) and which part moved
    assert [(p, lr) for p, lr, *_ in seen] == [((3, 6), 0.5)] * 2 + [((2, 2), 1e-2)] * 2 + \
        [((3, 6), 0.5)] * 2
    head = ("classifier.bias", "classifier.weight")
    names = [n for _, _, n, _, _ in seen]  # versions 1..6: epochs 0, 1, 1, 2, 2, 3
    assert [n == head for n in names] == [True, False, False, True, True, False]
    assert not set(names[1]) & set(head), "a latent epoch's seeds never perturb the head"
    assert [n > 0 for *_, n in seen] == [False, True, True, False, False, True], \
        "a device holds latents in latent epochs only"
    w = [x for _, _, _, x, _ in seen]
    moved = [not torch.equal(a, b) for a, b in zip(w, w[1:], strict=False)]
    # v2: round 2 trained the head (base v1, a head epoch); v3, v4: latents; v5, v6: the head
    assert moved == [True, False, False, True, True]
