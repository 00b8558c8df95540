from __future__ import annotations

import pytest
import torch
from seedfed.shared.model.quant import (
    GroupSizeError,
    dequantize,
    pack_int4,
    quantize_groups,
    unpack_int4,
)


def _weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


def test_unpack_then_pack_returns_every_byte_value_bit_for_bit() -> None:
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(2, 128)

    again = pack_int4(unpack_int4(every_byte))

    assert again.dtype == torch.uint8
    assert torch.equal(again, every_byte)


def test_pack_then_unpack_returns_every_code_pair() -> None:
    codes = torch.arange(-8, 8, dtype=torch.int8)
    pairs = torch.cartesian_prod(codes, codes).to(torch.int8).reshape(4, -1)  # all 256 pairs

    assert torch.equal(unpack_int4(pack_int4(pairs)), pairs)


def test_int4_nibble_order_is_low_nibble_first() -> None:
    codes = torch.tensor([[-8, 7, 0, -1]], dtype=torch.int8)

    packed = pack_int4(codes)

    # element 0 -> low nibble (-8 + 8 = 0x0), element 1 -> high nibble (7 + 8 = 0xF)
    assert packed.tolist() == [[0xF0, 0x78]]


def test_pack_refuses_out_of_range_codes_and_odd_width() -> None:
    with pytest.raises(ValueError, match="int4 codes"):
        pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))


@pytest.mark.parametrize("bits,q", [(8, 127), (4, 7)])
def test_quantize_error_is_at_most_half_a_step_per_group(bits: int, q: int) -> None:
    w = _weight(16, 128)

    codes, scales = quantize_groups(w, bits, 32)
    back = dequantize(codes, scales, 128)

    assert codes.abs().max() <= q
    step = scales.repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 * (1 + 1e-6)).all()
    # the largest element of every group is representable exactly (absmax scaling)
    top = codes.view(16, 4, 32).abs().amax(-1)
    assert torch.equal(top, torch.full((16, 4), q, dtype=torch.int8))


def test_padding_does_not_change_scales_and_is_dropped_on_dequantize() -> None:
    w = _weight(4, 40)

    codes, scales = quantize_groups(w, 8, 32)
    back = dequantize(codes, scales, 40)

    assert codes.shape == (4, 64) and scales.shape == (4, 2)
    assert torch.equal(codes[:, 40:], torch.zeros(4, 24, dtype=torch.int8))
    assert torch.allclose(scales[:, 1], w[:, 32:].abs().amax(-1) / 127)
    assert back.shape == (4, 40)


def test_all_zero_group_gets_unit_scale_and_zero_codes() -> None:
    w = torch.zeros(2, 32)
    w[1, 3] = 0.5

    codes, scales = quantize_groups(w, 4, 32)

    assert scales[0, 0] == 1.0 and not codes[0].any()
    assert torch.equal(dequantize(codes, scales, 32), w)


@pytest.mark.parametrize("group_size", [0, 3, 31])
def test_odd_or_tiny_group_size_is_refused(group_size: int) -> None:
    with pytest.raises(GroupSizeError, match=str(group_size)):
        quantize_groups(_weight(2, 64), 8, group_size)
