"""Crash campaign: SIGKILL a real coordinator under load, restart it, prove nothing was lost.

A `seedfed coordinator` process (uvicorn, the real app) serves one task on SQLite or
PostgreSQL. Worker threads play many devices: each round they fetch the plan (admin `POST
/rounds` opens the next one or returns the open one), upload deterministic scalars, and retry
on any transport error with the same body. Rounds close at quorum right after the upload that
reaches it, so closes (aggregation + file writes + commit) run all the time.

The campaign SIGKILLs the process `--kills` times: at a random moment, or right after a round
reached its quorum (the close is then running), and restarts it on the same database and
model store; start-up recovery finishes any round the kill left aggregating. Before each
restart the database is read to count kills that left a round `aggregating` (a kill inside
the close). At the end, with the server stopped, it checks:

1. every 200 receipt is stored exactly once (same round, device and content digest);
2. no version is committed twice: each version 1..current comes from exactly one round, and
   each closed round produced exactly one version;
3. versions are contiguous from 0 to the task's current version;
4. replaying the log from the version-0 master file reproduces every version's checksum, and
   re-aggregating every closed round from its stored uploads reproduces its log entry bit for
   bit (so an accepted upload cannot have been left out of its round);
5. every closed round's participant count equals its stored uploads.

    seedfed bench crash --db sqlite postgres --kills 100   # the full campaign
    seedfed bench crash --db sqlite --kills 3              # CI-sized
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from seedfed.bench import coordinator_process
from seedfed.bench.coordinator_process import tiny_model
from seedfed.bench.registry import RESULTS, bench_parser, positive_int
from seedfed.bench.report import text_table, write_json

ADMIN = "crash-admin-token-" + "x" * 16


def scalars_for(device: int, round_number: int, shape: tuple[int, int]) -> np.ndarray:
    """Deterministic per (device, round): a retry sends byte-identical content."""
    return np.random.default_rng([device, round_number]).normal(size=shape)


@dataclass
class Receipt:
    round: int
    device_id: str
    digest: str


@dataclass
class Campaign:
    """Shared state of the load threads and the killer."""

    base: str
    task_id: str
    tokens: list[tuple[str, str]]  # (device_id, token)
    quorum: int
    receipts: list[Receipt] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    quorum_hit: threading.Event = field(default_factory=threading.Event)
    round_receipts: dict[int, int] = field(default_factory=dict)

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1


def _worker(c: Campaign, lane: int, lanes: int) -> None:
    """Devices lane, lane + lanes, ... upload once per round, retrying through crashes."""
    import httpx

    from seedfed.shared.protocol.wire import RoundPlan, Upload

    admin = {"Authorization": f"Bearer {ADMIN}"}
    mine = list(range(lane, len(c.tokens), lanes))
    done: set[tuple[int, int]] = set()
    with httpx.Client(base_url=c.base, timeout=10.0) as http:
        while not c.stop.is_set():
            try:
                r = http.post(f"/v1/tasks/{c.task_id}/rounds", headers=admin)
                if r.status_code not in (200, 201):  # 409: the last round is aggregating
                    c.count(f"open {r.status_code}")
                    time.sleep(0.05)
                    continue
                plan = RoundPlan.model_validate_json(r.content)
            except httpx.TransportError:
                c.count("transport error (open)")
                time.sleep(0.1)
                continue
            todo = [d for d in mine if (plan.round, d) not in done]
            if not todo:
                time.sleep(0.02)
                continue
            d = random.choice(todo)
            dev_id, token = c.tokens[d]
            body = Upload.build(plan, scalars_for(d, plan.round, (plan.steps, plan.perturbations)),
                                8 + d % 5, 0.5).model_dump_json()
            while not c.stop.is_set():
                try:
                    r = http.post(f"/v1/tasks/{c.task_id}/rounds/{plan.round}/uploads",
                                  content=body, headers={"Authorization": f"Bearer {token}",
                                                         "Content-Type": "application/json"})
                except httpx.TransportError:
                    c.count("transport error (upload, retried)")
                    time.sleep(0.1)
                    continue
                if r.status_code == 200:
                    rec = r.json()
                    with c.lock:
                        c.receipts.append(Receipt(plan.round, rec["device_id"], rec["digest"]))
                        n = c.round_receipts.get(plan.round, 0) + 1
                        c.round_receipts[plan.round] = n
                    if n >= c.quorum:
                        c.quorum_hit.set()
                    c.count("200")
                elif r.status_code >= 500:
                    c.count(f"{r.status_code} {r.text[:60]}")
                    time.sleep(0.1)
                    continue  # a 5xx is retried like a transport error
                else:
                    c.count(f"{r.status_code} {r.json().get('error')}")
                break
            done.add((plan.round, d))


#: Tick and close retries fast, so a restart finishes a crashed close within the campaign.
SERVER_ENV = {"SEEDFED_TICK_INTERVAL_S": "0.2", "SEEDFED_CLOSE_RETRY_BASE_S": "0.2",
              "SEEDFED_CLOSE_RETRY_MAX_S": "1"}


def _start(url: str, store: Path, port: int, log: Any) -> subprocess.Popen[bytes]:
    return coordinator_process.start(url, store, ADMIN, port, log, env=SERVER_ENV,
                                     args=("--keep-versions", "0"))


def _wait_settled(base: str, task_id: str, timeout: float = 300.0) -> bool:
    """Wait until the task has no round aggregating (the last close finished)."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            r = httpx.get(f"{base}/v1/tasks/{task_id}",
                          headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5)
            if r.status_code == 200 and r.json()["state"] != "aggregating":
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def _aggregating_rounds(url: str, task_id: str) -> int:
    """Rounds left `aggregating` in the database (read while the server is down)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(
                "SELECT count(*) FROM rounds WHERE task_id = :t AND state = 'aggregating'"),
                {"t": task_id}).scalar() or 0)
    finally:
        engine.dispose()


def verify(url: str, store: Path, task_id: str, receipts: list[Receipt]) -> dict[str, Any]:
    """The campaign's checks, on the database and model store the server left."""
    from sqlalchemy import select

    from seedfed.server import service
    from seedfed.server.aggregation import combine
    from seedfed.server.orm import RoundRow, RoundState, TaskRow, UploadRow, VersionRow
    from seedfed.server.runtime import Runtime
    from seedfed.server.settings import Settings
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.model.replay import apply_seeds, checksum
    from seedfed.shared.protocol.wire import RoundPlan

    rt = Runtime(Settings(database_url=url, store_dir=store, admin_token=ADMIN))
    problems: list[str] = []
    try:
        with rt.transaction() as s:
            task = s.get(TaskRow, task_id)
            assert task is not None
            spec = service.tasks.spec_of(task)
            rounds = {r.number: r for r in s.scalars(select(RoundRow)
                                                     .where(RoundRow.task_id == task_id))}
            by_id = {r.id: r for r in rounds.values()}
            uploads = list(s.scalars(select(UploadRow).where(UploadRow.round_id.in_(by_id))))
            versions = list(s.scalars(select(VersionRow).where(VersionRow.task_id == task_id)
                                      .order_by(VersionRow.version)))
            current, secret = task.current_version, task.secret
        stored: dict[tuple[int, str], list[UploadRow]] = {}
        for u in uploads:
            stored.setdefault((by_id[u.round_id].number, u.device_id), []).append(u)
        # 1. every 200 receipt stored exactly once, with its digest
        lost = 0
        for rec in receipts:
            rows = stored.get((rec.round, rec.device_id), [])
            if len(rows) != 1 or rows[0].digest != rec.digest:
                lost += 1
                problems.append(f"receipt round {rec.round} device {rec.device_id}: "
                                f"{len(rows)} stored rows")
        dup_rows = sum(len(v) - 1 for v in stored.values() if len(v) > 1)
        # 2. + 3. versions contiguous, each from exactly one round
        numbers = [v.version for v in versions]
        if numbers != list(range(current + 1)):
            problems.append(f"versions {numbers[:5]}...{numbers[-5:]} are not 0..{current}")
        from_rounds = [v.round_number for v in versions if v.version > 0]
        if len(set(from_rounds)) != len(from_rounds):
            problems.append("a round committed two versions")
        closed = [r for r in rounds.values() if r.state == RoundState.CLOSED]
        results = [r.result_version for r in closed if r.result_version is not None]
        if sorted(results) != list(range(1, current + 1)):
            problems.append(f"closed rounds' result versions {sorted(results)[:8]}... are not "
                            f"1..{current}")
        stuck = [r.number for r in rounds.values() if r.state == RoundState.AGGREGATING]
        if stuck:
            problems.append(f"rounds left aggregating: {stuck}")
        # a round planned at a base other than the version before it never commits: its
        # uploads (200 receipts) are abandoned, so there must be none
        abandoned = [r.number for r in rounds.values() if r.state == RoundState.ABANDONED]
        if abandoned:
            problems.append(f"rounds abandoned (planned at a stale base): {abandoned}")
        # 4. replay from v0 and re-aggregation of every closed round
        bundle = build_model(spec, initialize=False)
        bundle.scope.load_master_state(rt.store.read_state(versions[0].master_path,
                                                           versions[0].master_sha256))
        if checksum(bundle.scope) != versions[0].checksum:
            problems.append("version 0 master does not hash to its checksum")
        replay_ok = 0
        reaggregated = 0
        for v in versions[1:]:
            seeds = json.loads(v.seeds_json)
            coefs = np.frombuffer(v.coefs, dtype="<f4")
            apply_seeds(bundle.scope, seeds, [float(c) for c in coefs])
            if checksum(bundle.scope) == v.checksum:
                replay_ok += 1
            else:
                problems.append(f"replay of v{v.version} does not match its checksum")
            if v.round_number is None or v.round_number not in rounds:
                problems.append(f"v{v.version} names no stored round")
                continue
            r = rounds[v.round_number]
            mine = sorted((u for u in uploads if u.round_id == r.id), key=lambda u: u.device_id)
            plan = RoundPlan.model_validate_json(r.plan_json)
            redo = combine(task_id=task_id, base_version=v.version - 1, round_number=r.number,
                           seeds=plan.flat_seeds, perturbations=plan.perturbations, lr=plan.lr,
                           matrices=[np.frombuffer(u.scalars, dtype="<f4").reshape(u.rows,
                                                                                    u.cols)
                                     for u in mine],
                           num_examples=[u.num_examples for u in mine],
                           losses=[u.loss for u in mine], config=spec.aggregation,
                           secret=secret, dp_devices=plan.quorum)
            if np.asarray(redo.entry.coefs, dtype="<f4").tobytes() == v.coefs:
                reaggregated += 1
            else:
                problems.append(f"round {r.number}: its entry is not the aggregate of its "
                                f"{len(mine)} stored uploads")
            # 5. participants = stored uploads
            if r.participants != len(mine):
                problems.append(f"round {r.number}: participants {r.participants} but "
                                f"{len(mine)} uploads stored")
    finally:
        rt.close()
    return {"receipts": len(receipts), "lost": lost, "duplicate_rows": dup_rows,
            "versions": current, "replayed_ok": replay_ok, "reaggregated_ok": reaggregated,
            "uploads_stored": len(uploads), "rounds": len(rounds),
            "problems": problems[:20], "ok": not problems}


