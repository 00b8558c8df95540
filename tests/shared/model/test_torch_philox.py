"""The stream in torch ops against every other definition of it, bit for bit, on each device:
the C kernel, numpy's Philox, the pure-Python Philox, the golden vectors and the conformance
kit. Words are compared as uint64 lists, z and float32 states as raw bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from seedfed.shared.model import stream
from seedfed.shared.model import torch_philox as tp
from seedfed.shared.model.conformance import replay_scope
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.model.zkernel import KERNEL
from seedfed.shared.protocol import philox
from seedfed.shared.protocol.conformance import committed_conformance, f32_value
from seedfed.shared.protocol.vectors import PHILOX_KAT, committed_vectors
from torch import nn

from tests.shared.devices import DEVICES, bits, host_stream, torch_stream

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
MASK64 = (1 << 64) - 1
#: uint64 seeds and tensor ids, weighted towards the top of the range (the sign bit of int64).
U64 = st.one_of(st.integers(0, MASK64), st.integers(MASK64 - 64, MASK64),
                st.integers(2**63 - 8, 2**63 + 8), st.sampled_from([0, 1, 2**32 - 1, 2**32]))
#: First blocks where a counter crosses 2**32, 2**63 (int64's sign) and 2**64 (the carry; a
#: run stops at block 2**64 - 1, the last a uint64 numbers: `blocks_from`).
FIRST_BLOCKS = st.one_of(st.integers(0, 2**20), st.integers(2**32 - 40, 2**32 + 40),
                         st.integers(2**63 - 40, 2**63 + 40), st.integers(MASK64 - 40, MASK64))


def blocks_from(first: int, n_blocks: int) -> int:
    """n_blocks, cut to the blocks a uint64 can number from `first`."""
    return min(n_blocks, 2**64 - first)


def as_u64(t: torch.Tensor) -> list[int]:
    return [int(w) for w in t.cpu().numpy().view(np.uint64).reshape(-1)]


def reference_words(seed: int, tid: int, first: int, n_blocks: int) -> list[int]:
    """The stream's blocks from the pure-Python Philox; a counter past 2**64 - 1 carries
    into its second word, as numpy's Philox (and the C kernel) do."""
    out: list[int] = []
    for j in range(n_blocks):
        c = first + j + 1
        out.extend(philox.philox4x64_10((c & MASK64, c >> 64 & 1, 0, 0), (seed, tid)))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KAT)
def test_philox_gives_the_random123_known_answers(device: str, counter: tuple[int, ...],
                                                  key: tuple[int, ...],
                                                  expected: tuple[int, ...]) -> None:
    words = [torch.tensor([tp.s64(c)], device=device) for c in counter]

    out = tp.philox(words, key[0], key[1])

    assert [as_u64(w)[0] for w in out] == list(expected)


@pytest.mark.parametrize("device", DEVICES)
def test_every_round_matches_the_conformance_kit(device: str) -> None:
    kit = committed_conformance()["philox"]
    answer = kit["known_answers"][2]
    counter = [torch.tensor([tp.s64(int(c, 16))], device=device) for c in answer["counter"]]
    k0, k1 = (int(k, 16) for k in answer["key"])

    for state in kit["rounds_of_known_answer_2"]:
        out = tp.philox(counter, k0, k1, rounds=state["rounds"])
        assert [f"{as_u64(w)[0]:016x}" for w in out] == state["state"], state["rounds"]


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(seed=U64, tid=U64, first=FIRST_BLOCKS, n_blocks=st.integers(1, 40))
@example(seed=MASK64, tid=MASK64, first=MASK64 - 2, n_blocks=3)  # the counter carries
@example(seed=0, tid=2**63, first=2**32 - 2, n_blocks=4)  # crosses 2**32
@example(seed=2**63, tid=1, first=2**63 - 1, n_blocks=3)  # crosses int64's sign
def test_words_equal_numpy_and_the_pure_python_philox(device: str, seed: int, tid: int,
                                                      first: int, n_blocks: int) -> None:
    n_blocks = blocks_from(first, n_blocks)
    got = as_u64(tp.words(seed, tid, first, n_blocks, device))

    assert got == reference_words(seed, tid, first, n_blocks)
    assert got == [int(w) for w in philox.stream_words(seed, tid, first, n_blocks)]


@pytest.mark.skipif(KERNEL is None, reason="C stream kernel not built")
@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(seed=U64, tid=U64, first=st.one_of(st.integers(0, 2**20),
                                          st.integers(2**32 - 40, 2**32 + 40),
                                          st.integers(2**62, 2**63 - 4096)),
       n_blocks=st.integers(1, 300))
def test_words_equal_the_c_kernel(device: str, seed: int, tid: int, first: int,
                                  n_blocks: int) -> None:
    assert KERNEL is not None
    expected = KERNEL.words(seed, tid, first, n_blocks).tolist()

    assert as_u64(tp.words(seed, tid, first, n_blocks, device)) == expected


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(seeds=st.lists(U64, min_size=1, max_size=8), tid=U64, first=FIRST_BLOCKS,
       n_blocks=st.integers(1, 20))
def test_many_seeds_in_one_evaluation_equal_one_seed_at_a_time(device: str, seeds: list[int],
                                                               tid: int, first: int,
                                                               n_blocks: int) -> None:
    n_blocks = blocks_from(first, n_blocks)
    together = tp.seeds_words(seeds, tid, first, n_blocks, device)

    for row, seed in zip(together, seeds, strict=True):
        assert as_u64(row) == reference_words(seed, tid, first, n_blocks)


