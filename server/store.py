"""The model store: safetensors files of each task's trainable state, one per version.

Layout under the store directory (paths in the database are relative to it):

    tasks/<task_id>/master/v00000012.safetensors          fp32 master (what replay produces)
    tasks/<task_id>/published/v00000012.<format>.safetensors  snapshot in the task's format

A state file maps each canonical scope tensor name to the flat float32 values the scope covers
(exactly `Scope.read()`), so a device loads it with
`scope.write(safetensors.torch.load(data))` and checks `replay.checksum(scope)` against the
checksum header. The file metadata repeats task id, version, format and checksum. (A master file
holds `Scope.master_state()`, which is `read()` for every scope but `ternary`: there it is every
latent plus gammas, masks and the mask epoch, so a restart can rebuild a later mask epoch.)

Files are written to a temporary name, fsynced and renamed into place (then the directory is
fsynced) BEFORE the database commit that references them: a crash leaves at worst an orphan
file that the next attempt overwrites, never a row pointing at a missing or partial file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import StoreError

CHUNK = 1 << 20


@dataclass(frozen=True)
class StoredFile:
    path: str  # relative to the store root
    sha256: str
    nbytes: int


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems refuse directory fds; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ModelStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _rel(self, task_id: str, version: int, kind: str) -> str:
        if kind == "master":
            return f"tasks/{task_id}/master/v{version:08d}.safetensors"
        return f"tasks/{task_id}/published/v{version:08d}.{kind}.safetensors"

    def path(self, rel: str) -> Path:
        return self.root / rel

    def write_bytes(self, rel: str, data: bytes) -> StoredFile:
        target = self.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        return StoredFile(rel, hashlib.sha256(data).hexdigest(), len(data))

    def write_state(self, task_id: str, version: int, kind: str,
                    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> StoredFile:
        data = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=dict(metadata))
        return self.write_bytes(self._rel(task_id, version, kind), data)

    def read_bytes(self, rel: str, sha256: str | None = None) -> bytes:
        try:
            data = (self.root / rel).read_bytes()
        except FileNotFoundError as e:
            raise StoreError(f"model store file {rel} is missing") from e
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise StoreError(f"model store file {rel} does not match its recorded SHA-256")
        return data

    def read_state(self, rel: str, sha256: str | None = None) -> dict[str, torch.Tensor]:
        return st_load(self.read_bytes(rel, sha256))

    def iter_file(self, rel: str) -> Iterator[bytes]:
        path = self.root / rel
        if not path.is_file():
            raise StoreError(f"model store file {rel} is missing")
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def remove_task(self, task_id: str) -> None:
        import shutil

        shutil.rmtree(self.root / "tasks" / task_id, ignore_errors=True)
