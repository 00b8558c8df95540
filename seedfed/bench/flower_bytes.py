"""Bytes a device moves per round over Flower, next to what FedAvg would move.

The upload is measured on the real Flower objects: the TRAIN reply the ClientApp builds
(`client.flower_app.reply_content`), serialized the way Flower ships it (every object of the
message tree deflated; `payload_bytes`), and also with Flower's message envelope (metadata,
`message_bytes`). FedAvg's upload per device is the fp32 trainable tensors of the same scope
of the pretrained MiniLM (head, LoRA r=8 on query/value, full model).

Target: upload per device per round <= 4 bytes per scalar + 256 bytes.

    seedfed bench flower_bytes --json runs/flower_bytes.json
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json
from seedfed.client.flower_app import reply_content
from seedfed.server.flower_strategy import message_bytes, payload_bytes
from seedfed.shared.model.factory import build_model
from seedfed.shared.protocol.recipes import HEAD_OPTIONS, HEAD_SCOPE, resolve_recipe
from seedfed.shared.protocol.scope_options import options_for

SHAPES = ((4, 4), (10, 1), (10, 4), (20, 20), (50, 20))


def scope_sizes() -> dict[str, int]:
    base = resolve_recipe("sst2").spec
    scopes = {"head": replace(base, scope=HEAD_SCOPE,
                              scope_options=options_for(HEAD_SCOPE, HEAD_OPTIONS)),
              "lora": replace(base, scope="lora", scope_options=options_for("lora"),
                              step_scales=()),
              "full": replace(base, scope="full", scope_options=options_for("full"),
                              step_scales=())}
    return {name: build_model(spec, initialize=False).scope.numel
            for name, spec in scopes.items()}


def measure(shape: tuple[int, int]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    g = rng.standard_normal(shape).astype(np.float32)
    content = reply_content(g, num_examples=16 * shape[0], loss=0.6931)
    request = Message(RecordDict({"seedfed": ConfigRecord({"x": 0})}),
                      message_type=MessageType.TRAIN, dst_node_id=7)
    reply = Message(content, reply_to=request)
    scalars = shape[0] * shape[1]
    return {"steps": shape[0], "perturbations": shape[1], "scalars": scalars,
            "payload_bytes": payload_bytes(content), "message_bytes": message_bytes(reply),
            "budget_bytes": 4 * scalars + 256}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("flower_bytes")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    sizes = scope_sizes()
    rows = [measure(s) for s in SHAPES]
    for r in rows:
        r["within_budget"] = r["payload_bytes"] <= r["budget_bytes"]
        for name, numel in sizes.items():
            r[f"fedavg_{name}_bytes"] = 4 * numel
            r[f"ratio_{name}"] = r["payload_bytes"] / (4 * numel)
    print(f"{'steps x P':>10} {'payload B':>10} {'+envelope':>10} {'budget':>8} "
          + " ".join(f"{'/FedAvg ' + n:>16}" for n in sizes))
    for r in rows:
        print(f"{r['steps']:>4} x {r['perturbations']:<3} {r['payload_bytes']:>10} "
              f"{r['message_bytes']:>10} {r['budget_bytes']:>8} "
              + " ".join(f"{r['ratio_' + n]:>16.2e}" for n in sizes))
    print("FedAvg upload per device: " + ", ".join(f"{n} {4 * v:,} B" for n, v in sizes.items()))
    if args.json:
        write_json(args.json, {"scope_numel": sizes, "rows": rows}, newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
