from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.model.ternary import (
    CODE_MAP,
    WEIGHTS_FILE,
    BitLinear,
    TernaryChecksumError,
    TernaryFormatError,
    TernaryScope,
    bitlinear_modules,
    convert_to_bitlinear,
    load_ternary_model,
    publish_ternary,
    save_ternary_model,
    ternary_snapshot,
    write_tensors,
)
from seedfed.shared.model.ternary.io import read_tensors
from seedfed.shared.protocol.errors import ChecksumMismatchError

from tests.shared.model.ternary.conftest import tiny_bitnet, tiny_llama


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = tiny_llama()
    build_scope("ternary", model, fraction=0.05)
    save_ternary_model(model, tmp_path / "snap")
    return tmp_path / "snap"


def test_snapshot_is_plain_safetensors_with_documented_metadata(saved: Path) -> None:
    with safe_open(str(saved / WEIGHTS_FILE), framework="pt") as f:
        meta = f.metadata()
        names = set(f.keys())
    layers = json.loads(meta["layers"])
    assert meta["format"] == "seedfed-ternary" and meta["code_map"] == CODE_MAP
    assert len(meta["checksum"]) == 64
    for name in layers:
        assert {f"{name}.packed", f"{name}.gamma", f"{name}.mask", f"{name}.latent"} <= names
        assert f"{name}.weight" not in names  # no full latents on a masked snapshot


def test_round_trip_keeps_codes_latents_and_forward(tmp_path: Path, tokens: torch.Tensor) -> None:
    # Arrange
    model = tiny_bitnet()
    build_scope("ternary", model, fraction=0.1)
    # Act
    save_ternary_model(model, tmp_path / "b")
    back = load_ternary_model(tmp_path / "b")
    # Assert
    a, b = ternary_snapshot(model), ternary_snapshot(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, back(input_ids=tokens).logits)
    assert type(back).__name__ == "BitNetForCausalLM"


def test_inference_load_skips_latents_but_still_verifies_them(saved: Path) -> None:
    model = load_ternary_model(saved, with_latents=False)
    assert all(m.latent is None and m.mask is None for _, m in bitlinear_modules(model))
    path = saved / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the last tensor in the file
    path.write_bytes(bytes(data))
    with pytest.raises(TernaryChecksumError):
        load_ternary_model(saved, with_latents=False)


def test_tied_embeddings_round_trip(tmp_path: Path, tokens: torch.Tensor) -> None:
    model = tiny_llama(tie=True)
    convert_to_bitlinear(model)
    save_ternary_model(model, tmp_path / "t")
    back = load_ternary_model(tmp_path / "t", with_latents=False)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, back(input_ids=tokens).logits)


def test_full_latent_snapshot_carries_every_latent(tmp_path: Path) -> None:
    model = tiny_llama()
    scope = build_scope("ternary", model, selection="full")
    save_ternary_model(model, tmp_path / "f")
    dev = build_scope("ternary", load_ternary_model(tmp_path / "f"))
    assert isinstance(dev, TernaryScope)
    assert dev.numel == scope.numel and not any(t.compact for t in dev)


def test_corrupt_byte_is_refused_with_a_checksum_error(saved: Path) -> None:
    path = saved / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="corrupt"):
        load_ternary_model(saved)


@pytest.mark.parametrize("keep", [0, 5, 200, -100])
def test_truncated_file_is_refused(saved: Path, keep: int) -> None:
    path = saved / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(TernaryFormatError, match="truncated|too short|unreadable|exceeds"):
        load_ternary_model(saved)


def test_invalid_code_with_a_valid_checksum_is_refused(saved: Path) -> None:
    tensors, meta = read_tensors(saved / WEIGHTS_FILE, expected_format="seedfed-ternary")
    name = next(k for k in sorted(tensors) if k.endswith(".packed"))
    tensors[name][0] = 0xFF  # four codes 3
    write_tensors(saved / WEIGHTS_FILE, tensors, meta)
    with pytest.raises(TernaryFormatError, match="invalid code 3"):
        load_ternary_model(saved)


def test_other_formats_are_refused(tmp_path: Path) -> None:
    write_tensors(tmp_path / "x.safetensors", {"a": torch.zeros(2)}, {"format": "seedfed-quant"})
    with pytest.raises(TernaryFormatError, match="seedfed-quant"):
        read_tensors(tmp_path / "x.safetensors", expected_format="seedfed-ternary")


def test_publish_ternary_matches_the_saved_layer_tensors(saved: Path) -> None:
    model = tiny_llama()
    scope = build_scope("ternary", model, fraction=0.05)
    out = publish_ternary(scope.read(), scope)
    stored, _ = read_tensors(saved / WEIGHTS_FILE, expected_format="seedfed-ternary")
    for name, m in bitlinear_modules(model):
        assert isinstance(m, BitLinear)
        for part in ("packed", "gamma", "mask", "latent"):
            assert torch.equal(out[f"{name}.{part}"], stored[f"{name}.{part}"])
