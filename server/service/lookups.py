"""Row lookups every service module needs (below all of them, so none imports another in a
circle): the task row, and the hash tokens are stored and found by."""

from __future__ import annotations

import hashlib

from seedfed.server.errors import NotFoundError
from seedfed.server.orm import TaskRow
from sqlalchemy.orm import Session


def hash_token(token: str) -> str:
    # Tokens are 256-bit random strings: a plain SHA-256 is enough (no dictionary to attack).
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def get_task(session: Session, *, task_id: str) -> TaskRow:
    task = session.get(TaskRow, task_id)
    if task is None:
        raise NotFoundError(f"task {task_id!r} does not exist")
    return task
