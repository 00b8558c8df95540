"""One feature encoding per simulation: a `shared.model.features.FeatureStore` in the run directory.

A `MeanPoolClassifier` caches, per process, what the frozen encoder computes for a sentence.
A simulation runs its devices in several Ray actors (and scores in the driver), so without a
shared store every process encodes the sentences of every device it happens to serve. Because
a cached row is computed in a canonical context (`shared.model.features.FEATURE_GROUP`), a
row that one process computed is bit for bit the row any other would: sharing it changes no
device's scalars, only who pays for the encoding.

Layout: `<root>/<namespace>/<pid>-<nonce>.seg`, one append-only segment per process and model
namespace; only its owner writes it. A record is a header (`SFF1`, key length, number of
dimensions, the dimensions; little-endian uint32), the key, then the float32 row. Readers
index every segment incrementally (key -> file and offset) and read rows on demand, so the
memory of a process holds an index, not the features; a record still being written is skipped
until it is whole. Two processes that miss the same sentence at the same moment both encode it
(to the same bits); the first record read wins.

Where the store lives (`store_root`): by default a cache shared by every simulation of this
user (`SEEDFED_FEATURE_CACHE`, else `$XDG_CACHE_HOME/seedfed/features`, else
`~/.cache/seedfed/features`), so a second run over the same data and encoder reads the rows the
first one encoded (SST-2's 64k training sentences: ~3 minutes of encoding on 2 cores) instead of
encoding them again. That is safe for the same reason sharing between processes is: a namespace
names the encoder's exact weights below the cached depth and the canonical context, and a key
the sentence's exact token ids, so a row read back is the row this run would have computed
(`tests/test_simulate_seed.py` runs a fleet cold and warm to the same checksum). `run` keeps the
store in the run directory instead (one encoding per run, deleted with it).

A simulation optimization only: a device of a real fleet keeps its own cache and encodes its
own data (in the same canonical context).
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MAGIC = b"SFF1"
_HEAD = struct.Struct("<4sII")  # magic, key length, number of dimensions
_DIM = struct.Struct("<I")
#: `store_root` settings: the user's cache shared across runs, or the run directory alone.
AUTO, RUN = "auto", "run"
#: A run directory's own store (`store_root(RUN, ...)`).
RUN_DIR_NAME = "features"
#: `prefill`'s smallest chunk of sentences per job (a job loads nothing, but each chunk pays
#: one part-filled canonical group per sentence length).
PREFILL_CHUNK_MIN = 256


def store_root(setting: str, run_dir: Path) -> Path:
    """The feature store's directory for a simulation: `auto` (the user's cache, shared by
    every run), `run` (inside `run_dir`) or a directory of the caller's."""
    if setting == RUN:
        return run_dir / RUN_DIR_NAME
    if setting != AUTO:
        return Path(setting).expanduser()
    if os.environ.get("SEEDFED_FEATURE_CACHE"):
        return Path(os.environ["SEEDFED_FEATURE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "seedfed" / "features"


def _record(key: bytes, row: torch.Tensor) -> bytes:
    data = row.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
    dims = b"".join(_DIM.pack(d) for d in data.shape)
    return _HEAD.pack(MAGIC, len(key), data.ndim) + dims + key + data.tobytes()


class _Namespace:
    """One process's view of one namespace directory: its own segment and an index of all."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.own = path / f"{os.getpid()}-{secrets.token_hex(4)}.seg"
        self.index: dict[bytes, tuple[Path, int, tuple[int, ...]]] = {}
        self.offsets: dict[Path, int] = {}

    def refresh(self) -> None:
        """Index the records appended to every segment since the last refresh."""
        for seg in sorted(self.path.glob("*.seg")):
            start = self.offsets.get(seg, 0)
            with seg.open("rb") as f:
                f.seek(start)
                chunk = f.read()
            pos = 0
            while pos + _HEAD.size <= len(chunk):
                magic, klen, ndim = _HEAD.unpack_from(chunk, pos)
                if magic != MAGIC:  # a damaged file in a long-lived cache: skip the rest of it
                    log.warning("%s: not a feature segment at byte %d; its remaining rows are "
                                "ignored (they are encoded again)", seg, start + pos)
                    pos = len(chunk)
                    break
                dims_end = pos + _HEAD.size + ndim * _DIM.size
                if dims_end > len(chunk):
                    break
                shape = tuple(_DIM.unpack_from(chunk, pos + _HEAD.size + i * _DIM.size)[0]
                              for i in range(ndim))
                end = dims_end + klen + 4 * int(np.prod(shape, dtype=np.int64))
                if end > len(chunk):
                    break  # its writer has not finished it yet
                key = chunk[dims_end:dims_end + klen]
                self.index.setdefault(key, (seg, start + dims_end + klen, shape))
                pos = end
            self.offsets[seg] = start + pos

    def read(self, keys: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        out: dict[bytes, torch.Tensor] = {}
        by_file: dict[Path, list[bytes]] = {}
        for key in keys:
            if key in self.index:
                by_file.setdefault(self.index[key][0], []).append(key)
        for seg, found in by_file.items():
            with seg.open("rb") as f:
                for key in found:
                    _, offset, shape = self.index[key]
                    f.seek(offset)
                    n = int(np.prod(shape, dtype=np.int64))
                    row = np.frombuffer(f.read(4 * n), dtype="<f4").reshape(shape)
                    out[key] = torch.from_numpy(row.astype(np.float32))  # a writable copy
        return out

    def write(self, rows: Mapping[bytes, torch.Tensor]) -> None:
        records = [_record(k, v) for k, v in rows.items() if k not in self.index]
        if records:
            with self.own.open("ab") as f:  # only this process appends to its segment
                f.write(b"".join(records))


class SharedFeatures:
    """A FeatureStore over a directory, shared by every process of one simulation. Pickles as
    its path (it travels to the Ray actors inside the ClientApp); each process opens its own
    segments and index."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._spaces: dict[str, _Namespace] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.root, self._spaces = Path(state["root"]), {}

    def _space(self, namespace: str) -> _Namespace:
        if not namespace.isalnum():
            raise ValueError(f"feature namespace {namespace!r} is not a hex digest")
        if namespace not in self._spaces:
            self._spaces[namespace] = _Namespace(self.root / namespace)
        return self._spaces[namespace]

    def get(self, namespace: str, keys: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        space = self._space(namespace)
        if any(k not in space.index for k in keys):
            space.refresh()
        return space.read(keys)

    def put(self, namespace: str, rows: Mapping[bytes, torch.Tensor]) -> None:
        self._space(namespace).write(rows)


def prefill(store: SharedFeatures, spec: Any, texts: Sequence[str], workers: int,
            progress: Callable[[int, int], None] | None = None) -> int:
    """Encode `texts` (a fleet's sentences, `client.device_data.fleet_texts`) into `store`
    before the first round, in `workers` processes; returns the rows encoded. Without it the
    first round pays for the whole encoding inside the devices' first messages, which on a
    loaded machine passed the 600 s round timeout (devices then miss round 1).
    `progress(done, total)` counts sentences as chunks finish. The texts are encoded in chunks
    of similar length (few part-filled canonical groups), so the cost is the sentences',
    whatever the number of devices holding them. A no-op for a model without a feature
    cache."""
    ordered = sorted(dict.fromkeys(texts), key=len)
    if not ordered:
        return 0
    workers = max(1, workers)
    size = max(PREFILL_CHUNK_MIN, -(-len(ordered) // (4 * workers)))
    chunks = [ordered[i:i + size] for i in range(0, len(ordered), size)]
    if workers == 1 or len(chunks) == 1:
        _open_worker(str(store.root), spec.to_dict())
        try:
            return _tally(((len(c), _encode(c)) for c in chunks), len(ordered), progress)
        finally:
            _WORKER.clear()  # this process keeps no model of prefill's
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # one model per worker process (its initializer), a few chunks per worker, so the bar moves
    with ProcessPoolExecutor(min(workers, len(chunks)),
                             mp_context=multiprocessing.get_context("spawn"),
                             initializer=_open_worker,
                             initargs=(str(store.root), spec.to_dict())) as ex:
        jobs = {ex.submit(_encode, c): len(c) for c in chunks}
        return _tally(((jobs[job], job.result()) for job in as_completed(jobs)), len(ordered),
                      progress)


def _tally(encoded: Iterable[tuple[int, int]], total: int,
           progress: Callable[[int, int], None] | None) -> int:
    """The rows encoded over the chunks ((sentences, rows encoded) each), reporting the
    sentences done as each chunk finishes."""
    done = rows = 0
    for sentences, encoded_rows in encoded:
        done, rows = done + sentences, rows + encoded_rows
        if progress is not None:
            progress(done, total)
    return rows


#: A `prefill` worker's model (None: the model caches nothing), built once per process.
_WORKER: dict[str, Any] = {}


def _open_worker(root: str, spec_dict: dict[str, Any]) -> None:
    from seedfed.shared.model.classifier import pooled_classifier, share_features
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.protocol.task import TaskSpec

    torch.set_num_threads(1)  # the canonical context encodes on one thread anyway
    spec = TaskSpec.from_dict(spec_dict)
    bundle = build_model(spec, initialize=False)
    inner = pooled_classifier(bundle.model)
    if inner is None or inner.frozen_prefix == 0:
        _WORKER.update(bundle=None)
        return
    share_features(bundle.model, SharedFeatures(Path(root)))
    _WORKER.update(bundle=bundle, inner=inner, max_len=spec.max_seq_len)


def _encode(texts: Sequence[str]) -> int:
    """One chunk of sentences, encoded into the store by this worker's model."""
    from seedfed.shared.model.classifier import expect_texts

    bundle = _WORKER["bundle"]
    if bundle is None:
        return 0
    expect_texts(bundle.model, bundle.tokenizer, list(texts), _WORKER["max_len"])
    encoded = int(_WORKER["inner"].warm())
    _WORKER["inner"].clear_cache()  # the store holds them; a worker's memory stays one chunk's
    return encoded
