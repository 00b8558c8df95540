"""The coordinator's in-process caches, each an object that owns its state.

The upload path answers without a query when it can: it needs the device behind a bearer
token (`TokenCache`), the open round's plan, upload count and cap (`OpenRounds`), and the
ticker needs the failing closes it retries (`CloseFailures`). Each cache is changed only
through its methods, by the service layer; the API layer asks service functions. The database
stays the truth: every cache can be dropped (`invalidate`) and is refilled from it.

Each method is one or a few plain dict operations, atomic enough under the GIL for how they
are used: plans change with a round's state inside `Runtime.state_lock` (open, close, expire),
and upload counts are written by the one upload writer thread after each batch commits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from seedfed.server.errors import PermissionDeniedError
from seedfed.shared.protocol.wire import RoundPlan


def at_quorum(uploads: int, quorum: int) -> bool:
    """The one quorum rule: a round with `uploads` accepted uploads may close now."""
    return uploads >= quorum


class TokenCache:
    """Device token hash -> (device id, task id) of devices known not to be revoked."""

    def __init__(self) -> None:
        self._devices: dict[str, tuple[str, str]] = {}

    def remember(self, token_hash: str, device_id: str, task_id: str) -> None:
        self._devices[token_hash] = (device_id, task_id)

    def forget(self, token_hash: str) -> None:
        """The device was revoked: its token must be checked against the database again."""
        self._devices.pop(token_hash, None)

    def lookup(self, token_hash: str) -> tuple[str, str] | None:
        return self._devices.get(token_hash)

    def authorize(self, token_hash: str, task_id: str) -> str | None:
        """The device id of a cached token of task `task_id`; None when the token is not
        cached (the caller authenticates it against the database). A cached token of another
        task is refused here, without a query."""
        hit = self._devices.get(token_hash)
        if hit is None:
            return None
        if hit[1] != task_id:
            raise PermissionDeniedError(f"device {hit[0]} is enrolled in another task, "
                                        f"not {task_id!r}")
        return hit[0]


class OpenRounds:
    """Per task, its open round (id and plan) or the knowledge that none is open; per open
    round, the uploads committed so far and its `devices_per_round` cap."""

    def __init__(self) -> None:
        # task_id -> (round id, plan); None: no open round; absent: unknown, read the database
        self._plans: dict[str, tuple[int, RoundPlan] | None] = {}
        self._counts: dict[int, int] = {}  # round id -> uploads committed
        self._caps: dict[int, int | None] = {}  # round id -> devices_per_round (None: no cap)

    # -- plans ---------------------------------------------------------------------------

    def known(self, task_id: str) -> bool:
        return task_id in self._plans

    def plan(self, task_id: str) -> tuple[int, RoundPlan] | None:
        """(round id, plan) of the task's open round; None when none is open or not known."""
        return self._plans.get(task_id)

    def opened(self, task_id: str, round_id: int, plan: RoundPlan, cap: int | None) -> None:
        """A round was just opened (nothing uploaded to it yet)."""
        self._plans[task_id] = (round_id, plan)
        self._counts[round_id] = 0
        self._caps[round_id] = cap

    def found(self, task_id: str, hit: tuple[int, RoundPlan] | None,
              cap: int | None = None) -> None:
        """What the database says is open for the task (read after a restart or a miss)."""
        self._plans[task_id] = hit
        if hit is not None:
            self._caps[hit[0]] = cap

    def stopped(self, task_id: str) -> None:
        """The task has no open round any more (aggregating, expired, or a new task)."""
        self._plans[task_id] = None

    def invalidate(self) -> None:
        """Forget every plan: a failed unit of work may have moved one before its rollback."""
        self._plans.clear()

    # -- uploads -------------------------------------------------------------------------

    def count(self, round_id: int) -> int:
        return self._counts.get(round_id, 0)

    def uncounted(self, round_ids: Iterable[int]) -> set[int]:
        """The rounds among `round_ids` whose upload count is not known yet."""
        return set(round_ids) - self._counts.keys()

    def uncapped(self, round_ids: Iterable[int]) -> set[int]:
        """The rounds among `round_ids` whose cap is not known yet."""
        return set(round_ids) - self._caps.keys()

    def set_count(self, round_id: int, uploads: int) -> None:
        self._counts[round_id] = uploads

    def set_cap(self, round_id: int, cap: int | None) -> None:
        self._caps[round_id] = cap

    def cap(self, round_id: int) -> int | None:
        return self._caps.get(round_id)

    def is_due(self, task_id: str, round_id: int) -> bool:
        """Whether `round_id` is still the task's open round and has reached its quorum."""
        hit = self._plans.get(task_id)
        return hit is not None and hit[0] == round_id and \
            at_quorum(self._counts.get(round_id, 0), hit[1].quorum)

    def finished(self, round_id: int, *, keep_cap: bool = False) -> None:
        """The round left the open state for good: drop its count (and its cap)."""
        self._counts.pop(round_id, None)
        if not keep_cap:
            self._caps.pop(round_id, None)


@dataclass(frozen=True)
class CloseFailure:
    """The last failed attempt to finish a task's round close, shown on /readyz, the task
    status and the dashboard until a close succeeds or the round is abandoned. A transient
    failure is retried with backoff by the ticker (at `retry_at`); a `permanent` one (the
    close would fail the same way again) is not retried (`retry_at` None)."""

    round_id: int
    round: int | None
    attempts: int
    error: str  # "TypeName: message"
    failed_at: datetime
    retry_at: datetime | None
    permanent: bool = False


class CloseFailures:
    """Task id -> its failing round close (a task with none is absent)."""

    def __init__(self) -> None:
        self._failures: dict[str, CloseFailure] = {}

    def get(self, task_id: str) -> CloseFailure | None:
        return self._failures.get(task_id)

    def record(self, task_id: str, failure: CloseFailure) -> None:
        self._failures[task_id] = failure

    def clear(self, task_id: str, round_id: int | None = None) -> None:
        """The task's close succeeded, or there is nothing left to retry (with `round_id`:
        only if the failure is that round's)."""
        f = self._failures.get(task_id)
        if f is not None and (round_id is None or f.round_id == round_id):
            self._failures.pop(task_id, None)

    def due(self, now: datetime) -> list[tuple[str, int]]:
        """(task id, round id) of every retried failure whose backoff has passed."""
        return [(t, f.round_id) for t, f in list(self._failures.items())
                if f.retry_at is not None and f.retry_at <= now]

    def items(self) -> list[tuple[str, CloseFailure]]:
        """Every failing close, by task id."""
        return sorted(self._failures.items())

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._failures

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._failures))

    def __len__(self) -> int:
        return len(self._failures)
