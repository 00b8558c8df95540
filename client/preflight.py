"""What a REST device checks before it enrolls, for both backends (torch and ONNX Runtime).

A device that cannot train must not enroll: every enrolment is a device the operator sees
and a join-token slot spent. So `seedfed device` checks, in this order, and stops at the
first problem with one `DeviceSetupError` (or `data.DataFormatError`) that says what to do:

1. the data file exists and has the format (`check_data_file`), before any request;
2. the coordinator answers (`read_task`: GET /healthz, then the task definition);
3. its token is accepted: the stored device token of an enrolled device (a revoked device
   learns it here), or the join token of a new one (the coordinator serves the task
   definition to a join-token holder without enrolling it);
4. the data against the task (`task_examples`): readable, not empty, labels in the task's
   range or among its label words, and a share of at least one training example;
5. the model: each backend loads it (`model_error` words the failure).

The same wording serves a refusal met later (`refusal`): a device revoked while it runs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from seedfed.client import data as data_mod
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.shared.protocol.coordinator_client import CoordinatorClient, CoordinatorHttpError
from seedfed.shared.protocol.errors import UserError
from seedfed.shared.protocol.task import TaskSpec

#: Data sources generated on the device (no file to check).
BUILTIN_SOURCES = ("builtin", "tastes")
#: What to do when the coordinator refuses a device token.
REVOKED_HINT = ("the device was revoked, or --state-dir belongs to another coordinator: start "
                "again with a new --state-dir and the task's join token")
JOIN_HINT = ("check --task and --join-token (or SEEDFED_JOIN_TOKEN): the join token is the "
             "one `seedfed task create` printed for that task, unless an operator rotated it")


class DeviceSetupError(UserError):
    """The device cannot take part as configured: coordinator, token, data or model."""


class DeviceRefusedError(DeviceSetupError, CoordinatorHttpError):
    """The coordinator refused this device (its token, its task): a DeviceSetupError worded
    for the owner that is still the CoordinatorHttpError it was (`status`, `detail`)."""

    def __init__(self, e: CoordinatorHttpError, what: str, hint: str) -> None:
        # neither parent's __init__: their signatures differ; set what both define
        Exception.__init__(self, f"{what}; {hint}")
        self.what, self.hint = what, hint
        self.status, self.detail, self.error, self.url = e.status, e.detail, e.error, e.url


def check_data_file(data: DeviceData) -> None:
    """Refuse a data source that is no file before anything else happens."""
    if data.source in BUILTIN_SOURCES:
        return
    path = Path(data.source)
    if not path.is_file():
        raise data_mod.MissingDataError(
            f"no labelled data file at {path}" + (" (it is a directory)" if path.is_dir()
                                                  else ""),
            "give --data a TSV/JSONL file of this device's examples, or --data builtin")
    data_mod.check_format(path)  # its shape now; its labels once the task is known


def refusal(e: CoordinatorHttpError, *, join: bool) -> DeviceRefusedError:
    """A coordinator's refusal of this device, worded for its owner."""
    said = f"{e.status} {e.error or 'error'}: {e.detail}"
    where = e.url or "the coordinator"
    if e.status == 404:
        return DeviceRefusedError(e, f"{where} has no such task ({said})", "check --task (an "
                                  "operator lists tasks with `seedfed task list`)")
    if e.status in (401, 403) and join:
        # the coordinator's detail names the device token it also tried: not the point here
        return DeviceRefusedError(e, f"{where} refused the join token ({e.status} "
                                  f"{e.error or 'error'})", JOIN_HINT)
    if e.status in (401, 403):
        return DeviceRefusedError(e, f"{where} refused this device's token ({said})",
                                  REVOKED_HINT)
    return DeviceRefusedError(e, f"{where} refused the request ({said})",
                              "see the coordinator's log; try again later")


def read_task(http: httpx.Client, task_id: str, *, device_token: str | None,
              join_token: str | None) -> dict[str, Any]:
    """The task definition (TaskSpec's dict), read with the device token when the device is
    enrolled, else with the join token: a coordinator that cannot be reached, a refused
    token and an unknown task all stop here, before any enrolment."""
    api = CoordinatorClient(http, device_token or join_token)
    if device_token is None and not join_token:
        raise DeviceSetupError("this device is not enrolled yet and has no join token",
                               "pass the task's join token with --join-token (or "
                               "SEEDFED_JOIN_TOKEN)")
    try:
        api.request("GET", "/healthz", auth=False)
    except CoordinatorHttpError as e:
        raise DeviceSetupError(f"{api.url} does not answer as a seedfed coordinator (GET "
                               f"/healthz: {e.status})", "check --url") from None
    try:
        raw = api.spec(task_id)
        TaskSpec.from_dict(raw)
    except CoordinatorHttpError as e:
        raise refusal(e, join=device_token is None) from None
    except (ValueError, TypeError, KeyError) as e:  # not JSON, or not a task definition
        raise DeviceSetupError(f"{api.url} answered with no task definition for task "
                               f"{task_id} ({type(e).__name__}: {e})",
                               "check that --url is a seedfed coordinator of this version"
                               ) from None
    return raw


def task_examples(data: DeviceData, spec: TaskSpec,
                  ) -> tuple[DeviceData, tuple[data_mod.Examples, data_mod.Examples]]:
    """(the device's data bound to the task's labels, its (train, held-out) examples)."""
    labels = data_mod.LabelSpace.of_task(spec.num_labels, spec.label_texts,
                                         classifier=spec.model_kind == "seq_cls")
    bound = replace(data, labels=labels)
    try:
        split = load_device_examples(bound)
    except UserError:
        raise  # the file's own problem, already named by file and line
    except ValueError as e:  # a share the partition cannot give (options, not the file)
        raise DeviceSetupError(f"cannot give partition {data.partition_id} of "
                               f"{data.num_partitions} a share of {data.source}: {e}",
                               "check --partition-id, --num-partitions and --alpha") from e
    if len(split[0]) == 0:
        raise DeviceSetupError(f"partition {data.partition_id} of {data.num_partitions} of "
                               f"{data.source} holds no training examples",
                               "give the device more data or fewer --num-partitions")
    return bound, split


def model_error(e: BaseException, path: str, *, option: str, hint: str) -> DeviceSetupError:
    """A model that did not load, as one line naming where it was looked for."""
    lines = str(e).strip().splitlines()
    why = lines[0] if lines else type(e).__name__
    return DeviceSetupError(f"cannot load the model at {path} ({option}): {why}", hint)
