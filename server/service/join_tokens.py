"""Join tokens: how devices enroll in a task. Each task has one or more (rotation makes a new
one and revokes the others); each enrolls at most `max_devices` devices, so a leaked token
cannot flood a task with devices. Tokens are 192-bit random strings stored as SHA-256."""

from __future__ import annotations

import secrets

from seedfed.server.errors import AuthenticationError, NotFoundError, PermissionDeniedError
from seedfed.server.orm import JoinTokenRow, utcnow
from seedfed.server.runtime import Runtime
from seedfed.server.service.lookups import get_task, hash_token
from sqlalchemy import select, update
from sqlalchemy.orm import Session


def new_join_token(s: Session, *, task_id: str, max_devices: int | None) -> tuple[str, str]:
    """Add a join token to the task in session `s`: (token id, token shown once)."""
    token_id, token = secrets.token_hex(8), secrets.token_urlsafe(24)
    s.add(JoinTokenRow(id=token_id, task_id=task_id, token_hash=hash_token(token),
                       max_devices=max_devices, enrolled=0, created_at=utcnow()))
    return token_id, token


def create_join_token(rt: Runtime, *, task_id: str, max_devices: int | None = None,
                      revoke_others: bool = True) -> tuple[str, str, list[str]]:
    """A new join token (rotation when `revoke_others`): (id, token, ids revoked)."""
    with rt.transaction() as s:
        get_task(s, task_id=task_id)
        revoked: list[str] = []
        if revoke_others:
            revoked = list(s.scalars(select(JoinTokenRow.id).where(
                JoinTokenRow.task_id == task_id, JoinTokenRow.revoked_at.is_(None))))
            s.execute(update(JoinTokenRow).where(JoinTokenRow.id.in_(revoked))
                      .values(revoked_at=utcnow()))
        token_id, token = new_join_token(s, task_id=task_id, max_devices=max_devices)
    return token_id, token, revoked


def list_join_tokens(session: Session, *, task_id: str) -> list[JoinTokenRow]:
    get_task(session, task_id=task_id)
    return list(session.scalars(select(JoinTokenRow).where(JoinTokenRow.task_id == task_id)
                                .order_by(JoinTokenRow.created_at, JoinTokenRow.id)))


def revoke_join_token(rt: Runtime, *, task_id: str, token_id: str) -> None:
    """Stop a join token enrolling devices (idempotent); its devices stay enrolled."""
    with rt.transaction() as s:
        row = s.get(JoinTokenRow, token_id)
        if row is None or row.task_id != task_id:
            get_task(s, task_id=task_id)
            raise NotFoundError(f"task {task_id!r} has no join token {token_id!r}")
        if row.revoked_at is None:
            row.revoked_at = utcnow()


def effective_limit(rt: Runtime, max_devices: int | None) -> int:
    """Devices a join token with limit `max_devices` enrolls (None: the Settings default)."""
    return rt.settings.max_devices_per_join_token if max_devices is None else max_devices


def limit_of(rt: Runtime, row: JoinTokenRow) -> int:
    return effective_limit(rt, row.max_devices)


def valid_join_token(s: Session, *, task_id: str, join_token: str) -> JoinTokenRow:
    """The row of `join_token` if it is a join token of the task that is not revoked; else
    AuthenticationError. Reads only: a device checks its token (and reads the task) before it
    enrolls."""
    row = s.scalars(select(JoinTokenRow).where(
        JoinTokenRow.token_hash == hash_token(join_token))).first()
    # The lookup is by the hash of a 192-bit random token: its timing reveals nothing usable.
    if row is None or row.task_id != task_id:
        raise AuthenticationError(f"wrong join token for task {task_id!r}")
    if row.revoked_at is not None:
        raise AuthenticationError(f"this join token of task {task_id!r} has been revoked")
    return row


def accepts(rt: Runtime, *, task_id: str, join_token: str) -> bool:
    """Whether `join_token` would enroll a device of the task now (not counting its limit)."""
    with rt.transaction() as s:
        try:
            valid_join_token(s, task_id=task_id, join_token=join_token)
        except AuthenticationError:
            return False
    return True


def claim_enrolment(rt: Runtime, s: Session, *, task_id: str, join_token: str) -> str:
    """Check `join_token` for the task and count one enrolment against its limit, atomically
    (a conditional UPDATE, so concurrent enrolments cannot pass the limit). Its id."""
    row = valid_join_token(s, task_id=task_id, join_token=join_token)
    cap = limit_of(rt, row)
    moved = s.execute(update(JoinTokenRow).where(
        JoinTokenRow.id == row.id, JoinTokenRow.enrolled < cap).values(
        enrolled=JoinTokenRow.enrolled + 1)).rowcount  # type: ignore[attr-defined]
    if moved != 1:
        raise PermissionDeniedError(f"this join token of task {task_id!r} has enrolled the "
                                    f"{cap} devices it allows; ask the operator for a new one")
    return row.id
