"""docs/protocol.md is enough to implement the protocol: a port written from the document alone
(`protocol_port.py`, pure Python) reproduces every section of the conformance vectors."""

from __future__ import annotations

from typing import Any

import pytest
from seedfed.shared.protocol.conformance import committed_conformance

from tests.shared import protocol_port as port

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
        assert port.weights(c["num_examples"], c["rule"], c["max_num_examples"],
                            c["max_weight_ratio"]) == c["weights"]
        agg = port.aggregate(g, c["num_examples"], c["rule"], c["clip_bound"], c["trim"],
                             c["max_num_examples"], c["max_weight_ratio"])
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
    from seedfed.shared.protocol.vectors import committed_vectors

    for case in committed_vectors():
        assert f"{port.tensor_id(case['name'])}" == str(case["tensor_id"])
        assert port.z_slice(case["seed"], case["name"], 0, len(case["z"])) == case["z"]


# -- section 6: the published formats and a ternary device's layer ------------------------------
def _f32s(values: list[str]) -> list[float]:
    return [port.from_bits32(v) for v in values]


def test_the_port_rounds_float32_to_fp16_and_bf16() -> None:
    for c in KIT["published"]["casts"]:
        x = port.from_bits32(c["f32"])
        assert (port.f16_bits(x), port.bf16_bits(x)) == (c["f16"], c["bf16"]), c


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_port_publishes_and_decodes_the_group_wise_formats(fmt: str) -> None:
    pub, bits = KIT["published"], 8 if fmt == "int8" else 4
    group, files = pub["group_size"], pub[fmt]["tensors"]
    for name, t in pub["state"].items():
        values, shape = _f32s(t["values"]), t["shape"]
        if len(shape) != 2 or shape[1] < group:  # stays float32, flat
            assert files[name]["dtype"] == "F32" and _f32s(files[name]["values"]) == values
            assert pub[fmt]["decoded"][name] == t["values"]
            continue
        rows = [values[r * shape[1]:(r + 1) * shape[1]] for r in range(shape[0])]
        codes, scales = port.quantize_group_rows(rows, bits, group)
        stored = files[f"{name}.codes"]
        flat = [c for row in codes for c in row]
        if bits == 4:
            assert stored["dtype"] == "U8" and stored["values"] == port.pack_nibbles(flat)
            assert port.unpack_nibbles(stored["values"]) == flat
        else:
            assert stored["dtype"] == "I8" and stored["values"] == flat
        assert [port.bits32(s) for row in scales for s in row] == \
            files[f"{name}.scales"]["values"]
        decoded = port.dequantize_rows(codes, scales, shape[1], group)
        assert [port.bits32(v) for v in decoded] == pub[fmt]["decoded"][name], name


def test_the_port_reads_a_published_snapshot_file() -> None:
    f = KIT["published"]["file"]

    tensors, meta = port.read_safetensors(bytes.fromhex(f["bytes"]))

    assert meta == f["metadata"]
    assert set(tensors) == set(f["tensors"])
    for name, (dtype, shape, values) in tensors.items():
        want = f["tensors"][name]
        assert (dtype, shape) == (want["dtype"], want["shape"])
        got = [port.bits32(v) for v in values] if dtype == "F32" else values
        assert got == want["values"], name


def test_the_port_builds_and_loads_a_ternary_layer() -> None:
    t = KIT["ternary"]
    latents, (out, n_in), layer = _f32s(t["latents"]), t["shape"], t["layer"]
    files = t["tensors"]

    gamma = port.ternary_gamma(latents)
    q = [port.ternarize(w, gamma) for w in latents]
    mask = port.threshold_mask(latents, gamma, t["mask_fraction"])
    loaded = port.unpack_ternary(files[f"{layer}.packed"]["values"], out * n_in)
    masked = _f32s(files[f"{layer}.latent"]["values"])
    for i, w in zip(files[f"{layer}.mask"]["values"], masked, strict=True):
        loaded[i] = port.ternarize(w, port.from_bits32(files[f"{layer}.gamma"]["values"][0]))

    assert port.bits32(gamma) == t["gamma"] == files[f"{layer}.gamma"]["values"][0]
    assert q == t["q"] == loaded
    assert port.pack_ternary(q) == files[f"{layer}.packed"]["values"]
    assert mask == files[f"{layer}.mask"]["values"]
    assert [port.bits32(latents[i]) for i in mask] == files[f"{layer}.latent"]["values"]
    assert [port.bits32(port.f32(gamma * v)) for v in loaded] == t["effective_weight"]
    state = {f"{layer}.weight": masked}
    head = {"classifier.weight": _f32s(files["classifier.weight"]["values"])}
    assert port.checksum(state) == t["checksum"]
    assert port.checksum({**state, **head}) == t["checksum_with_head"]


def test_the_port_fake_quantizes_activations() -> None:
    a = KIT["ternary"]["activations"]
    for row, want in zip(a["x"], a["quantized"], strict=True):
        got = port.quantize_activations(_f32s(row), a["act_bits"])
        assert [port.bits32(v) for v in got] == want


def test_a_packed_byte_holding_the_invalid_code_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid"):
        port.unpack_ternary([0b11_01_01_01], 4)
