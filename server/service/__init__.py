"""The coordinator's service layer: keyword-only functions the REST routes and the in-process
facade (`seedfed.server.coordinator.Coordinator`) both call."""

from . import devices
from .devices import authenticate_device, enroll_device, revoke_device
from .log import (
    catchup_plan,
    log_since,
    open_snapshot,
    round_metrics,
    snapshot_bytes,
    snapshot_info,
    task_stats,
)
from .rounds import close_if_due, close_round, current_plan, open_plan, open_round, recover, tick
from .tasks import create_task, list_tasks, load_master, prune_versions, task_status
from .uploads import (
                      UploadWriter,
                      check_upload,
                      parse_binary_upload,
                      parse_json_upload,
                      submit_upload,
                      write_uploads,
)

__all__ = [
    "UploadWriter", "authenticate_device", "catchup_plan", "check_upload", "close_if_due",
    "close_round", "create_task", "current_plan", "devices", "enroll_device", "list_tasks",
    "load_master", "log_since", "open_plan", "open_round", "open_snapshot",
    "parse_binary_upload", "parse_json_upload", "prune_versions", "recover", "revoke_device",
    "round_metrics", "snapshot_bytes", "snapshot_info", "submit_upload", "task_stats",
    "task_status", "tick", "write_uploads",
]
