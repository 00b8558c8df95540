"""The shared feature store: what one process puts, another gets bit for bit; where it lives;
prefill, which encodes a fleet's sentences into it before round 1."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from seedfed.client.device_data import DeviceData, fleet_texts

from seedfed.features import (
    AUTO,
    PREFILL_CHUNK_MIN,
    RUN,
    RUN_DIR_NAME,
    SharedFeatures,
    prefill,
    store_root,
)
from seedfed.simulate.config import SimulationConfig, task_spec_for
from tests.fleet_helpers import make_tiny_sentence_bert, write_sentiment_tsv

NS = "ab12" * 16


def _rows() -> dict[bytes, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {b"pooled": torch.randn(384, generator=gen),  # a head's pooled feature
            b"states": torch.randn(7, 384, generator=gen),  # token states entering layer k
            b"tiny": torch.tensor([-0.0, 1e-45, float("inf")])}  # bits, not values


def test_rows_put_by_one_process_are_read_by_another_bit_for_bit(tmp_path: Path) -> None:
    writer = SharedFeatures(tmp_path)
    reader = pickle.loads(pickle.dumps(SharedFeatures(tmp_path)))  # as a Ray actor gets it
    rows = _rows()

    assert reader.get(NS, list(rows)) == {}
    writer.put(NS, rows)
    got = reader.get(NS, list(rows) + [b"unknown"])

    assert set(got) == set(rows)
    for key, row in rows.items():
        assert got[key].shape == row.shape
        assert torch.equal(got[key].view(torch.int32), row.view(torch.int32))


def test_a_record_still_being_written_is_skipped_until_whole(tmp_path: Path) -> None:
    writer, reader = SharedFeatures(tmp_path), SharedFeatures(tmp_path)
    writer.put(NS, {b"done": torch.ones(4)})
    segment = next((tmp_path / NS).glob("*.seg"))
    whole = segment.read_bytes()
    segment.write_bytes(whole[:-3])  # the writer is mid-record

    assert reader.get(NS, [b"done"]) == {}
    segment.write_bytes(whole)
    assert torch.equal(reader.get(NS, [b"done"])[b"done"], torch.ones(4))


def test_namespaces_are_separate_and_must_be_digests(tmp_path: Path) -> None:
    store = SharedFeatures(tmp_path)
    store.put(NS, {b"k": torch.zeros(2)})

    assert store.get("cd34" * 16, [b"k"]) == {}
    with pytest.raises(ValueError, match="namespace"):
        store.get("../elsewhere", [b"k"])


def test_a_damaged_segment_is_skipped_and_its_rows_are_missing(tmp_path: Path) -> None:
    # Arrange: a long-lived cache whose one segment was overwritten after its first record
    writer = SharedFeatures(tmp_path)
    writer.put(NS, {b"first": torch.ones(2)})
    writer.put(NS, {b"second": torch.zeros(2)})
    segment = next((tmp_path / NS).glob("*.seg"))
    data = bytearray(segment.read_bytes())
    second = data.index(b"SFF1", 4)
    data[second:second + 4] = b"XXXX"
    segment.write_bytes(bytes(data))
    # Act
    got = SharedFeatures(tmp_path).get(NS, [b"first", b"second"])
    # Assert: what precedes the damage is read; the rest is encoded again by the caller
    assert set(got) == {b"first"}


def test_the_store_lives_in_the_users_cache_unless_told_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange
    run = tmp_path / "run"
    monkeypatch.delenv("SEEDFED_FEATURE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # Act / Assert
    assert store_root(AUTO, run) == tmp_path / "xdg" / "seedfed" / "features"
    monkeypatch.setenv("SEEDFED_FEATURE_CACHE", str(tmp_path / "mine"))
    assert store_root(AUTO, run) == tmp_path / "mine"
    assert store_root(RUN, run) == run / RUN_DIR_NAME
    assert store_root(str(tmp_path / "given"), run) == tmp_path / "given"


def test_prefill_encodes_the_fleets_sentences_once_and_reports_progress(
        tmp_path: Path) -> None:
    # Arrange: 3 devices' sentences, in chunks of at most PREFILL_CHUNK_MIN
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=700))
    config = SimulationConfig(out=tmp_path / "run", data=data,
                              model=str(make_tiny_sentence_bert(tmp_path / "m")))
    spec = task_spec_for(config, ("bad", "good"))
    store, seen = SharedFeatures(tmp_path / "features"), []
    texts = fleet_texts(DeviceData(source=data, num_partitions=3))
    # Act
    first = prefill(store, spec, texts, 1, lambda done, total: seen.append((done, total)))
    again = prefill(store, spec, texts, 1)
    # Assert
    n = len(set(texts))
    chunks = -(-n // PREFILL_CHUNK_MIN)
    assert chunks > 1 and len(seen) == chunks and seen[-1] == (n, n)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert first > 0 and again == 0  # the second reads every row back from the store
