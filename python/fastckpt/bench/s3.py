"""Object-storage benchmark: one state to one S3-compatible server, fastckpt vs its peers.

``python -m fastckpt.bench.s3 --size-mib 256 --out benches/results`` starts a local moto
server on 127.0.0.1 (or uses ``--endpoint`` with credentials from the AWS environment), builds
one state (weights + Adam moments, as the main harness does) and moves it up and down with:

* ``fastckpt``: :class:`fastckpt.store.s3commit.S3Root` ``save`` / ``load`` (per-tensor crc32c,
  parallel multipart upload and parallel ranged GETs on Rust threads, verified download);
* ``boto3``: ``safetensors.torch.save`` + ``upload_fileobj`` with a threaded ``TransferConfig``,
  ``download_fileobj`` + ``safetensors.torch.load``;
* ``s3fs``: the same bytes through ``fsspec`` file objects (what DCP's ``FsspecWriter`` /
  ``FsspecReader`` do).

Async stall: the same state saved by ``CheckpointManager`` with ``async_save`` to a local
directory and to ``s3://`` on the same server: the seconds until the caller may mutate the
state again (``save()`` plus ``manager.lock()``: the stall a training loop sees) and the
seconds until the save is durable (``future.result()``).

Every writer gets the same part size and concurrency; the writers interleave across repeats.
Throughput is state bytes / wall seconds of the user-visible call (serialization included).
Client and server CPU seconds per GiB are recorded too: on one small machine the server's
CPU, not the client, usually sets the pace.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import resource
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fastckpt.bench.environment import describe, load_average
from fastckpt.bench.state import build_state, plan_state, state_bytes
from fastckpt.bench.stats import summarize

__all__ = ["async_stall", "main", "run"]

BUCKET = "fastckpt-bench"
_KEY_ID = "bench"
_SECRET = "bench-secret"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _process_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def local_server() -> Iterator[tuple[str, int]]:
    """A moto S3 server in a child process on a free port of 127.0.0.1: ``(endpoint, pid)``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def _boto3_client(endpoint: str | None, concurrency: int, local: bool) -> Any:
    import boto3
    import botocore.config

    config = botocore.config.Config(
        max_pool_connections=max(10, 2 * concurrency),
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    if not local:
        return boto3.client("s3", endpoint_url=endpoint, config=config)
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=_KEY_ID,
        aws_secret_access_key=_SECRET,
        config=config,
    )


Upload = Callable[[dict[str, torch.Tensor]], None]
Writer = tuple[Upload | None, Callable[[], Any], Callable[[], None]]


def _writers(
    endpoint: str | None, bucket: str, prefix: str, part: int, concurrency: int, local: bool
) -> dict[str, Writer]:
    """name -> (upload(state) or None for a download-only variant, download() -> tensors,
    tidy() untimed between repeats)."""
    from boto3.s3.transfer import TransferConfig
    from safetensors.torch import load as load_bytes
    from safetensors.torch import save as save_bytes

    from fastckpt.store.s3commit import S3Root

    options: dict[str, Any] = {
        "part_size": part,
        "read_part_size": part,
        "concurrency": concurrency,
    }
    if endpoint is not None:
        options["endpoint_url"] = endpoint
    if local:
        options.update(access_key_id=_KEY_ID, secret_access_key=_SECRET, region="us-east-1")
    root = S3Root(f"s3://{bucket}/{prefix}/fastckpt", options)
    client = _boto3_client(endpoint, concurrency, local)
    transfer = TransferConfig(
        multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency
    )
    boto_key = f"{prefix}/boto3/state.safetensors"

    def fastckpt_up(state: dict[str, torch.Tensor]) -> None:
        root.save({"state.safetensors": state})

    def fastckpt_tidy() -> None:
        root.prune(keep_last=1)  # keeps the server's memory flat across repeats

    def nothing() -> None:
        pass

    def fastckpt_down() -> Any:
        return root.load().files["state.safetensors"]

    # The same objects read back as one streamed GET per object instead of ranges: isolates
    # what a server charges per ranged GET (moto reads the whole object for each).
    one_get = S3Root(root.url, {**options, "read_part_size": 1 << 50})

    def fastckpt_one_get_down() -> Any:
        return one_get.load().files["state.safetensors"]

    def boto3_up(state: dict[str, torch.Tensor]) -> None:
        data = save_bytes(state)
        client.upload_fileobj(io.BytesIO(data), bucket, boto_key, Config=transfer)

    def boto3_down() -> Any:
        sink = io.BytesIO()
        client.download_fileobj(bucket, boto_key, sink, Config=transfer)
        return load_bytes(sink.getvalue())

    writers: dict[str, Writer] = {
        "fastckpt": (fastckpt_up, fastckpt_down, fastckpt_tidy),
        "fastckpt-1get": (None, fastckpt_one_get_down, nothing),
        "boto3": (boto3_up, boto3_down, nothing),
    }
    try:
        import s3fs
    except ImportError:
        return writers
    credentials = {"key": _KEY_ID, "secret": _SECRET} if local else {}
    fs = s3fs.S3FileSystem(
        endpoint_url=endpoint,
        client_kwargs={"region_name": "us-east-1"} if local else {},
        default_block_size=part,
        **credentials,
    )
    fs_path = f"{bucket}/{prefix}/s3fs/state.safetensors"

    def s3fs_up(state: dict[str, torch.Tensor]) -> None:
        data = save_bytes(state)
        with fs.open(fs_path, "wb", block_size=part) as handle:
            handle.write(data)

    def s3fs_down() -> Any:
        with fs.open(fs_path, "rb", block_size=part) as handle:
            return load_bytes(handle.read())

    writers["s3fs"] = (s3fs_up, s3fs_down, nothing)
    return writers


