"""The simulator's device-compute log: a timed ClientApp and the per-round reader."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from seedfed.device_times import DeviceTimes, TimedClientApp


class _Echo(ClientApp):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, message: Message, context: Context) -> Message:
        self.calls += 1
        return message


def test_timed_app_forwards_each_call_and_logs_one_line_per_call(tmp_path: Path) -> None:
    times = DeviceTimes(tmp_path / "t.tsv")
    inner = _Echo()
    app = TimedClientApp(inner, times.path)
    # Messages take their run id from the process's task identity (the runtime sets it).
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    msg = Message(RecordDict(), dst_node_id=1, message_type="train")

    replies = [app(message=msg, context=ctx) for _ in range(3)]

    assert inner.calls == 3 and all(r is msg for r in replies)
    assert len(times.path.read_text().splitlines()) == 3
    assert times.take() >= 0.0


def test_take_sums_only_complete_lines_written_since_the_last_take(tmp_path: Path) -> None:
    times = DeviceTimes(tmp_path / "t.tsv")
    with times.path.open("a") as f:
        f.write("0.5\n0.25\n0.12")  # the last line is still being written

    first = times.take()
    with times.path.open("a") as f:
        f.write("5\n1.0\n")
    second = times.take()

    assert first == 0.75
    assert second == 0.125 + 1.0
    assert times.take() == 0.0
