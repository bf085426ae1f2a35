"""Object-storage benchmark: one state to one S3-compatible server, fastckpt vs its peers.

``python -m fastckpt.bench.s3 --size-mib 1024 --out benches/results`` starts a local server
on 127.0.0.1 (``--server``: ``s3s`` for the Rust ``s3s-fs`` that ``make s3-server`` builds,
``moto``, or ``auto``, s3s when built), or uses ``--endpoint`` with credentials from the AWS
environment; builds one state (weights + Adam moments, as the main harness does) and moves it
up and down with:

* ``save_checkpoint`` and ``manager``: the front doors users call, on an ``s3://`` root / id
  (``save_checkpoint`` / ``load_checkpoint`` of the state held by a module, and a sync
  ``CheckpointManager`` ``save`` / ``load``), every save a full write (``incremental=False``;
  per-tensor crc32c, uploads and ranged GETs on Rust threads, verified download), with the
  request shapes measured best for the server (:data:`PROFILES`);
* ``boto3``: ``safetensors.torch.save`` + ``upload_fileobj`` with a threaded ``TransferConfig``,
  ``download_fileobj`` + ``safetensors.torch.load``; ``boto3-profile``: the same with
  fastckpt's shapes;
* ``s3fs``: the same bytes through ``fsspec`` file objects (what DCP's ``FsspecWriter`` /
  ``FsspecReader`` do).

Async stall: the same state saved by ``CheckpointManager`` with ``async_save`` to a local
directory and to ``s3://`` on the same server, alternately, every tensor changed before each
save: the seconds until the caller may mutate the state again (``save()`` plus
``manager.lock()``: the stall a training loop sees) and the seconds until the save is durable
(``future.result()``).

Every writer gets the same part size and concurrency; each repeat starts with another writer.
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
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from fastckpt.bench.compare import same_bits
from fastckpt.bench.environment import describe, load_average
from fastckpt.bench.state import build_state, plan_state, state_bytes
from fastckpt.bench.stats import summarize
from fastckpt.errors import MissingDependencyError

__all__ = ["StateModule", "async_stall", "front_door_writers", "main", "run"]

BUCKET = "fastckpt-bench"
_KEY_ID = "bench"
_SECRET = "bench-secret"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 where unreadable)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: Where ``make s3-server`` installs the ``s3s-fs`` binary (relative to the repository).
S3S_FS_BINARY = Path(".tools") / "bin" / "s3s-fs"
SERVERS = ("auto", "s3s", "moto")


def s3s_fs_binary() -> Path | None:
    """The ``s3s-fs`` server binary: ``$FASTCKPT_S3S_FS``, else ``.tools/bin/s3s-fs`` in the
    current directory or the source checkout (``make s3-server`` builds it there), else one on
    ``PATH``; None when there is none."""
    named = os.environ.get("FASTCKPT_S3S_FS")
    if named:
        return Path(named)
    checkout = Path(__file__).resolve().parents[3]
    for candidate in (Path.cwd() / S3S_FS_BINARY, checkout / S3S_FS_BINARY):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("s3s-fs")
    return Path(found) if found else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_listening(process: subprocess.Popen[bytes], port: int, name: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the {name} server did not start") from None
            time.sleep(0.1)


@contextmanager
def local_server(kind: str = "moto", data_dir: Path | None = None) -> Iterator[tuple[str, int]]:
    """A local S3-compatible server in a child process on a free port of 127.0.0.1:
    ``(endpoint, pid)``.

    Args:
        kind: ``"moto"`` (moto's Python server, from the ``dev`` extra; accepts any key) or
            ``"s3s"`` (the Rust ``s3s-fs`` server from ``make s3-server``; accepts only the
            benchmark's key ``bench`` / ``bench-secret``).
        data_dir: where ``s3s-fs`` keeps its objects (a directory it may fill).

    Raises:
        RuntimeError: the server did not start, or ``s3s`` was asked for and is not installed.
        MissingDependencyError: ``moto`` was asked for and is not installed.
    """
    port = _free_port()
    if kind == "moto":
        if find_spec("moto") is None or find_spec("flask") is None:  # its server's needs
            raise MissingDependencyError(
                "the moto server is not installed (pip install 'moto[server]', or the 'dev' "
                "extra): pass --server s3s (make s3-server) or --endpoint URL instead"
            )
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    elif kind == "s3s":
        binary = s3s_fs_binary()
        if binary is None:
            raise RuntimeError("s3s-fs is not installed; run `make s3-server` (or --server moto)")
        if data_dir is None:
            raise ValueError("the s3s server needs a data_dir")
        command = [
            str(binary),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--access-key",
            _KEY_ID,
            "--secret-key",
            _SECRET,
            str(data_dir),
        ]
    else:
        raise ValueError(f"unknown server {kind!r}; use one of {SERVERS[1:]}")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(process, port, kind)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def _s3s_version(binary: Path) -> str:
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "s3s-fs"
    return out or "s3s-fs"


def _purge_finished_parts(data_dir: Path) -> None:
    """Remove the part files ``s3s-fs`` keeps after completing a multipart upload (it leaks
    them; between repeats no upload is in flight, so every part file is a finished one)."""
    for leaked in data_dir.glob(".upload_id-*.part-*"):
        leaked.unlink(missing_ok=True)
    for leaked in data_dir.glob(".upload-*.json"):
        leaked.unlink(missing_ok=True)


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
Writer = tuple[Upload, Callable[[], Any], Callable[[], None]]


#: Request shapes measured best per local server (``S3Options`` thresholds; None: the
#: defaults, which suit AWS S3: multipart above one part, ranged GETs above one range).
#: s3s-fs writes each part to a file and copies all of them into the object when the upload
#: completes, so one PUT costs it 2.7 server CPU-s/GiB against 6.1 for any multipart
#: shape; it answers 32 MiB ranges (2.9 CPU-s/GiB) more cheaply than one whole-object GET
#: (3.8-5.8). moto spends 6.5 CPU-s/GiB on one PUT against 12 on a multipart upload, and
#: reads the whole object to answer each range, so one GET is cheapest there.
#: (docs/object-storage.md has the measurements.)
PROFILES: dict[str, dict[str, int | None]] = {
    "s3s": {"multipart_threshold": 5 << 30, "ranged_get_threshold": None},
    "moto": {"multipart_threshold": 5 << 30, "ranged_get_threshold": 1 << 50},
    "endpoint": {"multipart_threshold": None, "ranged_get_threshold": None},
}


def _writers(
    endpoint: str | None,
    bucket: str,
    prefix: str,
    part: int,
    concurrency: int,
    local: bool,
    profile: dict[str, int | None],
) -> dict[str, Writer]:
    """name -> (upload(state), download() -> tensors, tidy() untimed between repeats).

    The front doors (``save_checkpoint``, ``manager``) use the server's ``profile`` (request
    shapes measured best there); ``boto3`` and ``s3fs`` the shapes the issue names (multipart
    above one part, ranges / blocks of one part); ``boto3-profile`` boto3 with the same
    request shapes as the front doors (isolates what the shape, not the client, is worth on
    this server).
    """
    from boto3.s3.transfer import TransferConfig
    from safetensors.torch import load as load_bytes
    from safetensors.torch import save as save_bytes

    options: dict[str, Any] = {
        "part_size": part,
        "read_part_size": part,
        "concurrency": concurrency,
    }
    if endpoint is not None:
        options["endpoint_url"] = endpoint
    if local:
        options.update(access_key_id=_KEY_ID, secret_access_key=_SECRET, region="us-east-1")
    client = _boto3_client(endpoint, concurrency, local)

    def boto3_writer(name: str, up_threshold: int, down_threshold: int) -> Writer:
        key = f"{prefix}/{name}/state.safetensors"
        up_config, down_config = (
            TransferConfig(
                multipart_threshold=threshold, multipart_chunksize=part, max_concurrency=concurrency
            )
            for threshold in (up_threshold, down_threshold)
        )

        def up(state: dict[str, torch.Tensor]) -> None:
            data = save_bytes(state)
            client.upload_fileobj(io.BytesIO(data), bucket, key, Config=up_config)

        def down() -> Any:
            sink = io.BytesIO()
            client.download_fileobj(bucket, key, sink, Config=down_config)
            return load_bytes(sink.getvalue())

        return up, down, _nothing

    tuned = {k: v for k, v in profile.items() if v is not None}
    writers: dict[str, Writer] = front_door_writers(f"s3://{bucket}/{prefix}", {**options, **tuned})
    writers["boto3"] = boto3_writer("boto3", part, part)
    if tuned:
        # boto3 takes one threshold per direction, applied to the object size as ours is.
        up_max = profile["multipart_threshold"]
        down_max = profile["ranged_get_threshold"]
        writers["boto3-profile"] = boto3_writer(
            "boto3-profile",
            part if up_max is None else up_max + 1,
            part if down_max is None else down_max + 1,
        )
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

    writers["s3fs"] = (s3fs_up, s3fs_down, _nothing)
    return writers


def _nothing() -> None:
    pass


class StateModule(torch.nn.Module):
    """A module whose buffers are a flat state (``save_checkpoint`` saves modules), rebuilt
    from the names, shapes and dtypes it records; the buffers are named ``t0``, ``t1``, ...
    because state keys hold dots."""

    def __init__(self, layout: list[list[Any]]) -> None:
        """``layout``: ``[name, shape, dtype name]`` per tensor, in order."""
        super().__init__()
        self.names = [name for name, _, _ in layout]
        for index, (_, shape, dtype) in enumerate(layout):
            self.register_buffer(f"t{index}", torch.empty(shape, dtype=getattr(torch, dtype)))

    @classmethod
    def holding(cls, state: dict[str, torch.Tensor]) -> StateModule:
        """A module whose buffers are ``state``'s tensors themselves (no copy), with its spec."""
        from fastckpt.checkpoint.specs import attach_spec, create_model_spec

        layout = [
            [name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in state.items()
        ]
        module = cls([[name, [0], dtype] for name, _, dtype in layout])
        for index, tensor in enumerate(state.values()):
            module._buffers[f"t{index}"] = tensor
        attach_spec(module, create_model_spec(cls, layout=layout))
        return module

    def state(self) -> dict[str, torch.Tensor]:
        """The flat state back, by its original names."""
        return {name: getattr(self, f"t{i}") for i, name in enumerate(self.names)}


def front_door_writers(url: str, options: dict[str, Any]) -> dict[str, Writer]:
    """``save_checkpoint`` and ``manager`` rows: the state through the public calls to an
    ``s3://`` root and a manager checkpoint id under ``url`` (``options`` registered for it
    with :func:`fastckpt.configure_storage`), every save a full write."""
    import fastckpt

    fastckpt.configure_storage(url, options)
    root = f"{url}/save_checkpoint"

    def sc_up(state: dict[str, torch.Tensor]) -> None:
        module = StateModule.holding(state)
        fastckpt.save_checkpoint(root, models={"state": (module, None)}, incremental=False)

    def sc_down() -> Any:
        loaded = fastckpt.load_checkpoint(root)
        module = loaded["models"]["state"]["model"]
        assert isinstance(module, StateModule)
        return module.state()

    def sc_tidy() -> None:
        fastckpt.prune(root, keep_last=1)  # keeps the server's storage flat across repeats

    config = fastckpt.CheckpointManager.Config.with_sync_save()
    config.incremental = False
    checkpoint_id = f"{url}/manager/ckpt"

    def manager_up(state: dict[str, torch.Tensor]) -> None:
        with fastckpt.CheckpointManager(config) as manager:
            manager.save(checkpoint_id, {"state": state})

    def manager_down() -> Any:
        with fastckpt.CheckpointManager(config) as manager:
            return manager.load(checkpoint_id)["state"]

    return {
        "save_checkpoint": (sc_up, sc_down, sc_tidy),
        "manager": (manager_up, manager_down, _nothing),
    }


def run(
    size_mib: int,
    repeats: int,
    part_mib: int,
    concurrency: int,
    endpoint: str | None = None,
    bucket: str = BUCKET,
    server: str = "auto",
) -> dict[str, Any]:
    """Measure every writer; returns the JSON document (see :func:`main`).

    ``server``: the local server to start when no ``endpoint`` is given: ``"s3s"``,
    ``"moto"``, or ``"auto"`` (``s3s`` when ``make s3-server`` installed it, else moto).
    """
    spec = plan_state(size_mib / 1024)
    state = build_state(spec)
    nbytes = state_bytes(state)
    gib = nbytes / 2**30
    part = part_mib << 20
    local = endpoint is None
    load_before = load_average()
    kind = "endpoint" if endpoint is not None else resolve_server(server)
    with _server(endpoint, server, nbytes) as (url, server_pid, server_label, data_dir):
        if local:
            _boto3_client(url, concurrency, local).create_bucket(Bucket=bucket)
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        profile = PROFILES[kind]
        writers = _writers(url, bucket, prefix, part, concurrency, local, profile)
        raw: dict[str, dict[str, list[float]]] = {name: {} for name in writers}
        order = list(writers.items())
        for repeat in range(repeats):
            # Interleaved: each repeat starts with another writer, so no writer always runs
            # first (or last) into a server and page cache its predecessor warmed.
            shift = repeat % len(order)
            for name, (upload, download, tidy) in order[shift:] + order[:shift]:
                phases: list[tuple[str, Callable[[], Any]]] = [
                    ("upload", functools.partial(upload, state)),
                    ("download", download),
                ]
                for phase, call in phases:
                    cpu, served = _cpu_seconds(), process_cpu(server_pid)
                    start = time.perf_counter()
                    result = call()
                    elapsed = time.perf_counter() - start
                    figures = raw[name]
                    figures.setdefault(f"{phase}_s", []).append(elapsed)
                    figures.setdefault(f"{phase}_client_cpu_s", []).append(_cpu_seconds() - cpu)
                    server_cpu = process_cpu(server_pid) - served
                    figures.setdefault(f"{phase}_server_cpu_s", []).append(server_cpu)
                    if phase == "download":
                        _check_equal(name, result, state)
                    del result
                tidy()
                if data_dir is not None:
                    _purge_finished_parts(data_dir)
        import tempfile

        stall_options: dict[str, Any] = {"part_size": part, "concurrency": concurrency}
        if url is not None:
            stall_options["endpoint_url"] = url
        if local:
            stall_options.update(
                access_key_id=_KEY_ID, secret_access_key=_SECRET, region="us-east-1"
            )
        stall_options.update({k: v for k, v in profile.items() if v is not None})
        with tempfile.TemporaryDirectory(prefix="fastckpt-stall-", dir=".") as scratch:
            stall = async_stall(
                state, f"s3://{bucket}/{prefix}/stall", stall_options, Path(scratch), repeats
            )
        from fastckpt.storage.s3.tensors import tensor_crcs

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
        "server": server_label,
        "state_bytes": nbytes,
        "tensors": len(state),
        "part_bytes": part,
        "fastckpt_profile": profile,
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
    ``local_dir`` and to the ``s3://`` prefix ``url`` (``options``: its client options).

    Every tensor changes between saves (as after an optimizer step; an unchanged tensor
    would be an incremental reference, neither staged nor written), and the two
    destinations alternate save by save, each with its own manager.
    """
    from contextlib import ExitStack

    from fastckpt.manager import CheckpointManager
    from fastckpt.storage.registry import configure_storage

    configure_storage(url, options)
    targets = {"local": str(local_dir / "ckpt"), "s3": f"{url}/ckpt"}
    stalls: dict[str, list[float]] = {name: [] for name in targets}
    totals: dict[str, list[float]] = {name: [] for name in targets}
    try:
        with ExitStack() as stack:
            managers = {
                name: stack.enter_context(
                    CheckpointManager(CheckpointManager.Config.with_async_save())
                )
                for name in targets
            }
            for _ in range(repeats + 1):  # the first save warms the staging buffers
                for name, target in targets.items():
                    _step(state)
                    manager = managers[name]
                    start = time.perf_counter()
                    future = manager.save(target, {"state": state})
                    with manager.lock():  # what the next optimizer step waits for
                        stalled = time.perf_counter() - start
                    if future is not None:
                        future.result()
                    stalls[name].append(stalled)
                    totals[name].append(time.perf_counter() - start)
    finally:
        configure_storage(url)
    rows: dict[str, Any] = {
        name: {"stall_s": summarize(stalls[name][1:]), "total_s": summarize(totals[name][1:])}
        for name in targets
    }
    local, remote = rows["local"]["stall_s"]["median"], rows["s3"]["stall_s"]["median"]
    rows["stall_ratio_s3_over_local"] = remote / local if local else None
    return rows


def _step(state: dict[str, torch.Tensor]) -> None:
    """Change every element of every tensor (a stand-in for an optimizer step)."""
    with torch.no_grad():
        for tensor in state.values():
            if tensor.is_floating_point():
                tensor.neg_()  # flips the sign bit, zeros included
            elif tensor.dtype == torch.bool:
                tensor.logical_not_()
            else:
                tensor.add_(1)


def resolve_server(server: str) -> str:
    """``"s3s"`` or ``"moto"`` for a ``--server`` choice (``auto``: s3s when installed)."""
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; use one of {SERVERS}")
    if server == "auto":
        return "s3s" if s3s_fs_binary() is not None else "moto"
    return server


def _scratch_parent(nbytes: int) -> str | None:
    """Memory-backed /dev/shm when it has room for the objects the run keeps at once (three
    writers' objects plus one upload's parts), else the default temporary directory."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stats.f_bavail * stats.f_frsize > 6 * nbytes + (1 << 30) else None


@contextmanager
def _server(
    endpoint: str | None, server: str, nbytes: int
) -> Iterator[tuple[str | None, int | None, str, Path | None]]:
    """``(endpoint, server pid, label for the results, s3s data directory)``."""
    if endpoint is not None:
        yield endpoint, None, endpoint, None
        return
    kind = resolve_server(server)
    if kind == "moto":
        with local_server("moto") as (url, pid):
            yield url, pid, "moto (Python, local, 127.0.0.1)", None
        return
    import tempfile

    binary = s3s_fs_binary()
    assert binary is not None
    with tempfile.TemporaryDirectory(prefix="fastckpt-s3s-", dir=_scratch_parent(nbytes)) as tmp:
        data_dir = Path(tmp)
        where = "memory (/dev/shm)" if tmp.startswith("/dev/shm") else "disk"
        label = f"{_s3s_version(binary)} (Rust, local, 127.0.0.1, objects in {where})"
        with local_server("s3s", data_dir) as (url, pid):
            yield url, pid, label, data_dir


def _check_equal(
    name: str, loaded: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
) -> None:
    if set(loaded) != set(state) or not all(same_bits(loaded[k], v) for k, v in state.items()):
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


def _shapes(profile: dict[str, int | None]) -> str:
    up, down = profile["multipart_threshold"], profile["ranged_get_threshold"]
    put = "multipart above one part" if up is None else f"one PUT up to {up / 2**30:g} GiB"
    get = "ranged GETs above one range" if down is None else "one GET per object"
    if down is not None and down < 1 << 40:
        get = f"one GET up to {down / 2**20:g} MiB"
    return f"{put}, {get}"


#: fastckpt's rows, compared with every peer: the two front doors.
_OURS = ("save_checkpoint", "manager")


def _load_line(document: dict[str, Any]) -> str:
    """The machine's load average around the run (1, 5, 15 minutes)."""
    load = document.get("load_average") or {}
    before, after = load.get("before"), load.get("after")
    if not before or not after:
        return "Load average: not recorded."
    cores = os.cpu_count() or 0
    text = (
        f"Load average (1/5/15 min) before the run {before[0]:.2f} / {before[1]:.2f} / "
        f"{before[2]:.2f}, after it {after[0]:.2f} / {after[1]:.2f} / {after[2]:.2f}, on "
        f"{cores} cores"
    )
    if max(before[0], after[0]) > cores:
        text += " (high: other jobs shared the cores during the run, the figures are noisier)"
    return text + "."


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
        f"fastckpt's request shapes for this server: {_shapes(document['fastckpt_profile'])}; "
        "boto3-profile: boto3 with fastckpt's shapes; boto3 and s3fs: multipart above one "
        "part, ranges / blocks of one part.",
        "",
        _load_line(document),
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
    ours = [name for name in _OURS if name in rows]
    peers = [name for name in rows if name not in ours]
    lines += [
        "",
        "save_checkpoint and manager: the front doors (save_checkpoint / load_checkpoint on an "
        "s3:// root, a sync CheckpointManager on an s3:// id), every save a full write.",
        "",
        "| ratio (ours / peer) | " + " | ".join(f"{p} up | {p} down" for p in peers) + " |",
        "|---|" + "---|---|" * len(peers),
    ]
    for name in ours:
        mine = rows[name]
        cells = [
            f"{mine['upload_gib_s'] / rows[p]['upload_gib_s']:.2f}x "
            f"| {mine['download_gib_s'] / rows[p]['download_gib_s']:.2f}x"
            for p in peers
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
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
    parser.add_argument("--part-mib", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--endpoint", default=None, help="an existing server (credentials from AWS_*)"
    )
    parser.add_argument("--bucket", default=BUCKET)
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default="auto",
        help="local server without --endpoint: s3s-fs (Rust, `make s3-server`), moto "
        "(Python), or auto (s3s when installed)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    document = run(
        args.size_mib,
        args.repeats,
        args.part_mib,
        args.concurrency,
        args.endpoint,
        args.bucket,
        args.server,
    )
    table = markdown(document)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"s3-{args.size_mib}mib"  # the server is named inside
        stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
        stem.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