def run(
    size_mib: int,
    repeats: int,
    part_mib: int,
    concurrency: int,
    endpoint: str | None = None,
    bucket: str = BUCKET,
) -> dict[str, Any]:
    """Measure every writer; returns the JSON document (see :func:`main`)."""
    spec = plan_state(size_mib / 1024)
    state = build_state(spec)
    nbytes = state_bytes(state)
    gib = nbytes / 2**30
    part = part_mib << 20
    local = endpoint is None
    load_before = load_average()
    with _server(endpoint) as (url, server_pid):
        if local:
            _boto3_client(url, concurrency, local).create_bucket(Bucket=bucket)
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        writers = _writers(url, bucket, prefix, part, concurrency, local)
        raw: dict[str, dict[str, list[float]]] = {name: {} for name in writers}
        for _ in range(repeats):
            for name, (upload, download, tidy) in writers.items():
                phases: list[tuple[str, Callable[[], Any]]] = [("download", download)]
                if upload is not None:
                    phases.insert(0, ("upload", functools.partial(upload, state)))
                for phase, call in phases:
                    cpu, server = _cpu_seconds(), _process_cpu(server_pid)
                    start = time.perf_counter()
                    result = call()
                    elapsed = time.perf_counter() - start
                    figures = raw[name]
                    figures.setdefault(f"{phase}_s", []).append(elapsed)
                    figures.setdefault(f"{phase}_client_cpu_s", []).append(_cpu_seconds() - cpu)
                    server_cpu = _process_cpu(server_pid) - server
                    figures.setdefault(f"{phase}_server_cpu_s", []).append(server_cpu)
                    if phase == "download":
                        _check_equal(name, result, state)
                    del result
                tidy()
        import tempfile

        stall_options: dict[str, Any] = {"part_size": part, "concurrency": concurrency}
        if url is not None:
            stall_options["endpoint_url"] = url
        if local:
            stall_options.update(
                access_key_id=_KEY_ID, secret_access_key=_SECRET, region="us-east-1"
            )
        with tempfile.TemporaryDirectory(prefix="fastckpt-stall-", dir=".") as scratch:
            stall = async_stall(
                state, f"s3://{bucket}/{prefix}/stall", stall_options, Path(scratch), repeats
            )
        from fastckpt.store.s3tensors import tensor_crcs

        hashing = []
        views = [t.reshape(-1).view(torch.uint8).numpy() for t in state.values()]
        for _ in range(repeats):
            start = time.perf_counter()
            tensor_crcs(views)
            hashing.append(time.perf_counter() - start)
    rows = {}
    for name, figures in raw.items():
        up, down = summarize(figures.get("upload_s", [])), summarize(figures["download_s"])
        rows[name] = {
            "upload_gib_s": gib / up["median"] if up["median"] else None,
            "download_gib_s": gib / down["median"] if down["median"] else None,
            "upload_s": up,
            "download_s": down,
            "raw": figures,
        }
        for phase in ("upload", "download"):
            for side in ("client", "server"):
                per_gib = [c / gib for c in figures.get(f"{phase}_{side}_cpu_s", [])]
                rows[name][f"{phase}_{side}_cpu_s_per_gib"] = summarize(per_gib)
    return {
        "scenario": "s3",
        "server": "moto (local, 127.0.0.1)" if endpoint is None else endpoint,
        "state_bytes": nbytes,
        "tensors": len(state),
        "part_bytes": part,
        "concurrency": concurrency,
        "repeats": repeats,
        "crc32c_prepass_s": summarize(hashing),
        "writers": rows,
        "async_stall": stall,
        "load_average": {"before": load_before, "after": load_average()},
        "environment": describe("."),
    }


