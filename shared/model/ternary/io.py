"""Reading and writing checksummed safetensors files, one tensor at a time.

The files are plain safetensors (any safetensors reader opens them). The metadata carries
`checksum`: SHA-256 over the tensors in sorted name order, each as UTF-8 name, NUL, dtype name
(e.g. "uint8"), NUL, shape as a decimal list (e.g. "[4, 8]"), NUL, then its raw little-endian
bytes -- the same layout `seedfed.shared.model.quant` uses for its files.

The reader streams: it reads each tensor straight into its own buffer with plain file reads
(no memory map, whose touched pages would count as resident a second time), hashes it, and
keeps it or drops it. A device thus loads a model at the size of the model, checks every byte,
and can skip tensors it does not need (an inference-only device skips the masked latents)
while still verifying them. Truncation and bad headers are found before any tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from seedfed.shared.model.tensorfile import checksum_prefix, recorded_checksum, tensors_checksum
from seedfed.shared.model.ternary.errors import TernaryChecksumError, TernaryFormatError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
#: A header larger than this is not one we wrote (guards a corrupt length field).
MAX_HEADER_BYTES = 64 * 1024 * 1024
#: Read size when verifying a tensor the caller does not keep.
SKIP_CHUNK_BYTES = 4 * 1024 * 1024


def write_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor],
                  metadata: Mapping[str, str]) -> Path:
    """Write tensors + metadata + checksum atomically (temporary file, then rename)."""
    path = Path(path)
    contiguous = {k: v.detach().contiguous() for k, v in tensors.items()}
    meta = dict(metadata)
    meta["checksum"] = tensors_checksum(contiguous)
    tmp = path.with_name(path.name + ".tmp")
    save_file(contiguous, str(tmp), metadata=meta)
    tmp.replace(path)  # a crash mid-write never leaves a half file under the real name
    return path


def _header(f: Any, path: Path, size: int) -> tuple[dict[str, Any], dict[str, str]]:
    head = f.read(8)
    if len(head) < 8:
        raise TernaryFormatError(f"{path}: {size} bytes is too short for a safetensors header")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise TernaryFormatError(f"{path}: header length {n} exceeds the file ({size} bytes); "
                                 "truncated or corrupt")
    try:
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(header, dict) or not isinstance(meta, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise TernaryFormatError(f"{path}: unreadable safetensors header: {e}") from e
    return header, meta


def read_tensors(path: str | Path, *, expected_format: str,
                 keep: Callable[[str], bool] | None = None,
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (those `keep` accepts) and metadata of a checksummed file, every byte verified."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed below; the body is long)
    except OSError as e:
        raise TernaryFormatError(f"{path}: cannot open: {e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        header, meta = _header(f, path, size)
        recorded = recorded_checksum(path, meta, expected_format, TernaryFormatError)
        base = f.tell()
        plan = [(name, *_entry(path, name, info, size - base)) for name, info in header.items()]
        h = hashlib.sha256()
        out: dict[str, torch.Tensor] = {}
        scratch = bytearray(SKIP_CHUNK_BYTES)  # one reused buffer to verify skipped tensors
        for name, dtype, shape, start, nbytes in sorted(plan):
            f.seek(base + start)
            h.update(checksum_prefix(name, dtype, shape))
            if keep is not None and not keep(name):
                _hash_skipped(f, h, scratch, nbytes, path, name)
                continue
            buf = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(buf.numpy())  # type: ignore[arg-type]
            got = f.readinto(view) if nbytes else 0
            if got != nbytes:
                raise TernaryFormatError(f"{path}: {name} is truncated ({got} of {nbytes} bytes)")
            h.update(view)
            out[name] = buf.view(dtype).reshape(shape)
    digest = h.hexdigest()
    if digest != recorded:
        raise TernaryChecksumError(f"{path}: tensors hash to {digest[:16]}..., metadata says "
                                   f"{recorded[:16]}...; the file is corrupt, fetch it again")
    return out, meta


def _hash_skipped(f: Any, h: Any, scratch: bytearray, nbytes: int, path: Path,
                  name: str) -> None:
    # Skipped tensors never get their own allocation: freed buffers of many sizes would stay
    # in the allocator's heap and count as resident, inflating an inference-only load.
    view = memoryview(scratch)
    left = nbytes
    while left:
        got = f.readinto(view[: min(left, len(scratch))])
        if not got:
            raise TernaryFormatError(f"{path}: {name} is truncated ({nbytes - left} of {nbytes} "
                                     "bytes)")
        h.update(view[:got])
        left -= got


def _entry(path: Path, name: str, info: Any, data_size: int,
           ) -> tuple[torch.dtype, list[int], int, int]:
    try:
        dtype = _DTYPES[info["dtype"]]
        shape = [int(s) for s in info["shape"]]
        start, stop = (int(v) for v in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise TernaryFormatError(f"{path}: bad header entry for {name}: {info!r}") from e
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not 0 <= start <= stop or stop - start != nbytes:
        raise TernaryFormatError(f"{path}: {name} spans [{start}, {stop}) but {dtype} {shape} "
                                 f"needs {nbytes} bytes")
    if stop > data_size:
        raise TernaryFormatError(f"{path}: {name} ends at byte {stop} of a {data_size}-byte data "
                                 "section; the file is truncated")
    return dtype, shape, start, nbytes
