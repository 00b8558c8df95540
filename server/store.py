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

Pruning is the mirror image: files are deleted only AFTER the commit that makes them unneeded.
With `Settings.keep_versions = K > 0`, the commit of version v is followed by
`prune(task_id, through=v - K)`, which deletes every file of versions 1..v-K of the task found
by listing its two directories (so files a crash left between an earlier commit and its prune
go too). Kept: version 0 (a rebuild replays the log from it), the current version (a restart
loads its master, devices download its snapshot) and the K - 1 versions before it (devices a
little behind). Files of versions above the current one (an interrupted close) are never
touched. The database keeps every version row and log entry; a read of a pruned version's
file is a NotFoundError naming the pruning (`service.log`), derived from (version, current
version, K) and the file's absence, so no column records it. K = 0 keeps everything.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from seedfed.server.errors import StoreError, StoreUnavailableError

CHUNK = 1 << 20
#: A version file or the temporary file of one: `v00000012.<kind>.safetensors[.<pid>.tmp]`.
_VERSION_FILE = re.compile(r"^\.?v(\d{8,})\.")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredFile:
    path: str  # relative to the store root
    sha256: str
    nbytes: int


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    with f:
        while chunk := f.read(CHUNK):
            yield chunk


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
        """Write `rel` atomically (temporary file, fsync, rename). A failed write (disk full,
        read-only, I/O error) removes its temporary file and raises `StoreUnavailableError`:
        the final name then holds its old content or nothing, never a partial file."""
        target = self.root / rel
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            why = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
                (errno.errorcode.get(e.errno or 0) or type(e).__name__)
            raise StoreUnavailableError(f"the model store cannot write {rel} ({why}); "
                                        "retry later") from e
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

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def iter_file(self, rel: str) -> Iterator[bytes]:
        """The file's bytes in chunks. The file is opened now (a missing file raises here,
        not halfway through a response), so a prune after this call cannot cut the stream."""
        try:
            f = open(self.root / rel, "rb")  # noqa: SIM115 - closed by the generator
        except (FileNotFoundError, IsADirectoryError) as e:
            raise StoreError(f"model store file {rel} is missing") from e
        return _chunks(f)

    def prune(self, task_id: str, *, through: int) -> list[str]:
        """Delete the files of versions 1..`through` of the task (never version 0): the
        master and published files, and temporary files a crashed write left. Lists the
        task's two directories, so leftovers of an earlier interrupted prune go as well.
        Missing files are not an error, and neither is a file that cannot be deleted (logged,
        left for the next prune): the commit that made them unneeded is already done.
        Returns the removed paths, relative to the store root."""
        removed: list[str] = []
        if through < 1:
            return removed
        for sub in ("master", "published"):
            folder = self.root / "tasks" / task_id / sub
            try:
                names = os.listdir(folder)
            except FileNotFoundError:
                continue
            except OSError as e:
                logger.warning("could not list model store folder %s: %s", folder, e)
                continue
            for name in sorted(names):
                m = _VERSION_FILE.match(name)
                if m is None or not 0 < int(m.group(1)) <= through:
                    continue
                try:
                    os.unlink(folder / name)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    logger.warning("could not prune model store file %s: %s", folder / name, e)
                    continue
                removed.append(f"tasks/{task_id}/{sub}/{name}")
        return removed