def async_stall(
    state: dict[str, torch.Tensor], url: str, options: dict[str, Any], local_dir: Path, repeats: int
) -> dict[str, Any]:
    """Stall and total seconds of an async ``CheckpointManager.save`` of ``state`` to
    ``local_dir`` and to the ``s3://`` prefix ``url`` (``options``: its client options)."""
    from fastckpt.manager import CheckpointManager
    from fastckpt.store.dispatch import configure_storage

    configure_storage(url, options)
    rows: dict[str, Any] = {}
    try:
        for name, target in (("local", str(local_dir / "ckpt")), ("s3", f"{url}/ckpt")):
            stalls: list[float] = []
            totals: list[float] = []
            with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
                for _ in range(repeats + 1):  # the first save warms the staging buffers
                    start = time.perf_counter()
                    future = manager.save(target, {"state": state})
                    with manager.lock():  # what the next optimizer step waits for
                        stalled = time.perf_counter() - start
                    if future is not None:
                        future.result()
                    stalls.append(stalled)
                    totals.append(time.perf_counter() - start)
            rows[name] = {"stall_s": summarize(stalls[1:]), "total_s": summarize(totals[1:])}
    finally:
        configure_storage(url)
    local, remote = rows["local"]["stall_s"]["median"], rows["s3"]["stall_s"]["median"]
    rows["stall_ratio_s3_over_local"] = remote / local if local else None
    return rows


@contextmanager
def _server(endpoint: str | None) -> Iterator[tuple[str | None, int | None]]:
    if endpoint is not None:
        yield endpoint, None
        return
    with local_server() as (url, pid):
        yield url, pid


def _check_equal(
    name: str, loaded: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
) -> None:
    if set(loaded) != set(state) or not all(torch.equal(loaded[k], v) for k, v in state.items()):
        raise AssertionError(f"{name}: the downloaded state differs from the uploaded one")


def _cpu(row: dict[str, Any], phase: str) -> str:
    client = row[f"{phase}_client_cpu_s_per_gib"]["median"]
    server = row[f"{phase}_server_cpu_s_per_gib"]["median"]
    return "-" if client is None else f"{client:.2f} / {server:.2f}"


def _span(summary: dict[str, Any]) -> str:
    ms = {key: 1000 * summary[key] for key in ("median", "min", "max")}
    return f"{ms['median']:.1f} ({ms['min']:.1f}-{ms['max']:.1f})"


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def markdown(document: dict[str, Any]) -> str:
    """The results as a markdown table (ratios against each peer)."""
    rows = document["writers"]
    mib = document["state_bytes"] / 2**20
    lines = [
        f"# Object storage: {mib:.0f} MiB state, {document['server']}",
        "",
        f"{document['tensors']} tensors, parts/ranges of {document['part_bytes'] >> 20} MiB, "
        f"concurrency {document['concurrency']}, {document['repeats']} repeats (median, "
        "min-max). CPU: seconds per GiB moved, client process / server process.",
        "",
        "| writer | upload GiB/s | download GiB/s | upload s (min-max) | download s (min-max) "
        "| upload CPU client/server | download CPU client/server |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        up, down = row["upload_s"], row["download_s"]
        up_range = "-" if up["min"] is None else f"{up['min']:.2f}-{up['max']:.2f}"
        lines.append(
            f"| {name} | {_fmt(row['upload_gib_s'])} | {_fmt(row['download_gib_s'])} "
            f"| {up_range} | {down['min']:.2f}-{down['max']:.2f} "
            f"| {_cpu(row, 'upload')} | {_cpu(row, 'download')} |"
        )
    ours = rows["fastckpt"]
    lines += ["", "| ratio (fastckpt / peer) | upload | download |", "|---|---|---|"]
    for name, row in rows.items():
        if not name.startswith("fastckpt"):
            lines.append(
                f"| vs {name} | {ours['upload_gib_s'] / row['upload_gib_s']:.2f}x "
                f"| {ours['download_gib_s'] / row['download_gib_s']:.2f}x |"
            )
    stall = document.get("async_stall")
    if stall is not None:
        lines += [
            "",
            "CheckpointManager async save: milliseconds until the caller may mutate the state "
            "again (stall: save() + manager.lock()) and until the checkpoint is durable "
            "(total), median (min-max).",
            "",
            "| destination | stall ms | total ms |",
            "|---|---|---|",
        ]
        for name in ("local", "s3"):
            row = stall[name]
            lines.append(f"| {name} | {_span(row['stall_s'])} | {_span(row['total_s'])} |")
        lines += ["", f"stall ratio s3 / local disk: {stall['stall_ratio_s3_over_local']:.2f}x"]
    prepass = document["crc32c_prepass_s"]["median"]
    lines += [
        "",
        f"fastckpt's crc32c pass over the state (before its upload): {prepass:.3f} s "
        f"({document['state_bytes'] / 2**30 / prepass:.1f} GiB/s).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: run, print the table, write ``s3-<size>mib.json`` / ``.md`` to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m fastckpt.bench.s3", description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--endpoint", default=None, help="an existing server (credentials from AWS_*)"
    )
    parser.add_argument("--bucket", default=BUCKET)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    document = run(
        args.size_mib, args.repeats, args.part_mib, args.concurrency, args.endpoint, args.bucket
    )
    table = markdown(document)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"s3-{args.size_mib}mib"
        stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
        stem.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
