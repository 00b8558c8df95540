"""An in-process Flower Grid: the strategy's rounds, delivered to ClientApps in this process.

Flower's Simulation Engine runs each virtual device in a Ray actor; that is the right model of a
fleet, but its per-message cost (serialization, actor scheduling) dominates when a round's device
work is a few milliseconds, as for a cached head probe. `InProcessGrid` is the same contract
(`flwr.serverapp.Grid`) with the transport removed: `send_and_receive` calls the ClientApp on
every message in turn, with one `Context` per virtual node that persists between rounds, as a
SuperNode's does (made when the node first gets a message, so a fleet of 10,000 devices costs
what its sampled ones hold). Everything above the transport is unchanged: the strategy, the
coordinator's round close, the ClientApp and the device core it wraps. So `seedfed simulate
--engine inprocess` and the accuracy benchmark run the very round code a deployment runs.

An exception raised by the ClientApp becomes an error reply, as in Flower's runtime.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


class InProcessGrid(Grid):
    """`nodes` virtual devices running `app`; node i's `node_config` is `node_configs[i]`."""

    def __init__(self, app: ClientApp, node_configs: list[dict[str, str | int | float | bool]],
                 run_id: int = 1, run_config: dict[str, str | int | float | bool] | None = None,
                 ) -> None:
        if not node_configs:
            raise ValueError("an in-process grid needs at least one node")
        self.app = app
        self._run_id, self._run_config = run_id, dict(run_config or {})
        self._node_configs = node_configs
        # Node ids start at 1: Flower reserves 0 for the SuperLink side. A node's Context is
        # made when it first gets a message: a fleet costs what its sampled devices hold.
        self._contexts: dict[int, Context] = {}
        self._run = Run.create_empty(run_id)
        # Flower's runtime sets the process's task identity before a ServerApp runs, and every
        # Message built afterwards takes its run id from it; this process is that runtime here.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, 0
        self._ids = itertools.count(1)
        self._pending: dict[str, Message] = {}

    # -- the Grid contract -------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return range(1, len(self._node_configs) + 1)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            mid = f"inprocess-{next(self._ids)}"
            self._pending[mid] = message
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._deliver(self._pending.pop(mid)) for mid in message_ids
                if mid in self._pending]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        # Delivery is synchronous, so every reply is in before any timeout could matter.
        return self.pull_messages(self.push_messages(messages))

    # -- delivery ----------------------------------------------------------------------------
    def context(self, node_id: int) -> Context:
        """The persistent Context of a virtual node (its device state lives in `state`)."""
        if node_id not in self._contexts:
            self._contexts[node_id] = Context(
                run_id=self._run_id, node_id=node_id, state=RecordDict(),
                node_config=dict(self._node_configs[node_id - 1]),
                run_config=dict(self._run_config))
        return self._contexts[node_id]

    def _deliver(self, message: Message) -> Message:
        node_id = message.metadata.dst_node_id
        if not 1 <= node_id <= len(self._node_configs):
            return Message(Error(code=0, reason=f"no node {node_id} on this grid"),
                           reply_to=message)
        try:
            return self.app(message, self.context(node_id))
        except Exception as e:  # noqa: BLE001 - Flower's runtime turns any failure into a reply
            return Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=message)
