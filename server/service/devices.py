"""Devices: enrollment with one of the task's join tokens (`join_tokens.py`), revocation,
bearer-token authentication."""

from __future__ import annotations

import secrets

from seedfed.server.errors import AuthenticationError, NotFoundError, PermissionDeniedError
from seedfed.server.orm import DeviceRow, utcnow
from seedfed.server.runtime import Runtime
from seedfed.server.service.join_tokens import claim_enrolment
from seedfed.server.service.lookups import get_task, hash_token


def enroll_device(rt: Runtime, *, task_id: str, join_token: str | None) -> tuple[str, str]:
    """A new device of the task: (device_id, token). `join_token=None` is the trusted
    in-process path (the facade); over HTTP the join token is always checked."""
    device_id = secrets.token_hex(8)
    token = secrets.token_urlsafe(32)
    with rt.transaction() as s:
        get_task(s, task_id=task_id)
        via = None if join_token is None else claim_enrolment(rt, s, task_id=task_id,
                                                               join_token=join_token)
        s.add(DeviceRow(id=device_id, task_id=task_id, token_hash=hash_token(token),
                        join_token_id=via))
    rt.tokens.remember(hash_token(token), device_id, task_id)
    return device_id, token


def revoke_device(rt: Runtime, *, task_id: str, device_id: str) -> None:
    """Revoke a device: its token stops working at once (idempotent)."""
    with rt.transaction() as s:
        device = s.get(DeviceRow, device_id)
        if device is None or device.task_id != task_id:
            raise NotFoundError(f"task {task_id!r} has no device {device_id!r}")
        if device.revoked_at is None:
            device.revoked_at = utcnow()
        token_hash = device.token_hash
    rt.tokens.forget(token_hash)


def authenticate_device(rt: Runtime, *, task_id: str, token: str) -> str:
    """The device id a bearer token belongs to; refuses unknown, revoked or foreign tokens."""
    return authenticate_hash(rt, task_id=task_id, token_hash=hash_token(token))


def authenticate_hash(rt: Runtime, *, task_id: str, token_hash: str) -> str:
    """`authenticate_device` for a token already hashed (the upload path keeps the hash)."""
    cached = rt.tokens.authorize(token_hash, task_id)
    if cached is not None:
        return cached
    with rt.transaction() as s:
        device = s.query(DeviceRow).filter(DeviceRow.token_hash == token_hash).one_or_none()
        if device is None:
            raise AuthenticationError("unknown device token")
        if device.revoked_at is not None:
            raise AuthenticationError(f"device {device.id} has been revoked")
        device_id, device_task = device.id, device.task_id
    rt.tokens.remember(token_hash, device_id, device_task)
    if device_task != task_id:
        raise PermissionDeniedError(f"device {device_id} is enrolled in another task, "
                                    f"not {task_id!r}")
    return device_id


def bearer_device(rt: Runtime, *, task_id: str, authorization: str | None
                  ) -> tuple[str | None, str]:
    """(device id if the bearer token is cached, token hash) from an Authorization header,
    without a query: an uncached token is authenticated later (by the upload writer with
    its batch, or `authenticate_hash`). A cached token of another task is refused here."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("missing Authorization: Bearer <device token>")
    h = hash_token(token.strip())
    return rt.tokens.authorize(h, task_id), h
