"""Upload ingestion: validation against the open round (no I/O on the hot path beyond cached
lookups), then batched writes: many uploads per transaction, each with its own outcome.

Validation order, each failure a typed error naming the problem: task and round of the body
match the URL; the round exists and is open; the upload was computed at the round's version;
the scalar matrix has the plan's shape, is finite and within the hard limit (the task's clip
bound when it has one). The write then enforces one upload per device and round: a
byte-identical retry gets the original receipt, a different second upload is refused.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass, replace
from datetime import datetime

import numpy as np
from pydantic import ValidationError
from seedfed.server.aggregation import upload_digest
from seedfed.server.errors import (
    AuthenticationError,
    DuplicateUploadError,
    InvalidUploadError,
    MalformedRequestError,
    NotFoundError,
    PermissionDeniedError,
    RoundClosedError,
    RoundFullError,
    StaleVersionError,
)
from seedfed.server.orm import DeviceRow, RoundRow, RoundState, TaskRow, UploadRow, utcnow
from seedfed.server.runtime import Runtime
from seedfed.server.schemas import UploadReceipt
from seedfed.server.service.rounds import get_round, open_plan
from seedfed.shared.protocol.errors import ShapeError, WireFormatError
from seedfed.shared.protocol.wire import MAX_ROUND, Upload, encode_scalars, unpack_binary
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session


@dataclass(frozen=True)
class PendingUpload:
    task_id: str
    round_id: int
    round: int
    device_id: str | None  # None: authenticate `token_hash` in the write batch
    matrix: np.ndarray
    num_examples: int
    loss: float
    digest: str
    wire_bytes: int
    token_hash: str | None = None


def parse_json_upload(body: bytes) -> Upload:
    try:
        return Upload.model_validate_json(body)
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            raise MalformedRequestError(f"upload body is not valid JSON: "
                                        f"{e.errors()[0]['msg']}") from e
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                             for err in e.errors()[:5])
        raise WireFormatError(f"upload is not a valid Upload JSON document: {problems}") from e


def parse_binary_upload(body: bytes, *, task_id: str, round_number: int, version: int,
                        num_examples: int, loss: float) -> Upload:
    """The `application/octet-stream` form: body = wire.pack_binary(matrix), the rest from
    headers (X-Seedfed-Version, X-Seedfed-Num-Examples, X-Seedfed-Loss)."""
    m = unpack_binary(body)
    try:
        return Upload(task_id=task_id, round=round_number, version=version,
                      shape=(int(m.shape[0]), int(m.shape[1])), scalars=encode_scalars(m),
                      num_examples=num_examples, loss=loss)
    except ValidationError as e:
        raise WireFormatError(f"binary upload headers are invalid: {e.errors()[0]['msg']}") from e


def stored_receipt(rt: Runtime, *, task_id: str, round_number: int, device_id: str | None,
                   token_hash: str | None, upload: Upload) -> UploadReceipt | None:
    """The receipt of the device's stored upload to round `round_number` if `upload` is
    byte-identical to it (same digest) and the device is not revoked; else None."""
    m = upload.matrix()
    digest = upload_digest(upload.version, m, upload.num_examples, upload.loss)
    q = (select(UploadRow.digest, UploadRow.received_at, DeviceRow.id, DeviceRow.revoked_at)
         .join(RoundRow, RoundRow.id == UploadRow.round_id)
         .join(DeviceRow, DeviceRow.id == UploadRow.device_id)
         .where(RoundRow.task_id == task_id, RoundRow.number == round_number))
    q = q.where(DeviceRow.id == device_id) if device_id is not None else \
        q.where(DeviceRow.token_hash == token_hash)
    with rt.transaction() as s:
        row = s.execute(q.limit(1)).first()
    if row is None or row[0] != digest or row[3] is not None:
        return None
    rt.metrics.uploads.labels("duplicate").inc()
    return UploadReceipt(task_id=task_id, round=round_number, device_id=row[2], digest=row[0],
                         received_at=row[1])


def check_upload(rt: Runtime, *, task_id: str, round_number: int, device_id: str | None,
                 upload: Upload, wire_bytes: int, token_hash: str | None = None
                 ) -> PendingUpload | UploadReceipt:
    """Validate an upload against the open round (cached: no query on the hot path). A
    byte-identical retry to a round that has closed since returns the original receipt.

    `device_id=None` with a `token_hash` defers authentication to the write batch, which
    resolves every uncached token of the batch in one query (devices upload once a round, so
    most tokens are cold after a restart or on a device's first round).
    """
    if device_id is None and token_hash is None:
        raise ValueError("an upload needs a device id or a token hash")
    if not 0 <= round_number <= MAX_ROUND:
        raise NotFoundError(f"task {task_id!r} has no round {round_number}")
    if upload.task_id != task_id:
        raise InvalidUploadError(f"upload is for task {upload.task_id!r} but was sent to "
                                 f"task {task_id!r}")
    if upload.round != round_number:
        raise InvalidUploadError(f"upload is for round {upload.round} but was sent to round "
                                 f"{round_number}")
    hit = open_plan(rt, task_id=task_id)
    if hit is None or hit[1].round != round_number:
        # Off the hot path: the upload that reached quorum closed its round, so its device's
        # retry must still get the original receipt.
        stored = stored_receipt(rt, task_id=task_id, round_number=round_number,
                                device_id=device_id, token_hash=token_hash, upload=upload)
        if stored is not None:
            return stored
        with rt.transaction() as s:
            row = get_round(s, task_id=task_id, number=round_number)
            raise RoundClosedError(f"round {round_number} of task {task_id!r} is {row.state}, "
                                   "not open for uploads")
    round_id, plan = hit
    if upload.version != plan.version:
        raise StaleVersionError(f"upload was computed at version {upload.version}, round "
                                f"{round_number} is at version {plan.version}")
    want = (plan.steps, plan.perturbations)
    if tuple(upload.shape) != want:
        raise ShapeError(f"upload shape {list(upload.shape)} does not match the plan's "
                         f"{list(want)} (steps x perturbations)")
    m = upload.matrix()
    limit = plan.clip if plan.clip is not None else rt.settings.scalar_hard_limit
    worst = float(np.abs(m).max())
    if worst > limit:
        i, j = np.unravel_index(int(np.abs(m).argmax()), m.shape)
        raise InvalidUploadError(f"scalar {float(m[i, j])} at step {i}, perturbation {j} is "
                                 f"above the hard limit {limit}")
    return PendingUpload(task_id=task_id, round_id=round_id, round=round_number,
                         device_id=device_id, matrix=m, num_examples=upload.num_examples,
                         loss=upload.loss, digest=upload_digest(plan.version, m,
                                                                upload.num_examples, upload.loss),
                         wire_bytes=wire_bytes, token_hash=token_hash)


Outcome = UploadReceipt | Exception


def _authenticate(rt: Runtime, s: Session, pending: list[PendingUpload]
                  ) -> tuple[list[PendingUpload], list[tuple[int, Exception]]]:
    """Resolve the uncached tokens of a batch in one query; (authenticated, refusals)."""
    cold = {p.token_hash for p in pending if p.device_id is None}
    # Core rows, not ORM objects: building instances cost more than the query (profiled).
    found: dict[str, tuple[str, str, datetime | None]] = {}
    if cold:
        found = {h: (i, t, r) for i, t, h, r in s.execute(
            select(DeviceRow.id, DeviceRow.task_id, DeviceRow.token_hash, DeviceRow.revoked_at)
            .where(DeviceRow.token_hash.in_(cold)))}
    ok: list[PendingUpload] = []
    refused: list[tuple[int, Exception]] = []
    for i, p in enumerate(pending):
        if p.device_id is not None:
            ok.append(p)
            continue
        assert p.token_hash is not None
        d = found.get(p.token_hash)
        if d is None:
            refused.append((i, AuthenticationError("unknown device token")))
        elif d[2] is not None:
            refused.append((i, AuthenticationError(f"device {d[0]} has been revoked")))
        elif d[1] != p.task_id:
            refused.append((i, PermissionDeniedError(
                f"device {d[0]} is enrolled in another task, not {p.task_id!r}")))
        else:
            rt.tokens.remember(p.token_hash, d[0], d[1])
            ok.append(replace(p, device_id=d[0]))
    return ok, refused


def write_uploads(rt: Runtime, pending: list[PendingUpload]) -> list[Outcome]:
    """Insert a batch of validated uploads in one transaction; one outcome per upload (in
    order), authentication failures of deferred tokens included."""
    original = list(pending)
    out: list[Outcome] = []
    now = utcnow()
    with rt.state_lock, rt.transaction() as s:
        pending, refused = _authenticate(rt, s, pending)
        rids = {p.round_id for p in pending}
        devs = {p.device_id for p in pending}
        states: dict[int, str] = {rid: st for rid, st in s.execute(
            select(RoundRow.id, RoundRow.state).where(RoundRow.id.in_(rids)))}
        devices: dict[str, tuple[str, datetime | None]] = {i: (t, r) for i, t, r in s.execute(
            select(DeviceRow.id, DeviceRow.task_id, DeviceRow.revoked_at)
            .where(DeviceRow.id.in_(devs)))}
        seen: dict[tuple[int, str], tuple[str, datetime]] = {
            (rid, dev): (digest, at) for rid, dev, digest, at in s.execute(
                select(UploadRow.round_id, UploadRow.device_id, UploadRow.digest,
                       UploadRow.received_at)
                .where(UploadRow.round_id.in_(rids), UploadRow.device_id.in_(devs)))}
        for rid in rt.rounds.uncounted(rids):
            rt.rounds.set_count(rid, s.scalar(select(func.count()).select_from(UploadRow)
                                              .where(UploadRow.round_id == rid)) or 0)
        uncapped = rt.rounds.uncapped(rids)  # usually empty: opening a round caches it
        if uncapped:
            for rid, cap in s.execute(select(RoundRow.id, TaskRow.devices_per_round)
                                      .join(TaskRow, TaskRow.id == RoundRow.task_id)
                                      .where(RoundRow.id.in_(uncapped))):
                rt.rounds.set_cap(rid, cap)
        counts = {rid: rt.rounds.count(rid) for rid in rids}
        fresh: list[dict[str, object]] = []
        for p in pending:
            assert p.device_id is not None
            key = (p.round_id, p.device_id)
            device = devices.get(p.device_id)
            if device is None or device[0] != p.task_id:
                out.append(NotFoundError(f"task {p.task_id!r} has no device {p.device_id!r}"))
            elif device[1] is not None:
                out.append(InvalidUploadError(f"device {p.device_id} has been revoked"))
            elif key in seen:
                digest, at = seen[key]
                if digest != p.digest:
                    out.append(DuplicateUploadError(
                        f"device {p.device_id} already uploaded different scalars for round "
                        f"{p.round}; one upload per device and round"))
                else:
                    out.append(UploadReceipt(task_id=p.task_id, round=p.round,
                                             device_id=p.device_id, digest=digest,
                                             received_at=at))
            elif states.get(p.round_id) != RoundState.OPEN:
                out.append(RoundClosedError(f"round {p.round} of task {p.task_id!r} is "
                                            f"{states.get(p.round_id)}, not open for uploads"))
            elif (cap := rt.rounds.cap(p.round_id)) is not None and \
                    counts[p.round_id] >= cap:
                out.append(RoundFullError(f"round {p.round} of task {p.task_id!r} already has "
                                          f"the {cap} uploads its devices_per_round allows"))
            else:
                m = np.ascontiguousarray(p.matrix, dtype="<f4")
                fresh.append(dict(round_id=p.round_id, device_id=p.device_id,
                                  digest=p.digest, rows=m.shape[0], cols=m.shape[1],
                                  scalars=m.tobytes(), num_examples=p.num_examples,
                                  loss=p.loss, wire_bytes=p.wire_bytes, received_at=now))
                seen[key] = (p.digest, now)
                counts[p.round_id] += 1
                out.append(UploadReceipt(task_id=p.task_id, round=p.round,
                                         device_id=p.device_id, digest=p.digest,
                                         received_at=now))
        if fresh:
            s.execute(insert(UploadRow), fresh)  # one executemany
            s.execute(update(DeviceRow).where(DeviceRow.id.in_({u["device_id"] for u in fresh}))
                      .values(last_seen_at=now))
    for rid, n in counts.items():
        rt.rounds.set_count(rid, n)
    for i, err in refused:  # put the authentication failures back in request order
        pending.insert(i, original[i])
        out.insert(i, err)
    m_ = rt.metrics
    for p, o in zip(pending, out, strict=True):
        if isinstance(o, Exception):
            m_.uploads.labels("rejected").inc()
        elif o.received_at == now:
            m_.uploads.labels("accepted").inc()
            m_.bytes_in.inc(p.wire_bytes)
        else:
            m_.uploads.labels("duplicate").inc()
    return out


def count_rejected(rt: Runtime) -> None:
    """Count a refused upload request (validation or authentication failed)."""
    rt.metrics.uploads.labels("rejected").inc()


def submit_upload(rt: Runtime, *, task_id: str, round_number: int, device_id: str,
                  upload: Upload, wire_bytes: int) -> UploadReceipt:
    """Validate and store one upload (the in-process path); raises the typed error on refusal."""
    try:
        p = check_upload(rt, task_id=task_id, round_number=round_number, device_id=device_id,
                         upload=upload, wire_bytes=wire_bytes)
    except Exception:
        rt.metrics.uploads.labels("rejected").inc()
        raise
    if isinstance(p, UploadReceipt):
        return p
    (result,) = write_uploads(rt, [p])
    if isinstance(result, Exception):
        raise result
    return result


def submit_uploads(rt: Runtime, *, task_id: str,
                   uploads: list[tuple[str, Upload, int]]) -> list[Outcome]:
    """Validate and store a round's uploads, (device id, upload, wire bytes) each, in one
    transaction (the in-process path of a fleet engine that collects a round's replies
    first); one outcome per upload, in order: its receipt or the typed error refusing it."""
    checked: list[Outcome | PendingUpload] = []
    for device_id, upload, wire_bytes in uploads:
        try:
            checked.append(check_upload(rt, task_id=task_id, round_number=upload.round,
                                        device_id=device_id, upload=upload,
                                        wire_bytes=wire_bytes))
        except Exception as e:
            rt.metrics.uploads.labels("rejected").inc()
            checked.append(e)
    pending = [c for c in checked if isinstance(c, PendingUpload)]
    written = iter(write_uploads(rt, pending) if pending else [])
    return [next(written) if isinstance(c, PendingUpload) else c for c in checked]


class UploadWriter:
    """A writer thread that commits queued uploads in batches (group commit).

    Under load many uploads share one transaction, so the per-commit cost (an fsync on
    PostgreSQL, a WAL append on SQLite) is paid once per batch; each upload still gets its own
    outcome, and its response is sent only after its batch committed.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._q: queue.Queue[tuple[PendingUpload, concurrent.futures.Future[Outcome]] | None] = \
            queue.Queue()
        self._thread = threading.Thread(target=self._run, name="seedfed-upload-writer",
                                        daemon=True)
        self.batches = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def submit(self, p: PendingUpload) -> concurrent.futures.Future[Outcome]:
        fut: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
        self._q.put((p, fut))
        return fut

    def _write(self, batch: list[tuple[PendingUpload, concurrent.futures.Future[Outcome]]]
               ) -> list[Outcome]:
        """One transaction for the batch; if it fails, each upload alone, so that one row the
        database refuses fails only its own upload, never the honest ones beside it."""
        try:
            return write_uploads(self.rt, [p for p, _ in batch])
        except Exception as e:
            if len(batch) == 1:
                return [e]
        out: list[Outcome] = []
        for p, _ in batch:
            try:
                out.extend(write_uploads(self.rt, [p]))
            except Exception as e:  # this row (or the database) is at fault
                out.append(e)
        return out

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._q.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < self.rt.settings.ingest_batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            results = self._write(batch)
            self.batches += 1
            for (_, fut), r in zip(batch, results, strict=True):
                if isinstance(r, Exception):
                    fut.set_exception(r)
                else:
                    fut.set_result(r)