def campaign(backend: str, *, kills: int, devices: int, quorum: int, lanes: int,
             seeds: int, at_close: float, model: Path, seed: int = 0,
             budget_s: float | None = None, log: bool = True) -> dict[str, Any]:
    """One backend: enroll, run under load, SIGKILL `kills` times (or as many as fit in
    `budget_s` seconds), verify."""
    from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec

    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, \
            coordinator_process.database(backend, Path(tmp), "seedfed_crash") as url:
        store = Path(tmp) / "store"
        spec = TaskSpec(model_path=str(model), label_texts=("negative", "positive"),
                        lora=LoraOptions(r=2), hyper=Hyper(steps=1, perturbations=seeds,
                                                           lr=1e-3))
        task_id, tokens, _ = coordinator_process.enroll_fleet(
            url, store, ADMIN, spec, quorum=quorum, devices=devices)
        port = coordinator_process.free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "server.log"
        logf = open(log_path, "ab")  # noqa: SIM115 (closed at the end)
        proc = _start(url, store, port, logf)
        coordinator_process.wait_ready(base, proc, log_path)
        c = Campaign(base=base, task_id=task_id, tokens=tokens, quorum=quorum)
        threads = [threading.Thread(target=_worker, args=(c, i, lanes), daemon=True)
                   for i in range(lanes)]
        for t in threads:
            t.start()
        kinds = {"random": 0, "at_close": 0}
        inside_close = 0
        restarts: list[float] = []
        t_start = time.time()
        done = 0
        for k in range(kills):
            if budget_s is not None and time.time() - t_start > budget_s:
                break
            if rnd.random() < at_close:
                kinds["at_close"] += 1
                c.quorum_hit.clear()
                c.quorum_hit.wait(timeout=30)
                time.sleep(rnd.uniform(0.0, 0.03))  # inside the close that follows
            else:
                kinds["random"] += 1
                time.sleep(rnd.uniform(0.2, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if _aggregating_rounds(url, task_id):
                inside_close += 1
            proc = _start(url, store, port, logf)
            restarts.append(coordinator_process.wait_ready(base, proc, log_path))
            done += 1
            if log:
                print(f"  {backend} kill {k + 1}/{kills}: {len(c.receipts)} receipts, "
                      f"restart {restarts[-1]:.1f} s, inside a close so far {inside_close}; "
                      f"{dict(sorted(c.counts.items()))}", flush=True)
        time.sleep(1.0)  # some uploads after the last restart
        c.stop.set()
        for t in threads:
            t.join(timeout=30)
        settled = _wait_settled(base, task_id)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        logf.close()
        tracebacks = log_path.read_text(errors="replace").count("Traceback")
        wall = time.time() - t_start
        result = verify(url, store, task_id, c.receipts)
    return {"backend": backend, "kills": done, "kills_planned": kills, "kill_kinds": kinds,
            "kills_inside_a_close": inside_close, "devices": devices, "quorum": quorum,
            "load_threads": lanes, "scalars_per_upload": seeds, "wall_s": wall,
            "restart_s_median": float(np.median(restarts)) if restarts else None,
            "responses": dict(sorted(c.counts.items())), "server_tracebacks": tracebacks,
            "settled_before_stop": settled,
            **result}


#: The printed table: (header, row key, format spec).
TABLE = (("backend", "backend", "<10"), ("kills", "kills", ">6"),
         ("in close", "kills_inside_a_close", ">9"), ("receipts", "receipts", ">9"),
         ("lost", "lost", ">5"), ("dups", "duplicate_rows", ">5"), ("versions", "versions", ">9"),
         ("replay ok", "replayed_ok", ">10"), ("reagg ok", "reaggregated_ok", ">9"),
         ("ok", "ok", ">4"))

def run_campaigns(*, backends: list[str], kills: int, devices: int = 48, quorum: int = 8,
                  lanes: int = 12, seeds: int = 16, at_close: float = 0.5,
                  json_path: Path | None = None, seed: int = 0,
                  budget_s: float | None = None) -> list[dict[str, Any]]:
    """One campaign per backend; writes `json_path` and prints a table. The rows."""
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "model")
        rows = [campaign(b, kills=kills, devices=devices, quorum=quorum, lanes=lanes,
                         seeds=seeds, at_close=at_close, model=model, seed=seed,
                         budget_s=budget_s)
                for b in backends]
    if json_path is not None:
        write_json(json_path, {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                               "target": "0 uploads lost over >= 100 SIGKILLs per backend",
                               "results": rows}, newline=False)
    header, *lines = text_table(TABLE, [{**r, "ok": "yes" if r["ok"] else "NO"} for r in rows])
    print(header)
    for r, line in zip(rows, lines, strict=True):
        print(line)
        for p in r["problems"]:
            print(f"   ! {p}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 only when every backend's campaign lost nothing and replayed equal."""
    ap = bench_parser("crash")
    ap.add_argument("--db", nargs="+", default=["sqlite", "postgres"],
                    choices=["sqlite", "postgres"], help="backends (default: both)")
    ap.add_argument("--kills", type=positive_int, default=100, help="SIGKILLs per backend")
    ap.add_argument("--devices", type=int, default=48)
    ap.add_argument("--quorum", type=int, default=8, help="uploads that close a round")
    ap.add_argument("--threads", type=int, default=12, help="load-generating threads")
    ap.add_argument("--seeds", type=int, default=16, help="scalars per upload")
    ap.add_argument("--at-close", type=float, default=0.5,
                    help="share of kills aimed right after a round reached its quorum")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the kill schedule and the uploads")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop killing after this many seconds per backend (then verify)")
    ap.add_argument("--json", type=Path, default=RESULTS / "crash.json")
    args = ap.parse_args(argv)
    if not 0.0 <= args.at_close <= 1.0:
        ap.error(f"--at-close must be within [0, 1], got {args.at_close}")
    rows = run_campaigns(backends=args.db, kills=args.kills, devices=args.devices,
                         quorum=args.quorum, lanes=args.threads, seeds=args.seeds,
                         at_close=args.at_close, json_path=args.json, seed=args.seed,
                         budget_s=args.budget_s)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
