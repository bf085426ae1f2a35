"""A real S3-compatible server for the tests: moto in server mode, in its own process.

:class:`S3Server` starts ``python tests/s3_support.py serve`` on a free port of 127.0.0.1. The
child creates an IAM user with an access key allowed ``s3:*`` and one bucket, then switches
moto's request authentication on: from then on a wrong key is refused (403), as on a real
store. The child keeps its objects in memory (large ones spooled to temporary files) for its
whole life, so :meth:`S3Server.stop` can take the listener down (connections refused, open
ones cut) and :meth:`S3Server.start` bring it back on the same port with every object intact:
a server outage that loses nothing, as a real store's would.

Tests get a server from the :func:`s3_server` fixture (one per test module), a fresh
``s3://`` URL per test from :func:`s3_root`, and the standard AWS variables pointing at the
server (in a scratch working directory) from :func:`s3_env`, or none of them from
:func:`no_aws_env`. No part of a client library is mocked: every byte goes through HTTP to
moto's S3 implementation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BUCKET = "fastckpt-tests"
REGION = "us-east-1"
_START_TIMEOUT_S = 120.0


class S3Server:
    """Handle on a moto S3 server process (see the module docstring).

    Attributes:
        endpoint: ``http://127.0.0.1:<port>``.
        access_key_id / secret_access_key: the key the server accepts.
        bucket: the bucket it was started with.
    """

    def __init__(self) -> None:
        env = dict(os.environ)
        # A test run must never reach a real account: no inherited AWS settings.
        for name in list(env):
            if name.startswith("AWS_"):
                del env[name]
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        info = json.loads(self._reply(_START_TIMEOUT_S))
        self.endpoint: str = info["endpoint"]
        self.access_key_id: str = info["access_key_id"]
        self.secret_access_key: str = info["secret_access_key"]
        self.bucket: str = info["bucket"]

    def _reply(self, timeout: float) -> str:
        assert self._process.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self._process.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not result or not result[0]:
            self.close()
            raise RuntimeError("the moto S3 server did not answer (see its stderr above)")
        return result[0].strip()

    def _command(self, word: str) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(word + "\n")
        self._process.stdin.flush()
        if self._reply(_START_TIMEOUT_S) != "ok":
            raise RuntimeError(f"the moto S3 server refused {word!r}")

    def aws_env(self) -> dict[str, str]:
        """The standard AWS variables that reach this server (and no metadata service)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def options(self, **overrides: Any) -> dict[str, Any]:
        """``storage_options`` that reach this server with its valid key (plus ``overrides``)."""
        options: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "region": REGION,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }
        options.update(overrides)
        return options

    def url(self, prefix: str) -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix}"

    def client(self) -> Any:
        """A boto3 client on this server (for tests that tamper with objects directly)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def stop(self) -> None:
        """Take the listener down: new connections are refused, open ones are cut."""
        self._command("stop")

    def start(self) -> None:
        """Listen again on the same port, with every object kept."""
        self._command("start")

    def close(self) -> None:
        """End the server process."""
        if self._process.poll() is None:
            if self._process.stdin is not None:
                self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server per test module (started in a child process, ended after)."""
    server = S3Server()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def s3_root(s3_server: S3Server) -> str:
    """A fresh ``s3://`` URL (a unique prefix in the server's bucket) for one test."""
    return s3_server.url(f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def s3_env(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """The server reached through the standard AWS variables, in a scratch working dir."""
    monkeypatch.chdir(tmp_path)
    env = s3_server.aws_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env
    # Nothing of an s3:// path may have gone to the local filesystem (Path("s3://b") is
    # the relative path s3:/b).
    assert not (tmp_path / "s3:").exists(), sorted(p.name for p in tmp_path.iterdir())


@pytest.fixture
def no_aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No AWS variable and no AWS config file: only options given per call reach a server."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    yield
    assert not (tmp_path / "s3:").exists(), sorted(p.name for p in tmp_path.iterdir())


# --------------------------------------------------------------------------- saver processes


class SaverFactory:
    """Starts saver processes quickly: a child that imported torch and fastckpt once forks a
    fresh saver per request (no object-store call happened before the fork, so no client
    thread is copied). Each saver saves in a loop until it is killed, through a front door
    (``door``):

    * ``"save_checkpoint"``: one :func:`front_door_model` whose bias is set to ``step``
      before each incremental ``fastckpt.save_checkpoint`` (``counters={"step": step}``: the
      frozen weight comes from the saver's previous index, partly copied by the store), then
      ``fastckpt.prune`` to three;
    * ``"manager"``: ``{"x": front_door_tensor(step), "step": step}`` replacing one
      ``CheckpointManager`` checkpoint id (sync saves).

    ``step`` is unique to the saver and the save (``(pid % 10000) * 1000 + n``), so a loaded
    state says which save wrote it."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def spawn(self, url: str, options: dict[str, Any], door: str) -> int:
        """Fork a saver for ``url``; returns its pid (kill it with SIGKILL)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        request = {"url": url, "options": options, "door": door}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError("the saver factory died (see its stderr above)")
        return int(line)

    def close(self) -> None:
        """End the factory."""
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            self._process.wait(timeout=30)


#: The value of every element of :func:`front_door_model`'s weight, whatever the step.
FROZEN_WEIGHT = 0.25


def front_door_model(step: int) -> Any:
    """A ``Linear(1024, 1536)`` (~6 MiB: a multipart upload with 5 MiB parts) whose weight is
    frozen at :data:`FROZEN_WEIGHT` and whose bias equals ``step``: an incremental save of it
    after a bias update has the store copy the weight."""
    import torch

    model = torch.nn.Linear(1024, 1536)
    with torch.no_grad():
        model.weight.fill_(FROZEN_WEIGHT)
        model.bias.fill_(float(step))
    model.weight.requires_grad_(False)
    return model


def front_door_tensor(step: int) -> Any:
    """~6 MiB of float32 all equal to ``step``."""
    import torch

    return torch.full((1536 * 1024,), float(step))


def _front_door_saver(door: str, url: str, options: dict[str, Any]) -> None:
    """Save through a public front door in a loop (see :class:`SaverFactory`)."""
    import torch

    import fastckpt
    from fastckpt.storage.registry import configure_storage

    configure_storage(url, options)
    first = (os.getpid() % 10000) * 1000
    if door == "save_checkpoint":
        model = front_door_model(first)
        for step in range(first, first + 1000):
            with torch.no_grad():
                model.bias.fill_(float(step))
            # Incremental: from the saver's second save on, the weight comes from the previous
            # index (its last part copied by the store, the rest fetched to fill a 5 MiB part).
            fastckpt.save_checkpoint(url, models={"main": model}, counters={"step": step})
            fastckpt.prune(url, keep_last=3)
    elif door == "manager":
        config = fastckpt.CheckpointManager.Config.with_sync_save()
        with fastckpt.CheckpointManager(config) as manager:
            for step in range(first, first + 1000):
                manager.save(url, {"x": front_door_tensor(step), "step": step})
    else:
        raise ValueError(f"unknown door {door!r}")


def _zygote() -> None:
    """Child process: fork one looping saver per request line on stdin."""
    import signal

    import fastckpt.checkpoint.api  # imported before forking, so a saver starts at once
    import fastckpt.manager  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # savers are reaped automatically
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _front_door_saver(request["door"], request["url"], request["options"])
            except BaseException:  # a saver that fails on its own says why (stderr)
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        print(pid, flush=True)


# ----------------------------------------------------------------------------- server process


def _serve() -> None:
    """Child process: run moto on 127.0.0.1, bootstrap a user and a bucket, obey stdin."""
    logging.disable(logging.WARNING)
    import boto3
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import BaseWSGIServer, make_server

    connections: set[socket.socket] = set()
    lock = threading.Lock()

    class TrackedHandler(MotoRequestHandler):
        """Remembers its connection so that a stop can cut it."""

        def setup(self) -> None:
            super().setup()
            with lock:
                connections.add(self.connection)

        def finish(self) -> None:
            with lock:
                connections.discard(self.connection)
            super().finish()

    app = DomainDispatcherApplication(create_backend_app)
    state: dict[str, Any] = {"port": 0}

    def listen() -> tuple[BaseWSGIServer, threading.Thread]:
        server = make_server(
            "127.0.0.1", state["port"], app, threaded=True, request_handler=TrackedHandler
        )
        state["port"] = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return server, thread

    server, thread = listen()
    endpoint = f"http://127.0.0.1:{state['port']}"
    bootstrap = {"endpoint_url": endpoint, "region_name": REGION}
    anonymous = {"aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
    iam = boto3.client("iam", **bootstrap, **anonymous)
    iam.create_user(UserName="fastckpt")
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
    }
    iam.put_user_policy(UserName="fastckpt", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="fastckpt")["AccessKey"]
    boto3.client("s3", **bootstrap, **anonymous).create_bucket(Bucket=BUCKET)
    # From here on every request must be signed with the user's key.
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=b"0",
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    urllib.request.urlopen(request, timeout=30).read()
    print(
        json.dumps(
            {
                "endpoint": endpoint,
                "access_key_id": key["AccessKeyId"],
                "secret_access_key": key["SecretAccessKey"],
                "bucket": BUCKET,
            }
        ),
        flush=True,
    )
    running = True
    for line in sys.stdin:
        word = line.strip()
        if word == "stop" and running:
            server.shutdown()
            server.server_close()
            thread.join()
            with lock:
                for connection in list(connections):
                    with contextlib.suppress(OSError):
                        connection.shutdown(socket.SHUT_RDWR)
            running = False
        elif word == "start" and not running:
            server, thread = listen()
            running = True
        print("ok", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve()
elif __name__ == "__main__" and sys.argv[1:] == ["zygote"]:
    _zygote()
