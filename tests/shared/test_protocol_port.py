"""docs/protocol.md is enough to implement the protocol: a port written from the document alone
(`protocol_port.py`, pure Python) reproduces every section of the conformance vectors."""

from __future__ import annotations

from typing import Any

import pytest
from seedfed.shared.conformance import committed_conformance

from . import protocol_port as port

KIT = committed_conformance()


def h(x: str) -> int:
    return int(x, 16)


def test_the_port_reproduces_the_philox_known_answers_and_each_round() -> None:
    for case in KIT["philox"]["known_answers"]:
        got = port.philox([h(c) for c in case["counter"]], [h(k) for k in case["key"]])
        assert [f"{w:016x}" for w in got] == case["output"]
    ka = KIT["philox"]["known_answers"][2]
    for r in KIT["philox"]["rounds_of_known_answer_2"]:
        got = port.philox([h(c) for c in ka["counter"]], [h(k) for k in ka["key"]], r["rounds"])
        assert [f"{w:016x}" for w in got] == r["state"], f"round {r['rounds']}"


def test_the_port_reproduces_tensor_ids_and_far_blocks() -> None:
    for t in KIT["tensor_ids"]:
        assert f"{port.tensor_id(t['name']):016x}" == t["tensor_id"]
        assert (port.tensor_id(t["name"]) >= 1 << 63) == t["at_least_2_63"]
    for case in KIT["blocks"]:
        for b in case["blocks"]:
            got = port.block(h(case["seed"]), h(case["tensor_id"]), h(b["block"]))
            assert [f"{w:016x}" for w in got] == b["words"]


def test_the_port_reproduces_slices_masked_sets_and_the_first_blocks() -> None:
    for s in KIT["slices"]:
        assert port.z_slice(h(s["seed"]), s["name"], s["start"], s["stop"]) == s["z"]
    for m in KIT["masked"]:
        assert port.z_at(h(m["seed"]), m["name"], m["indices"]) == m["z"]


@pytest.mark.parametrize("i", range(len(KIT["projected_gradients"])))
def test_the_port_reproduces_the_device_scalar(i: int) -> None:
    c = KIT["projected_gradients"][i]
    g = port.projected_gradient(c["loss_plus"], c["loss_minus"], c["eps"], c["one_sided"],
                                c["clip"])
    assert port.bits32(g) == c["g"]


def test_the_port_reproduces_the_coefficient_rule() -> None:
    for c in KIT["coefficients"]:
        coef = port.coefficient(port.from_bits32(c["g"]), c["lr"], c["perturbations"])
        assert port.bits32(coef) == c["coef"], c


def test_the_port_reproduces_the_checksums() -> None:
    for c in KIT["checksums"]:
        state = {k: [port.from_bits32(v) for v in vs] for k, vs in c["state"].items()}
        assert port.checksum(state) == c["checksum"]


def _state(d: dict[str, list[str]]) -> dict[str, list[float]]:
    return {k: [port.from_bits32(v) for v in vs] for k, vs in d.items()}


def test_the_port_replays_the_recorded_log_with_every_checksum() -> None:
    r: dict[str, Any] = KIT["replay"]
    state = _state(r["start"]["state"])
    masks = {k: m["indices"] for k, m in r["start"]["masked"].items()}
    assert port.canonical(list(state)) == r["start"]["canonical_order"]
    assert port.checksum(state) == r["start"]["checksum"]
    for e in r["log"]:
        coefs = [port.coefficient(port.from_bits32(g), e["lr"], e["perturbations"])
                 for g in e["g"]]
        assert [port.bits32(c) for c in coefs] == e["coefs"]
        port.apply_entry(state, masks, [h(s) for s in e["seeds"]], coefs)
        assert port.checksum(state) == e["checksum"], f"after entry {e['base_version']}"
    assert {k: [port.bits32(v) for v in vs] for k, vs in state.items()} == r["final_state"]


def test_the_port_aggregates_with_every_rule() -> None:
    a = KIT["aggregation"]
    for c in a["cases"]:
        g = [[port.from_bits32(v) for v in row] for row in c["g"]]
        agg = port.aggregate(g, c["num_examples"], c["rule"], c["clip_bound"], c["trim"],
                             c["max_num_examples"])
        assert [port.bits64(v) for v in agg] == [x["bits"] for x in c["aggregate"]], c["rule"]
        coefs = [port.coefficient(v, a["lr"], a["perturbations"]) for v in agg]
        assert [port.bits32(v) for v in coefs] == c["coefs"]


def test_the_port_encodes_and_refuses_binary_uploads() -> None:
    b = KIT["binary_upload"]
    m = [[port.from_bits32(v) for v in row] for row in b["scalars"]]
    assert port.pack(m).hex() == b["body"]
    assert port.unpack(bytes.fromhex(b["body"])) == m
    for bad in b["invalid"]:
        with pytest.raises(ValueError):
            port.unpack(bytes.fromhex(bad["body"]))


def test_a_wrong_sort_order_would_be_caught_by_the_replay_vectors() -> None:
    # Arrange: UTF-16 code-unit order, what Kotlin's and Java's String.compareTo give
    names = KIT["replay"]["start"]["canonical_order"]

    def utf16(n: str) -> bytes:
        return n.encode("utf-16-be")

    # Act / Assert: the vectors' names tell that order apart from code-point order
    assert sorted(names, key=utf16) != names
    assert sorted(names, key=str.lower) != names


def test_the_port_reproduces_the_stream_vectors_of_protocol_vectors() -> None:
    # `seedfed protocol vectors` (and `--all`'s "stream" section): the first block of each case
    from seedfed.shared.vectors import committed_vectors

    for case in committed_vectors():
        assert f"{port.tensor_id(case['name'])}" == str(case["tensor_id"])
        assert port.z_slice(case["seed"], case["name"], 0, len(case["z"])) == case["z"]
