"""``dlserve doctor [--url URL] [--model-repository DIR] [--gpu] [--json]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from dlserve.doctor import gpu, host, server
from dlserve.doctor.report import Row, as_json, as_table, exit_status


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlserve doctor",
        description="Check this host for what dlserve needs; print each finding with its fix. "
        "Exit status 1 when something the server needs is broken.",
    )
    p.add_argument(
        "--url",
        help="a server to check against: host:port (HTTP), grpc://host:port or unix:PATH (gRPC)",
    )
    p.add_argument("--metrics-url", help="the server's metrics (default: --url's host, 8002)")
    p.add_argument(
        "--model-repository",
        type=Path,
        help="compare its instances' memory with the cgroup's limit",
    )
    p.add_argument("--gpu", action="store_true", help="the models need GPUs: none is a failure")
    p.add_argument(
        "--shm-need",
        type=int,
        default=256 << 20,
        metavar="BYTES",
        help="free bytes /dev/shm must have for clients' regions (256 MiB)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def checks(args: argparse.Namespace) -> list[Row]:
    gpus = gpu.nvml()
    rows = [
        host.shm_size(args.shm_need),
        host.shm_writable(),
        host.fd_limit(),
        host.memlock_limit(len(gpus.uuids)),
        host.memory_for_models(args.model_repository, len(gpus.uuids)),
        gpu.visible(gpus, args.gpu),
        *gpu.cuda_checks(gpus, args.gpu),
        gpu.mps(),
    ]
    if args.url:
        client = server.client_for(args.url)
        rows.append(server.reachable(client, args.url))
        if rows[-1].result == "ok":
            rows.append(server.shared_ipc(client))
            metrics = args.metrics_url or server.default_metrics_url(args.url)
            rows.append(server.server_gpus(metrics, gpus.uuids))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows = checks(args)
    print(as_json(rows) if args.json else as_table(rows))
    return exit_status(rows)
