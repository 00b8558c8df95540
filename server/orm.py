"""SQLAlchemy 2.x typed ORM: tasks, devices, rounds, uploads, device metrics and model versions
(the log).

The schema itself is owned by the Alembic migrations in `migrations/`; these classes must match
them (a test compares the two).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the offset)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value} given; use timezone-aware UTC")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class Schedule:
    """Who opens a task's rounds (`TaskRow.schedule`)."""

    #: the coordinator: the next round opens as soon as the last one ended (closed, expired or
    #: abandoned), once the task has an enrolled device, until `TaskRow.max_rounds` versions
    AUTO = "auto"
    #: an operator or a driver (the Flower ServerApp): only `POST .../rounds` opens a round
    MANUAL = "manual"


class RoundState:
    OPEN = "open"
    AGGREGATING = "aggregating"
    CLOSED = "closed"
    EXPIRED = "expired"  # deadline passed with no upload: closed without a new version
    #: ended without a new version, its uploads not aggregated: planned at a base version the
    #: task has since moved past (it can never commit), or abandoned by an operator (a round
    #: whose close cannot succeed); `RoundRow.abandon_reason` says which
    ABANDONED = "abandoned"


class TaskRow(Base):
    __tablename__ = "tasks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    spec_json: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(16))
    quorum: Mapped[int] = mapped_column(Integer)
    round_timeout_s: Mapped[float] = mapped_column(Float)
    devices_per_round: Mapped[int | None] = mapped_column(Integer, nullable=True)
    join_token_hash: Mapped[str] = mapped_column(String(64))
    #: Secret that seeds the round seeds and the DP noise: aggregation is deterministic given
    #: the stored rows (so recovery recomputes the same entry) yet unpredictable to devices.
    secret: Mapped[str] = mapped_column(String(64))
    current_version: Mapped[int] = mapped_column(Integer, default=0)
    scope_numel: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    #: `Schedule.AUTO` or `Schedule.MANUAL` (rows from before 0004: manual, as they ran).
    schedule: Mapped[str] = mapped_column(String(16), default=Schedule.AUTO)
    #: The automatic schedule stops once the task's version reaches this (None: never).
    max_rounds: Mapped[int | None] = mapped_column(Integer, nullable=True)


class JoinTokenRow(Base):
    """A join token of a task (stored hashed). Devices enroll with it until it is revoked or
    has enrolled `max_devices` (None: `Settings.max_devices_per_join_token`); rotating a
    task's token creates a new row and revokes the others. Revoking a token does not revoke
    the devices it enrolled. (`TaskRow.join_token_hash` keeps the first token's hash only for
    databases from before this table; enrolment reads this table.)"""

    __tablename__ = "join_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    max_devices: Mapped[int | None] = mapped_column(Integer, nullable=True)
    enrolled: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class DeviceRow(Base):
    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: The join token it enrolled with (None: the in-process facade, or enrolled before 0002).
    join_token_id: Mapped[str | None] = mapped_column(String(32), nullable=True)


class RoundRow(Base):
    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("task_id", "number", name="uq_rounds_task_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    base_version: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=RoundState.OPEN)
    plan_json: Mapped[str] = mapped_column(Text)
    quorum: Mapped[int] = mapped_column(Integer)
    deadline: Mapped[datetime] = mapped_column(UTCDateTime)
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    participants: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    upload_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    aggregation_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    result_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Why an abandoned round ended (the operator's reason, or the stale base).
    abandon_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class UploadRow(Base):
    __tablename__ = "uploads"
    __table_args__ = (UniqueConstraint("round_id", "device_id", name="uq_uploads_round_device"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"))
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    digest: Mapped[str] = mapped_column(String(64))
    rows: Mapped[int] = mapped_column(Integer)
    cols: Mapped[int] = mapped_column(Integer)
    scalars: Mapped[bytes] = mapped_column(LargeBinary)  # float32 LE row-major
    num_examples: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float] = mapped_column(Float)
    wire_bytes: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class DeviceMetricsRow(Base):
    """A device's held-out scores for a round (`shared.wire.DeviceMetrics`; numbers only):
    one row per device and round, a later report replacing the earlier one. A row of its own,
    not a JSON column of the round, so that a report is one atomic upsert (no read-modify-write
    of the whole fleet's scores) and the fleet's statistics are one query."""

    __tablename__ = "device_metrics"
    __table_args__ = (UniqueConstraint("round_id", "device_id",
                                       name="uq_device_metrics_round_device"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"))
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)  # the shared version the device scored
    num_examples: Mapped[int] = mapped_column(Integer)
    shared_accuracy: Mapped[float] = mapped_column(Float)
    personal_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    local_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    reported_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class VersionRow(Base):
    """Model version `version` of a task; for version > 0 also the log entry that made it."""

    __tablename__ = "versions"

    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"),
                                         primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    seeds_json: Mapped[str] = mapped_column(Text, default="[]")
    coefs: Mapped[bytes] = mapped_column(LargeBinary, default=b"")  # float32 LE
    checksum: Mapped[str] = mapped_column(String(64))
    master_path: Mapped[str] = mapped_column(String(400))
    master_sha256: Mapped[str] = mapped_column(String(64))
    master_bytes: Mapped[int] = mapped_column(BigInteger)
    snapshot_path: Mapped[str] = mapped_column(String(400))
    snapshot_sha256: Mapped[str] = mapped_column(String(64))
    snapshot_bytes: Mapped[int] = mapped_column(BigInteger)
    noise_std: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


Index("ix_rounds_task_state", RoundRow.task_id, RoundRow.state)
Index("ix_uploads_round", UploadRow.round_id)
