from __future__ import annotations

from pathlib import Path

import pytest
import torch
from seedfed.server.errors import InvalidTaskError, StoreError
from seedfed.server.formats import publisher, register_format
from seedfed.server.store import ModelStore


def test_state_round_trips_with_metadata_and_sha(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    state = {"b": torch.arange(5, dtype=torch.float32), "a": torch.ones(3)}

    f = store.write_state("t1", 3, "master", state, {"checksum": "abc"})

    back = store.read_state(f.path, f.sha256)
    assert f.path == "tasks/t1/master/v00000003.safetensors"
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert f.nbytes == (tmp_path / f.path).stat().st_size
    assert b"".join(store.iter_file(f.path)) == (tmp_path / f.path).read_bytes()
    assert not list((tmp_path / "tasks/t1/master").glob("*.tmp"))


def test_a_tampered_or_missing_file_is_refused(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    f = store.write_state("t1", 0, "master", {"a": torch.ones(2)}, {})
    (tmp_path / f.path).write_bytes(b"garbage")

    with pytest.raises(StoreError, match="does not match its recorded SHA-256"):
        store.read_bytes(f.path, f.sha256)
    with pytest.raises(StoreError, match="missing"):
        store.read_bytes("tasks/none.safetensors")


def test_formats_cast_and_unknown_formats_name_the_known_ones() -> None:
    state = {"w": torch.tensor([1.0, 1.0 + 2**-12])}

    assert publisher("bf16")(state, None)["w"].dtype == torch.bfloat16
    assert publisher("fp16")(state, None)["w"].dtype == torch.float16
    with pytest.raises(InvalidTaskError, match="unknown snapshot format 'int3'.*fp32"):
        publisher("int3")


def test_a_registered_format_plugs_in() -> None:
    @register_format("test-negated")
    def _neg(state, _scope):  # type: ignore[no-untyped-def]
        return {k: -v for k, v in state.items()}

    out = publisher("test-negated")({"w": torch.ones(2)}, None)

    assert torch.equal(out["w"], -torch.ones(2))
