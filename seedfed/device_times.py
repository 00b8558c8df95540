"""Device compute per round of a simulation: a timed ClientApp and the reader of its log.

`seedfed simulate` wraps the fleet's ClientApp in `TimedClientApp`, which appends the wall
seconds of every call (a train or sync message of one virtual device) to a file in the run
directory; `DeviceTimes.take` sums what was appended since the last round. Ray actors are other
processes on the same machine, so a file is the way back that leaves Flower's messages (and
the byte counts the report makes of them) untouched.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flwr.clientapp import ClientApp

#: The log's name in the run directory.
DEVICE_TIMES = "device_times.tsv"


class DeviceTimes:
    """Reads the log `TimedClientApp` writes, round by round (creates it empty)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")
        self._offset = 0

    def take(self) -> float:
        """Seconds of the calls logged since the last take: the round that just ended (the
        strategy has every reply of a round before its evaluate_fn runs)."""
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits its turn
        self._offset += len(complete)
        return sum(float(line) for line in complete.split())


class TimedClientApp(ClientApp):
    """A ClientApp that runs `inner` and appends each call's wall seconds to `path`."""

    def __init__(self, inner: ClientApp, path: Path) -> None:
        super().__init__()
        self._inner, self._path = inner, str(path)

    def __call__(self, message: Any, context: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._inner(message, context)
        finally:
            line = f"{time.perf_counter() - start:.6f}\n"
            with open(self._path, "a", encoding="ascii") as f:  # one short append per call
                f.write(line)
