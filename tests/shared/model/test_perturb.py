import numpy as np
import pytest
import torch
from seedfed.shared.model import perturb, replay
from seedfed.shared.model.estimator import ZOConfig, spsa_step
from seedfed.shared.model.perturb import Perturber, resolve_mode
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.model.stream import rademacher

from tests.shared.conftest import tiny_llama
from tests.shared.devices import DEVICES, host_stream, torch_stream


def _loss(model, batch):
    with torch.no_grad():
        return float(model(**batch, labels=batch["input_ids"]).loss)


@pytest.mark.parametrize("mode", ["copy", "virtual"])
def test_probe_shows_perturbed_weights_then_restores_bitwise(llama, token_batch, mode):
    scope = build_scope("full", llama)
    before = checksum(scope)
    base = _loss(llama, token_batch)
    perturber = Perturber(scope, mode)
    with perturber.step(), perturber.probe(seed=3, scale=0.05):
        inside = _loss(llama, token_batch)
    assert inside != base
    assert checksum(scope) == before


def test_copy_and_virtual_forwards_agree_exactly(llama, token_batch):
    scope = build_scope("full", llama)
    out = {}
    for mode in ("copy", "virtual"):
        p = Perturber(scope, mode)
        with p.step(), p.probe(seed=9, scale=1e-2):
            out[mode] = _loss(llama, token_batch)
    assert out["copy"] == out["virtual"]


def test_virtual_probe_uses_theta_plus_scale_z_for_tied_weights(llama):
    scope = build_scope("full", llama)
    emb = llama.model.embed_tokens.weight
    z = rademacher(2, "model.embed_tokens.weight", emb.numel()).view_as(emb)
    expected = emb.detach() + 0.5 * z
    seen = {}
    hook = llama.lm_head.register_forward_hook(
        lambda m, a, o: seen.setdefault("w", m.weight.detach().clone()))
    with Perturber(scope, "virtual").probe(seed=2, scale=0.5):
        llama(input_ids=torch.tensor([[1, 2]]))
    hook.remove()
    assert torch.equal(seen["w"], expected)


def test_virtual_probe_restores_after_forward_raises(llama):
    scope = build_scope("full", llama)
    before = checksum(scope)
    with pytest.raises(RuntimeError), Perturber(scope, "virtual").probe(seed=1, scale=1.0):
        llama.model.layers[0].register_forward_hook(
            lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
        llama(input_ids=torch.tensor([[1, 2]]))
    assert checksum(scope) == before


def test_auto_mode_picks_copy_for_small_scopes(llama):
    assert resolve_mode(build_scope("named", llama, patterns=("norm",)), "auto") == "copy"
    assert resolve_mode(build_scope("full", llama), "auto") == "virtual"
    with pytest.raises(ValueError, match="mode"):
        resolve_mode(build_scope("full", llama), "lazy")  # type: ignore[arg-type]


def test_virtual_probe_perturbs_embedding_rows_without_swapping_the_weight(llama):
    scope = build_scope("full", llama)
    emb = llama.model.embed_tokens
    ids = torch.tensor([[3, 1, 3, 95]])
    z = rademacher(4, "model.embed_tokens.weight", emb.weight.numel()).view_as(emb.weight)
    expected = torch.nn.functional.embedding(ids, emb.weight.detach() + 0.125 * z)
    seen = {}
    hook = emb.register_forward_hook(
        lambda m, a, o: seen.update(ptr=m.weight.data_ptr()))
    with Perturber(scope, "virtual").probe(seed=4, scale=0.125):
        got = emb(ids)
    hook.remove()
    assert seen["ptr"] == emb.weight.data_ptr()  # the stored matrix was never swapped
    assert torch.equal(got, expected)


def test_virtual_step_generates_each_tensors_z_once_and_keeps_the_bits(llama, token_batch,
                                                                       monkeypatch):
    # One seed per step: its +eps probe, its -eps probe and the update share one generation
    # of z per tensor, and the step ends on the bits of the copy strategy.
    generated: dict[str, int] = {}
    real = perturb.tensor_words

    def counting(seed, name, numel, device="cpu"):
        generated[name] = generated.get(name, 0) + 1
        return real(seed, name, numel, device)

    monkeypatch.setattr(perturb, "tensor_words", counting)
    regenerated: list[str] = []  # tensors whose update generated z again
    real_add = replay.add_seeds_

    def recording(x, name, seeds, coefs, indices=None, compact=False):
        if seeds:
            regenerated.append(name)
        return real_add(x, name, seeds, coefs, indices, compact)

    monkeypatch.setattr(replay, "add_seeds_", recording)
    virtual, copy = build_scope("full", llama), build_scope("full", tiny_llama())
    config = ZOConfig(lr=1e-2, eps=1e-3, perturbations=1)

    spsa_step(virtual, lambda: float(_loss(llama, token_batch)), [77], config,
              Perturber(virtual, "virtual"))
    virtual_regenerated = set(regenerated)
    copy_model = copy.model
    spsa_step(copy, lambda: float(_loss(copy_model, token_batch)), [77], config,
              Perturber(copy, "copy"))

    assert generated and set(generated.values()) == {1}
    assert not virtual_regenerated & set(generated)  # the update reused every cached z
    assert checksum(virtual) == checksum(copy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["copy", "virtual"])
def test_torch_path_probes_and_step_give_the_kernel_paths_bits(token_batch, device, mode):
    # Arrange: one model on the kernel path (host), its twin on the torch path (on `device`)
    host, moved = tiny_llama(), tiny_llama().to(device)
    h_scope, d_scope = build_scope("full", host), build_scope("full", moved)
    batch = {k: v.to(device) for k, v in token_batch.items()}
    config = ZOConfig(lr=1e-2, eps=1e-3, perturbations=2, mode=mode)
    h_probe, d_probe = Perturber(h_scope, mode), Perturber(d_scope, mode)
    with host_stream(), h_probe.step(), h_probe.probe(seed=2**64 - 1, scale=0.05):
        h_loss = _loss(host, token_batch)
    # Act
    with torch_stream():
        with d_probe.step(), d_probe.probe(seed=2**64 - 1, scale=0.05):
            d_loss = _loss(moved, batch)
            signs = d_probe.signs
        step = spsa_step(d_scope, lambda: _loss(moved, batch), [3, 2**63], config)
    with host_stream():
        h_step = spsa_step(h_scope, lambda: _loss(host, token_batch), [3, 2**63], config)
    # Assert: on the CPU the forwards are one arithmetic, so every bit agrees
    if mode == "virtual":  # a step's cached z lives on the device as int64 words
        assert signs is not None
        words = signs.cached(next(iter(d_scope)).name, 2**64 - 1)
        assert isinstance(words, torch.Tensor) and words.device.type == device
    if device == "cpu":
        assert d_loss == h_loss
        assert np.array_equal(step.g, h_step.g)
        assert checksum(d_scope) == checksum(h_scope)
    else:  # another device's matmuls may round differently: replaying its scalars must agree
        replica = build_scope("full", tiny_llama())
        with host_stream():
            replay.apply_seeds(replica, [3, 2**63],
                               replay.update_coefficients(step.g, 1e-2, 2).tolist())
        assert checksum(replica) == checksum(d_scope)
