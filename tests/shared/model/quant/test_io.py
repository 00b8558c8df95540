from __future__ import annotations

from pathlib import Path

import pytest
import torch
from seedfed.shared.model.quant import (
    QuantChecksumError,
    QuantConfig,
    QuantFileError,
    build_quantized,
    load_quantized,
    load_scales,
    quant_layers,
    save_quantized,
    save_scales,
)
from seedfed.shared.model.quant.io import WEIGHTS_FILE
from seedfed.shared.protocol.errors import ChecksumMismatchError
from transformers import LlamaConfig


@pytest.fixture
def saved(tmp_path: Path, tiny_llama_config: LlamaConfig) -> tuple[Path, torch.nn.Module]:
    model = build_quantized(tiny_llama_config, QuantConfig(bits=4, group_size=32), seed=2)
    save_quantized(model, tmp_path / "q")
    return tmp_path / "q", model


def test_round_trip_restores_every_tensor_and_the_forward(
        saved: tuple[Path, torch.nn.Module], token_batch: dict[str, torch.Tensor]) -> None:
    directory, model = saved

    loaded = load_quantized(directory)

    want, got = model.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype for k in want)
    with torch.no_grad():
        assert torch.equal(loaded(**token_batch).logits, model(**token_batch).logits)


def test_a_flipped_byte_is_refused_by_the_checksum(saved: tuple[Path, torch.nn.Module]) -> None:
    directory, _ = saved
    path = directory / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the tensor data, past the header
    path.write_bytes(bytes(data))

    with pytest.raises(QuantChecksumError, match="corrupt") as info:
        load_quantized(directory)
    assert isinstance(info.value, ChecksumMismatchError)


def test_a_truncated_file_is_refused(saved: tuple[Path, torch.nn.Module]) -> None:
    directory, _ = saved
    path = directory / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-1000])

    with pytest.raises(QuantFileError, match="truncated"):
        load_quantized(directory)


def test_a_file_without_checksum_metadata_is_refused(tmp_path: Path,
                                                     saved: tuple[Path, torch.nn.Module]) -> None:
    from safetensors.torch import save_file
    directory, _ = saved
    save_file({"x": torch.zeros(2)}, str(directory / WEIGHTS_FILE),
              metadata={"format": "seedfed-quant", "format_version": "1"})

    with pytest.raises(QuantFileError, match="no checksum"):
        load_quantized(directory)


def test_scales_travel_alone_and_load_back_exactly(tmp_path: Path,
                                                   saved: tuple[Path, torch.nn.Module]) -> None:
    directory, model = saved
    device = load_quantized(directory)
    with torch.no_grad():
        for _, layer in quant_layers(model):
            layer.scales.mul_(1.5)

    save_scales(model, tmp_path / "v1.safetensors")
    load_scales(device, tmp_path / "v1.safetensors")

    for (_, a), (_, b) in zip(quant_layers(model), quant_layers(device), strict=True):
        assert torch.equal(a.scales, b.scales)


def test_scales_file_for_another_model_is_refused(tmp_path: Path,
                                                  saved: tuple[Path, torch.nn.Module]) -> None:
    directory, model = saved
    save_scales(model, tmp_path / "v1.safetensors")
    other = build_quantized(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2), QuantConfig(bits=4, group_size=32))

    with pytest.raises(QuantFileError, match="scales for"):
        load_scales(other, tmp_path / "v1.safetensors")
