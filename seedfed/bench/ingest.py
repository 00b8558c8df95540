"""Upload ingestion throughput and latency of the coordinator on loopback.

Target: >= 1,000 uploads/s sustained from 200 concurrent clients, p99 < 100 ms, on
SQLite; PostgreSQL reported too. The coordinator runs as a real `seedfed coordinator` process
(uvicorn); 200 keep-alive connections from a separate client process send each enrolled
device's JSON `Upload` of `--seeds` scalars to the open round, every answer is checked for 200
and the stored count at the end.

Each `--rate` is one run on a fresh database: an offered rate (open loop, latency counted from
when each upload was due) or 0 for a closed loop (the most the server answers). The default
client is a lean HTTP/1.1 load generator (like wrk) so the client does not take the server's
CPU on this 2-core machine; `--client httpx --rate 0` uses httpx instead.

    seedfed bench ingest --db sqlite postgres --uploads 20000 --rate 1000 2000 0 \
        --json benchmarks/results/ingest.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from seedfed.bench.coordinator_process import coordinator, database, enroll_fleet, tiny_model
from seedfed.bench.registry import bench_parser
from seedfed.bench.report import text_table, write_json

ADMIN = "bench-admin-token-" + "x" * 16


def prepare(url: str, store: Path, model: Path, n: int, seeds: int) -> tuple[str, list[str],
                                                                             list[str]]:
    """Task, n enrolled devices, an open round; returns (task_id, tokens, upload bodies)."""
    from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec
    from seedfed.shared.protocol.wire import Upload

    spec = TaskSpec(model_path=str(model), label_texts=("negative", "positive"),
                    lora=LoraOptions(r=2), hyper=Hyper(steps=1, perturbations=seeds))
    task_id, devices, plan = enroll_fleet(url, store, ADMIN, spec, quorum=10 * n, devices=n,
                                          open_round=True)
    assert plan is not None
    rng = np.random.default_rng(0)
    bodies = [Upload.build(plan, rng.normal(size=(1, seeds)), 16, 0.6).model_dump_json()
              for _ in range(n)]
    return task_id, [token for _, token in devices], bodies


def _request(host: str, path: str, token: str, body: str) -> bytes:
    data = body.encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode() + data


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


def client_proc(base: str, task_id: str, work: list[tuple[str, str]], concurrency: int,
                start_at: float, out: Any, kind: str, rate: float) -> None:
    """One client process: `concurrency` keep-alive connections pulling from a shared queue.

    kind="raw" is a lean HTTP/1.1 client on asyncio streams (uvloop when present): it costs a
    few tens of microseconds a request, so on a 2-core box the CPU goes to the server, as with
    wrk or a fleet of real devices. kind="httpx" is a full client library, whose own CPU per
    request (~1 ms) competes with the server on this machine.

    rate > 0 is an open loop (as wrk2): upload i is due at start + i / rate whatever the
    answers before it, and its latency counts from when it was due, so a stalled server is
    charged for the uploads it kept waiting (no coordinated omission). rate = 0 is a closed
    loop: every connection sends its next upload as soon as the last one is answered, which
    measures the most the server takes (latency is then concurrency / throughput)."""
    host, port = base.removeprefix("http://").split(":")
    path = f"/v1/tasks/{task_id}/rounds/1/uploads"
    queue = [_request(f"{host}:{port}", path, t, b) for t, b in reversed(work)]

    async def run_raw() -> tuple[list[float], dict[str, int], float, float]:
        lat: list[float] = []
        bad: dict[str, int] = {}
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(concurrency)]
        while time.time() < start_at:
            await asyncio.sleep(0.001)
        t_start = time.time()

        p_start = time.perf_counter()
        sent = 0

        async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal sent
            while queue:
                req = queue.pop()
                t0 = time.perf_counter()
                if rate > 0:
                    t0 = p_start + sent / rate
                    sent += 1
                    if t0 > time.perf_counter():
                        await asyncio.sleep(t0 - time.perf_counter())
                writer.write(req)
                try:
                    status, payload = await _read_response(reader)
                except (OSError, asyncio.IncompleteReadError) as e:
                    bad[type(e).__name__] = bad.get(type(e).__name__, 0) + 1
                    return
                if status != 200:
                    key = f"{status}: {payload[:80]!r}"
                    bad[key] = bad.get(key, 0) + 1
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker(r, w) for r, w in conns))
        t_end = time.time()
        for _, w in conns:
            w.close()
        return lat, bad, t_start, t_end

    async def run_httpx() -> tuple[list[float], dict[str, int], float, float]:
        import httpx

        lat: list[float] = []
        bad: dict[str, int] = {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
            while time.time() < start_at:
                await asyncio.sleep(0.001)
            t_start = time.time()

            async def worker() -> None:
                while work:
                    token, body = work.pop()
                    t0 = time.perf_counter()
                    try:
                        r = await client.post(path, content=body, headers={
                            "Authorization": f"Bearer {token}",
                            "Content-Type": "application/json"})
                        if r.status_code != 200:
                            key = f"{r.status_code}: {r.text[:80]}"
                            bad[key] = bad.get(key, 0) + 1
                    except httpx.HTTPError as e:  # a timeout is an error, with its latency
                        bad[type(e).__name__] = bad.get(type(e).__name__, 0) + 1
                    lat.append(time.perf_counter() - t0)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return lat, bad, t_start, time.time()

    if kind == "raw":
        try:
            import uvloop
            out.put(uvloop.run(run_raw()))
        except ImportError:
            out.put(asyncio.run(run_raw()))
    else:
        out.put(asyncio.run(run_httpx()))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(backend: str, rate: float, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    import httpx

    with tempfile.TemporaryDirectory() as tmp, \
            database(backend, Path(tmp), "seedfed_bench") as url:
        t0 = time.perf_counter()
        task_id, tokens, bodies = prepare(url, Path(tmp) / "store", model, args.uploads,
                                          args.seeds)
        setup_s = time.perf_counter() - t0
        with coordinator(url, Path(tmp) / "store", ADMIN, Path(tmp) / "server.log",
                         env={"SEEDFED_INGEST_BATCH": str(args.batch)}, timeout=60,
                         ) as (base, server):
            work = list(zip(tokens, bodies, strict=True))
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            per = args.clients // args.client_procs
            start_at = time.time() + 3.0
            procs = [ctx.Process(target=client_proc, args=(
                base, task_id, work[i::args.client_procs], per, start_at, q, args.client,
                rate / args.client_procs))
                for i in range(args.client_procs)]
            for p in procs:
                p.start()
            cpu0 = cpu_seconds(server.pid)
            results = [q.get(timeout=600) for _ in procs]
            server_cpu = cpu_seconds(server.pid) - cpu0
            for p in procs:
                p.join()
            stats = httpx.get(f"{base}/v1/tasks/{task_id}/stats",
                              headers={"Authorization": f"Bearer {ADMIN}"}).json()
    lat = sorted(x for r in results for x in r[0])
    wall = max(r[3] for r in results) - min(r[2] for r in results)
    stored = stats["rounds"][0]["participants"]
    return {
        "backend": backend, "mode": f"open loop {rate:g}/s" if rate else "closed loop",
        "offered_per_s": rate or None, "uploads": len(lat), "clients": per * args.client_procs,
        "client_processes": args.client_procs, "client": args.client,
        "scalars_per_upload": args.seeds,
        "errors": sum(n for r in results for n in r[1].values()),
        "error_kinds": {k: sum(r[1].get(k, 0) for r in results)
                        for k in {k for r in results for k in r[1]}},
        "stored": stored, "wall_s": wall,
        "uploads_per_s": len(lat) / wall, "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))], "max_ms": 1e3 * lat[-1],
        "setup_s": setup_s, "body_bytes": len(bodies[0]),
        # CPU the server spent per upload: its capacity on one free core, whatever the load of
        # the (shared) machine during the run
        "server_cpu_ms_per_upload": 1e3 * server_cpu / len(lat),
        "server_capacity_per_core": len(lat) / server_cpu if server_cpu else None,
    }


#: The printed table: (header, row key, format spec).
TABLE = (("backend", "backend", "<10"), ("mode", "mode", "<20"), ("uploads", "uploads", ">8"),
         ("errors", "errors", ">7"), ("stored", "stored", ">7"),
         ("up/s", "uploads_per_s", ">9.0f"), ("p50 ms", "p50_ms", ">9.1f"),
         ("p99 ms", "p99_ms", ">9.1f"), ("max ms", "max_ms", ">9.1f"),
         ("srv cpu ms/up", "server_cpu_ms_per_upload", ">15.3f"))

def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("ingest")
    ap.add_argument("--db", nargs="+", default=["sqlite", "postgres"],
                    choices=["sqlite", "postgres"])
    ap.add_argument("--uploads", type=int, default=6000)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw",
                    help="load generator: lean asyncio HTTP/1.1 (default) or httpx")
    ap.add_argument("--rate", type=float, nargs="+", default=[1000.0, 0.0],
                    help="offered uploads/s, open loop; 0 = closed loop (as fast as answered)")
    ap.add_argument("--seeds", type=int, default=20, help="scalars per upload")
    ap.add_argument("--batch", type=int, default=256, help="most uploads per commit")
    ap.add_argument("--json", type=Path, default=Path("runs/ingest.json"))
    args = ap.parse_args(argv)
    if args.client == "httpx" and any(args.rate):
        ap.error("--client httpx runs a closed loop only; pass --rate 0")

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "model")
        rows = [bench(b, rate, args, model) for b in args.db for rate in args.rate]
    write_json(args.json, {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                           "target": ">= 1000 uploads/s, p99 < 100 ms (SQLite)",
                           "results": rows}, newline=False)
    print("\n".join(text_table(TABLE, rows)))
    print(f"(load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
