"""The coordinator's service layer: keyword-only functions the REST routes and the in-process
facade (`seedfed.server.coordinator.Coordinator`) both call."""

from seedfed.server.service import devices
from seedfed.server.service.abandon import abandon_round
from seedfed.server.service.devices import (
    authenticate_device,
    authenticate_hash,
    bearer_device,
    enroll_device,
    revoke_device,
)
from seedfed.server.service.health import metrics_text, readiness
from seedfed.server.service.log import (
    catchup_plan,
    log_since,
    open_snapshot,
    round_metrics,
    serve_log,
    serve_snapshot,
    snapshot_bytes,
    snapshot_info,
    task_stats,
)
from seedfed.server.service.metrics import device_metrics, record_device_metrics
from seedfed.server.service.opening import open_round, set_schedule
from seedfed.server.service.rounds import (
    cached_plan,
    close_if_due,
    close_round,
    current_plan,
    is_due,
    open_plan,
    recover,
    tick,
)
from seedfed.server.service.tasks import (
    create_task,
    list_tasks,
    load_master,
    prune_versions,
    task_spec,
    task_status,
)
from seedfed.server.service.uploads import (
    UploadWriter,
    check_upload,
    count_rejected,
    parse_binary_upload,
    parse_json_upload,
    submit_upload,
    submit_uploads,
    write_uploads,
)

__all__ = [
    "UploadWriter", "abandon_round", "authenticate_device", "authenticate_hash",
    "bearer_device", "cached_plan", "catchup_plan", "check_upload", "close_if_due",
    "close_round", "count_rejected", "create_task", "current_plan", "device_metrics",
    "devices", "enroll_device", "is_due", "list_tasks", "load_master", "log_since",
    "metrics_text", "open_plan", "open_round", "open_snapshot", "parse_binary_upload",
    "parse_json_upload", "prune_versions", "readiness", "record_device_metrics", "recover",
    "revoke_device", "round_metrics", "serve_log", "serve_snapshot", "set_schedule",
    "snapshot_bytes", "snapshot_info", "submit_upload", "submit_uploads", "task_spec",
    "task_stats", "task_status", "tick", "write_uploads",
]
