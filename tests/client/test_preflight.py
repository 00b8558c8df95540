"""What a REST device checks before it enrolls (`client.preflight`): refusals worded for the
device's owner and still the coordinator's error; the data file first, then bound to the task's
labels."""

from __future__ import annotations

from pathlib import Path

import pytest
from seedfed.client.data import DataFormatError, MissingDataError
from seedfed.client.device_data import DeviceData
from seedfed.client.preflight import (
    DeviceRefusedError,
    check_data_file,
    refusal,
    task_examples,
)
from seedfed.shared.protocol.coordinator_client import CoordinatorHttpError
from seedfed.shared.protocol.task import TaskSpec


def _refused(status: int, error: str, detail: str) -> CoordinatorHttpError:
    return CoordinatorHttpError(status, "GET", "/v1/tasks/t/spec", detail, error, "http://c:1")


@pytest.mark.parametrize("status, join, needle, hint", [
    (401, True, "http://c:1 refused the join token (401 AuthenticationError)", "--join-token"),
    (401, False, "refused this device's token (401 AuthenticationError: revoked)",
     "--state-dir"),
    (404, False, "has no such task", "--task"),
    (500, False, "refused the request (500", "log"),
])
def test_a_refusal_says_what_to_do_and_stays_the_coordinators_error(
        status: int, join: bool, needle: str, hint: str) -> None:
    e = refusal(_refused(status, "AuthenticationError" if status == 401 else "Error",
                         "revoked"), join=join)

    assert isinstance(e, DeviceRefusedError) and isinstance(e, CoordinatorHttpError)
    assert needle in e.what and hint in e.hint
    assert (e.status, e.detail, e.url) == (status, "revoked", "http://c:1")


def test_the_data_file_is_checked_before_any_request(tmp_path: Path) -> None:
    csv = tmp_path / "d.csv"
    csv.write_text("label,text\n0,x\n")

    check_data_file(DeviceData(source="builtin"))  # generated: nothing to check
    with pytest.raises(MissingDataError, match="--data"):
        check_data_file(DeviceData(source=str(tmp_path / "none.tsv")))
    with pytest.raises(DataFormatError, match="comma-separated"):
        check_data_file(DeviceData(source=str(csv)))


def test_the_data_is_bound_to_the_tasks_labels(tmp_path: Path) -> None:
    path = tmp_path / "words.tsv"
    path.write_text("label\tsentence\n" + "".join(
        f"{'yes' if i % 2 else 'no'}\tsentence {i}\n" for i in range(40)))
    spec = TaskSpec(model_path="unused", label_texts=("no", "yes"))

    bound, (train, _) = task_examples(DeviceData(source=str(path)), spec)

    assert bound.labels is not None and bound.labels.words == ("no", "yes")
    assert set(train.labels.tolist()) == {0, 1}