@pytest.mark.parametrize("device", DEVICES)
def test_words_at_arbitrary_blocks_equal_the_pure_python_philox(device: str) -> None:
    blocks = [7, 0, 2**32 - 1, 2**32, 2**63 - 1, 2**63, MASK64 - 1, MASK64, 3]
    tid = philox.tensor_id("w")
    b = torch.tensor([tp.s64(v) for v in blocks], device=device)

    got = tp.words_at(MASK64, tid, b)

    assert as_u64(got) == [w for v in blocks for w in reference_words(MASK64, tid, v, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", committed_vectors(), ids=lambda c: f"{c['seed']}-{c['name'][:12]}")
def test_golden_vectors(device: str, case: dict) -> None:
    z = tp.signs(case["seed"], philox.tensor_id(case["name"]), len(case["z"]), device)

    assert z.device.type == device
    assert z.dtype == torch.float32
    assert [int(v) for v in z.tolist()] == case["z"]


@pytest.mark.parametrize("device", DEVICES)
def test_conformance_blocks(device: str) -> None:
    for case in committed_conformance()["blocks"]:
        seed, tid = int(case["seed"], 16), int(case["tensor_id"], 16)
        blocks = torch.tensor([tp.s64(int(b["block"], 16)) for b in case["blocks"]],
                              device=device)

        got = tp.words_at(seed, tid, blocks)

        assert [[f"{w:016x}" for w in as_u64(row)] for row in got] == \
            [b["words"] for b in case["blocks"]]


@pytest.mark.parametrize("device", DEVICES)
def test_conformance_slices_and_masked_sets(device: str) -> None:
    kit = committed_conformance()
    with torch_stream():
        for case in kit["slices"]:
            z = stream.rademacher(int(case["seed"], 16), case["name"], case["numel"],
                                  case["start"], case["stop"], device=device)
            assert z.device.type == device
            assert [int(v) for v in z.tolist()] == case["z"]
        for case in kit["masked"]:
            idx = torch.tensor(case["indices"], device=device)
            z = stream.rademacher_at(int(case["seed"], 16), case["name"], idx)
            assert z.device.type == device
            assert [int(v) for v in z.tolist()] == case["z"]


def _on(scope: Scope, device: str) -> Scope:
    """The scope's tensors moved to `device` (indices too)."""
    return Scope(nn.Module(), [
        ScopedTensor(t.name, t.tensor.detach().to(device),
                     None if t.indices is None else t.indices.to(device), t.compact)
        for t in scope])


@pytest.mark.parametrize("device", DEVICES)
def test_conformance_replay_reaches_every_checksum(device: str) -> None:
    kit = committed_conformance()["replay"]
    scope = _on(replay_scope(), device)
    assert checksum(scope) == kit["start"]["checksum"]

    with torch_stream():
        for entry in kit["log"]:
            apply_seeds(scope, [int(s, 16) for s in entry["seeds"]],
                        [f32_value(c) for c in entry["coefs"]])
            assert checksum(scope) == entry["checksum"]

    for t in scope:
        assert t.tensor.device.type == device
        assert [f"{v:08x}" for v in t.values().cpu().numpy().view(np.uint32).tolist()] == \
            kit["final_state"][t.name]


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(seed=U64, numel=st.integers(1, 5000), data=st.data(),
       scale=st.sampled_from([1.0, -0.0, 0.25, 3e38, 1e-45]))
def test_expanded_slices_equal_the_numpy_path(device: str, seed: int, numel: int,
                                              data: st.DataObject, scale: float) -> None:
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    with host_stream():
        expected = stream.rademacher(seed, "t", numel, start, stop, scale)

    with torch_stream():
        got = stream.rademacher(seed, "t", numel, start, stop, scale, device=device)

    assert torch.equal(bits(got), bits(expected))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(seed=U64, indices=st.lists(st.integers(0, 2**40), min_size=0, max_size=60),
       row_len=st.sampled_from([1, 7, 64, 255, 256, 300, 576]),
       rows=st.lists(st.integers(0, 5000), min_size=0, max_size=12))
def test_z_at_indices_and_rows_equal_the_numpy_path(device: str, seed: int, indices: list[int],
                                                    row_len: int, rows: list[int]) -> None:
    idx = np.array(indices, dtype=np.int64)
    r = np.array(rows, dtype=np.int64)
    with host_stream():
        expected_at = stream.rademacher_at(seed, "m", idx, 0.5)
        expected_rows = stream.rademacher_rows(seed, "emb", row_len, r, -2.0)

    with torch_stream():
        got_at = stream.rademacher_at(seed, "m", torch.from_numpy(idx).to(device), 0.5)
        got_rows = stream.rademacher_rows(seed, "emb", row_len, torch.from_numpy(r).to(device),
                                          -2.0)

    assert got_at.device.type == got_rows.device.type == device
    assert torch.equal(bits(got_at), bits(expected_at))
    assert torch.equal(bits(got_rows), bits(expected_rows))


@pytest.mark.parametrize("device", DEVICES)
def test_seeds_outside_uint64_are_refused(device: str) -> None:
    with pytest.raises(ValueError, match="uint64"):
        tp.words(-1, 0, 0, 1, device)
    with pytest.raises(ValueError, match="uint64"):
        tp.seeds_words([1, 2**64], 0, 0, 1, device)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_indices_are_refused(device: str) -> None:
    with torch_stream(), pytest.raises(ValueError, match="negative"):
        stream.rademacher_at(1, "m", torch.tensor([3, -1], device=device))
    with torch_stream(), pytest.raises(ValueError, match="negative"):
        stream.rademacher_rows(1, "m", 4, torch.tensor([-2], device=device))
