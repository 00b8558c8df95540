"""Process-wide state of one coordinator: database, model store, loaded masters, caches, metrics.

One coordinator process owns a database at a time (the caches and the state lock are
in-process); run one process per database. The service functions receive this object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from seedfed.server.caches import CloseFailure, CloseFailures, OpenRounds, TokenCache
from seedfed.server.db import make_engine, session_factory, upgrade
from seedfed.server.errors import DatabaseUnavailableError
from seedfed.server.settings import Settings
from seedfed.server.store import ModelStore
from seedfed.shared.model.factory import ModelBundle
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker


def database_unavailable(e: DBAPIError) -> DatabaseUnavailableError:
    """The typed error of a database outage. Its message names the driver's error type only:
    the driver's text can hold the database's address, and callers need not be authenticated;
    the log line gets the cause (`app._domain_error`)."""
    return DatabaseUnavailableError(
        f"the database is unavailable ({type(e.orig or e).__name__}); retry later")


class Metrics:
    """Prometheus metrics on a registry of their own (several coordinators per test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds_opened = Counter("seedfed_rounds_opened", "Rounds opened", registry=r)
        self.rounds_closed = Counter("seedfed_rounds_closed", "Rounds closed with a new version",
                                     registry=r)
        self.rounds_expired = Counter("seedfed_rounds_expired",
                                      "Rounds that reached their deadline without uploads",
                                      registry=r)
        self.uploads = Counter("seedfed_uploads", "Upload requests by result", ["result"],
                               registry=r)
        self.bytes_in = Counter("seedfed_bytes_in", "Upload bytes accepted", registry=r)
        self.bytes_out = Counter("seedfed_bytes_out", "Plan, log and snapshot bytes served",
                                 ["kind"], registry=r)
        self.aggregation_seconds = Histogram(
            "seedfed_aggregation_seconds", "Time to aggregate a round and commit its version",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r)


@dataclass
class Master:
    """The fp32 master model of a task, standing at `version`."""

    bundle: ModelBundle
    version: int
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Faults:
    """Test hooks that simulate a crash at a named point of the round close."""

    after_files: Callable[[], None] | None = None  # files written, commit not yet done
    mid_aggregation: Callable[[int], None] | None = None  # called with each seed index


__all__ = ["CloseFailure", "Faults", "Master", "Metrics", "Runtime", "database_unavailable"]


class Runtime:
    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.engine = engine or make_engine(settings.database_url, echo=settings.echo_sql)
        if settings.run_migrations:
            upgrade(self.engine)
        self.sessions: sessionmaker[Session] = session_factory(self.engine)
        self.store = ModelStore(settings.store_dir)
        self.metrics = Metrics()
        self.faults = Faults()
        #: Serializes round state transitions with upload writes: an upload is accepted only
        #: if committed while its round is open, and a close sees every accepted upload.
        self.state_lock = threading.RLock()
        self._masters: OrderedDict[str, Master] = OrderedDict()
        self._masters_lock = threading.Lock()
        self._task_locks: dict[str, threading.Lock] = {}
        #: Device tokens known to be valid (revoked devices are never cached).
        self.tokens = TokenCache()
        #: Each task's open round: plan, upload count, cap (the upload path's hot data).
        self.rounds = OpenRounds()
        #: Failing round closes, retried by the ticker.
        self.close_failures = CloseFailures()
        #: Task id -> the error that kept the schedule from opening its next round (each
        #: logged once; cleared when a round opens).
        self.open_errors: dict[str, str] = {}

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One unit of work: commit on success, roll back on any exception.

        A lost or refused connection, or a lock held past the busy timeout, becomes a typed
        `DatabaseUnavailableError` (503): the unit of work was rolled back as a whole, so the
        caller may repeat the same request once the database is back."""
        try:
            with self.sessions() as session, session.begin():
                yield session
        except DBAPIError as e:
            # The unit of work may have moved the plan cache before its commit failed (a close
            # marks the round aggregating and forgets the open plan): forget every cached plan,
            # so the next use re-reads what the database really holds.
            self.rounds.invalidate()
            if isinstance(e, OperationalError | InterfaceError):
                raise database_unavailable(e) from e
            raise

    def task_lock(self, task_id: str) -> threading.Lock:
        with self._masters_lock:
            return self._task_locks.setdefault(task_id, threading.Lock())

    def cached_master(self, task_id: str) -> Master | None:
        with self._masters_lock:
            m = self._masters.get(task_id)
            if m is not None:
                self._masters.move_to_end(task_id)
            return m

    def keep_master(self, task_id: str, master: Master) -> None:
        with self._masters_lock:
            self._masters[task_id] = master
            self._masters.move_to_end(task_id)
            while len(self._masters) > self.settings.max_loaded_models:
                self._masters.popitem(last=False)

    def drop_master(self, task_id: str) -> None:
        with self._masters_lock:
            self._masters.pop(task_id, None)

    def close(self) -> None:
        with self._masters_lock:
            self._masters.clear()
        self.engine.dispose()
