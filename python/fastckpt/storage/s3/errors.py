"""The typed errors of object storage, and the one place client errors are translated.

Every failure of an ``s3://`` operation surfaces as an :class:`ObjectStoreError` naming the URL
it happened on and what to do about it. The classes also derive from the builtin exception a
caller would expect from a filesystem (``FileNotFoundError``, ``PermissionError``,
``ConnectionError``, ``FileExistsError``), so code written for local paths keeps working.
"""

from __future__ import annotations

import re

from fastckpt.errors import FastCkptError

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "CommitConflictError",
    "CommitOutcomeUnknownError",
    "EndpointUnreachableError",
    "ForkedAfterUseError",
    "LeaseLostError",
    "ObjectNotFoundError",
    "ObjectStoreError",
    "StorageOptionsError",
    "UnsupportedOnObjectStoreError",
    "translate",
]


class ObjectStoreError(FastCkptError, OSError):
    """An object-store operation failed; the message names the URL and the fix."""


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """No object at the URL (a committed record names an object that is gone, or a typo)."""


class BucketNotFoundError(ObjectNotFoundError):
    """The bucket of the URL does not exist on the endpoint."""


class AccessDeniedError(ObjectStoreError, PermissionError):
    """The store refused the credentials (wrong key or secret) or the key lacks a permission."""


class EndpointUnreachableError(ObjectStoreError, ConnectionError):
    """The endpoint did not answer (down, wrong address or port, network) within the timeouts."""


class CommitConflictError(ObjectStoreError, FileExistsError):
    """A conditional put lost: another writer committed the same record first."""


class CommitOutcomeUnknownError(ObjectStoreError, ConnectionError):
    """A commit record's put got no usable answer (a dropped connection, a timeout, a server
    error) and the record could not be read back either: the store may have applied it. The
    save is reported failed, but nothing it wrote is deleted (the record may name it); once the
    store answers, ``fastckpt verify`` tells which checkpoint is committed, and the next save
    clears what no record names."""


class LeaseLostError(CommitConflictError):
    """This writer's lease on a root (``ROOT/.fastckpt.lock``) was taken over by another
    writer: it went longer than ``lease_ttl_s`` without renewing it (paused, cut off), so
    another writer may have saved since. A writer that lost its lease commits nothing and
    deletes nothing; load the latest checkpoint and save again."""


class ForkedAfterUseError(ObjectStoreError, RuntimeError):
    """This process was forked from one that had made object-store requests: the client's
    runtime (its threads) did not survive the fork, and a request here would never finish."""


class UnsupportedOnObjectStoreError(FastCkptError, NotImplementedError):
    """A feature that needs a filesystem was given an ``s3://`` URL (the message names the
    URL and what to use instead)."""


class StorageOptionsError(FastCkptError, ValueError):
    """``storage_options=`` were given for a path they cannot apply to (a local path)."""


_DENIED_CODES = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "InvalidToken",
    "AuthorizationHeaderMalformed",
)
_UNREACHABLE_HINTS = (
    "error sending request",
    "connection refused",
    "connection reset",
    "timed out",
    "timeout",
    "dns error",
    "could not connect",
    "connect timeout",
    "endpoint url",
    "connection closed",
    "broken pipe",
    "incomplete message",
)


def _code(text: str) -> str | None:
    """The S3 error code (``<Code>...</Code>`` or ``(Code)``) inside a client message."""
    match = re.search(r"<Code>([A-Za-z]+)</Code>", text) or re.search(
        r"\(([A-Za-z]+)\) when calling", text
    )
    return match.group(1) if match else None


def translate(err: BaseException, url: str, endpoint: str | None) -> ObjectStoreError:
    """The typed error for a client exception raised while working on ``url``.

    Args:
        err: what obstore or botocore raised.
        url: the ``s3://`` URL of the object or prefix involved.
        endpoint: the endpoint in use (None: the provider's default), for the message.

    Returns:
        The :class:`ObjectStoreError` subclass to raise (``raise translate(...) from err``).
    """
    if isinstance(err, ObjectStoreError):
        return err
    text = str(err)
    kind = type(err).__name__
    # botocore's connection errors carry ``response = None``.
    response = getattr(err, "response", None) or {}
    code = _code(text) or (response.get("Error") or {}).get("Code")
    where = endpoint or "the default AWS endpoint"
    if code == "NoSuchBucket":
        bucket = url.split("/")[2] if url.count("/") >= 2 else url
        return BucketNotFoundError(
            f"{url}: bucket {bucket!r} does not exist on {where}; create it, or fix the URL "
            "or the endpoint (endpoint_url / AWS_ENDPOINT_URL)"
        )
    if code in ("NoSuchKey", "NotFound", "404") or kind in ("NotFoundError", "FileNotFoundError"):
        return ObjectNotFoundError(f"{url}: no such object on {where}")
    if code == "NoSuchUpload":
        return ObjectNotFoundError(f"{url}: the multipart upload is gone (finished or aborted)")
    if code in _DENIED_CODES or kind in ("PermissionDeniedError", "UnauthenticatedError"):
        return AccessDeniedError(
            f"{url}: {where} refused the request ({code or kind}): check the access key and "
            "secret (storage_options access_key_id/secret_access_key, AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, or the AWS profile) and that the key may use this bucket"
        )
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or kind in (
        "AlreadyExistsError",
        "PreconditionError",
    ):
        return CommitConflictError(
            f"{url}: another writer committed this record first (conditional put refused); "
            "reload the latest checkpoint and save again"
        )
    status = re.search(r"non-2xx status code: (\d{3})", text)
    if status is not None:  # the server answered: reachable, whatever the retry settings say
        first_line = text.strip().splitlines()[0]
        return ObjectStoreError(
            f"{url}: {where} answered HTTP {status.group(1)} ({code or kind}): {first_line[:400]}"
        )
    lowered = text.lower()
    if kind in (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "HTTPClientError",
    ) or any(hint in lowered for hint in _UNREACHABLE_HINTS):
        return EndpointUnreachableError(
            f"{url}: cannot reach {where} ({kind}): it refused, dropped or did not answer "
            "the request within the timeouts; check that the endpoint is up and the address "
            "is right (endpoint_url / AWS_ENDPOINT_URL), or raise connect_timeout_s / "
            "read_timeout_s / retry_timeout_s for a slow network"
        )
    first_line = text.strip().splitlines()[0] if text.strip() else kind
    return ObjectStoreError(f"{url}: {kind}: {first_line[:400]}")
