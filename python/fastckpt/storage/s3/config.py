"""Where an ``s3://`` checkpoint lives and how to reach it: URL parsing and client settings.

Settings resolve in this order, first found wins:

1. the call's ``storage_options`` (a mapping with :class:`S3Options` field names, or an
   :class:`S3Options`);
2. the standard AWS environment variables (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
   ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
   ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``);
3. the AWS config files (``~/.aws/credentials``, ``~/.aws/config``, or
   ``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_CONFIG_FILE``), through botocore's own resolver, so
   profiles, SSO and role assumption work as with the AWS CLI.

Timeouts are short by default so that a dead endpoint is an error within seconds, never a hang.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastckpt.storage.s3.errors import AccessDeniedError

__all__ = ["S3Options", "S3Url", "is_s3_url"]

_SCHEME = "s3://"
_MAX_SINGLE_PUT = 5 << 30  # S3's limit on one PUT
_MAX_SECONDS = 86_400  # the longest timeout or lease accepted: one day


def is_s3_url(path: object) -> bool:
    """Whether ``path`` names an object-store location (``s3://...``).

    A ``pathlib.Path`` made from an URL collapses ``//`` to ``/``; ``s3:/bucket/...`` is
    therefore accepted too.
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    return isinstance(text, str) and (text.startswith(_SCHEME) or text.startswith("s3:/"))


@dataclass(frozen=True)
class S3Url:
    """A parsed ``s3://bucket/prefix`` URL.

    Attributes:
        bucket: the bucket name.
        prefix: the key prefix inside it, without leading or trailing ``/`` ("" for the
            bucket's top level).
    """

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str | os.PathLike[str]) -> S3Url:
        """Parse ``s3://bucket[/prefix]``.

        Raises:
            ValueError: not an ``s3://`` URL, no bucket, or a prefix with empty, ``.`` or
                ``..`` segments (the message shows a valid form).
        """
        text = os.fspath(url)
        if text.startswith(_SCHEME):
            rest = text[len(_SCHEME) :]
        elif text.startswith("s3:/"):
            rest = text[len("s3:/") :]
        else:
            raise ValueError(f"{text!r} is not an object-store URL; use s3://bucket/prefix")
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket or not all(c.isalnum() or c in "-._" for c in bucket):
            raise ValueError(f"{text!r}: missing or invalid bucket name; use s3://bucket/prefix")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ValueError(
                f"{text!r}: the prefix has an empty, '.' or '..' segment; use s3://bucket/a/b"
            )
        return cls(bucket, prefix)

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` joined under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def child(self, *parts: str) -> S3Url:
        """The URL of a sub-prefix."""
        return S3Url(self.bucket, self.key(*parts))

    def url_of(self, key: str) -> str:
        """``s3://bucket/key`` for an object key of this bucket."""
        return f"{_SCHEME}{self.bucket}/{key}"

    def __str__(self) -> str:
        return self.url_of(self.prefix) if self.prefix else f"{_SCHEME}{self.bucket}"


def _check_type(name: str, value: object, kinds: tuple[type, ...], what: str) -> None:
    """Raise TypeError naming ``name`` unless ``value`` is of ``kinds`` (a bool is no number)."""
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TypeError(
            f"storage_options {name}={value!r}: must be {what}, got {type(value).__name__}"
        )


@dataclass(frozen=True)
class S3Options:
    """Per-call settings of the object-store client (any field left None is resolved from the
    environment and the AWS config files; see the module docstring).

    Attributes:
        endpoint_url: e.g. ``http://127.0.0.1:9000`` for a local server; None: AWS.
        region: the bucket's region (None: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the
            profile's ``region``, else ``us-east-1``).
        access_key_id, secret_access_key, session_token: static credentials.
        profile: the AWS profile to read from the config files.
        allow_http: permit a plain-HTTP endpoint (None: only when ``endpoint_url`` says http).
        connect_timeout_s: seconds to open a connection.
        read_timeout_s: seconds a request that moves no data in bulk (a commit record, the
            lease, a HEAD, a listing, a delete, a header or other small range) may wait for
            the server's next byte before it is given up (and retried within
            ``retry_timeout_s``). A server that accepts connections but never answers is an
            ``EndpointUnreachableError`` after about ``retry_timeout_s + read_timeout_s``.
        request_timeout_s: seconds one request (a whole part) may take; data transfers (parts,
            large ranges, server-side copies) are bounded by this alone, since a slow link
            may need many seconds per part.
        max_retries: retries of a failed request (with backoff).
        retry_timeout_s: a request is not retried after this many seconds.
        lease_ttl_s: seconds a writer's lease on a root (``ROOT/.fastckpt.lock``) lasts
            without renewal (it is renewed every third of it). A killed writer blocks the
            next one for at most this long; a writer that could not renew in time (paused,
            cut off) has lost the root: its commit is refused with ``LeaseLostError``.
        part_size: bytes per multipart-upload part (>= 5 MiB, S3's minimum).
        read_part_size: bytes per ranged GET.
        concurrency: parts uploaded / ranges fetched at once.
        multipart_threshold: objects up to this many bytes go up in one PUT, larger ones as
            parallel multipart uploads (None: ``part_size``; at most 5 GiB, S3's limit).
        ranged_get_threshold: objects up to this many bytes come down in one GET, larger
            ones as parallel ranged GETs of ``read_part_size`` (None: ``read_part_size``).
            Which is faster depends on the store (see docs/object-storage.md).
        unsigned_payload: do not hash bodies into the request signature (the crc32c of every
            tensor and file already covers them; TLS protects them on the wire).
    """

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    profile: str | None = None
    allow_http: bool | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 5.0
    request_timeout_s: float = 120.0
    max_retries: int = 3
    retry_timeout_s: float = 15.0
    lease_ttl_s: float = 30.0
    part_size: int = 32 << 20
    read_part_size: int = 32 << 20
    concurrency: int = 8
    unsigned_payload: bool = True
    multipart_threshold: int | None = None
    ranged_get_threshold: int | None = None

    @property
    def single_put_max(self) -> int:
        """The largest object uploaded with one PUT (see ``multipart_threshold``)."""
        return self.part_size if self.multipart_threshold is None else self.multipart_threshold

    @property
    def single_get_max(self) -> int:
        """The largest object downloaded with one GET (see ``ranged_get_threshold``)."""
        if self.ranged_get_threshold is None:
            return self.read_part_size
        return self.ranged_get_threshold

    @classmethod
    def from_mapping(cls, options: S3Options | Mapping[str, Any] | None) -> S3Options:
        """Options from ``storage_options`` (a mapping of field names, or an instance).

        Raises:
            TypeError: an unknown key (the message lists the valid ones) or a bad value type.
            ValueError: a part size under 5 MiB, a non-positive count, a timeout or lease that is
                not a finite positive number of seconds up to a day.
        """
        if options is None:
            return cls()
        if isinstance(options, S3Options):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(
                f"storage_options must be a mapping or S3Options, got {type(options).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(
                f"unknown storage_options key(s) {unknown}; valid keys: {sorted(names)}"
            )
        return cls(**dict(options))

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Validate every field's type and range (see :meth:`from_mapping`); each error names
        the field and the value."""
        for name in ("endpoint_url", "region", "access_key_id", "secret_access_key"):
            _check_type(name, getattr(self, name), (str, type(None)), "a string or None")
        _check_type("session_token", self.session_token, (str, type(None)), "a string or None")
        _check_type("profile", self.profile, (str, type(None)), "a string or None")
        _check_type("allow_http", self.allow_http, (bool, type(None)), "True, False or None")
        _check_type("unsigned_payload", self.unsigned_payload, (bool,), "True or False")
        for name in (
            "connect_timeout_s",
            "read_timeout_s",
            "request_timeout_s",
            "retry_timeout_s",
            "lease_ttl_s",
        ):
            value = getattr(self, name)
            _check_type(name, value, (int, float), "a number of seconds")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a finite, positive number of seconds")
            if value > _MAX_SECONDS:
                # A lease this long would let a killed writer hold the root for days; no
                # request or retry budget needs more than a day either.
                raise ValueError(
                    f"{name}={value!r} is over a day ({_MAX_SECONDS} s), the most fastckpt "
                    "takes: give a number of seconds up to that"
                )
        for name in ("part_size", "read_part_size", "concurrency", "max_retries"):
            _check_type(name, getattr(self, name), (int,), "an int")
        for name in ("multipart_threshold", "ranged_get_threshold"):
            _check_type(name, getattr(self, name), (int, type(None)), "an int or None")
        if self.part_size < (5 << 20):
            raise ValueError(f"part_size={self.part_size}: S3 parts must be at least 5 MiB")
        for name in ("read_part_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        for name in ("multipart_threshold", "ranged_get_threshold"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}={value} must be >= 0 (or None)")
        if self.single_put_max > _MAX_SINGLE_PUT:
            raise ValueError(
                f"multipart_threshold={self.single_put_max}: S3 takes at most 5 GiB in one PUT"
            )
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries} must be >= 0")

    def resolved(self, url: str) -> ResolvedS3:
        """Fill endpoint, region and credentials from the environment and config files.

        Raises:
            AccessDeniedError: no credentials anywhere (names ``url`` and where to put them).
        """
        import botocore.credentials
        import botocore.session

        session = botocore.session.Session(profile=self.profile)
        endpoint = (
            self.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or _profile_value(session, "endpoint_url")
        )
        region = (
            self.region
            or os.environ.get("AWS_REGION")  # the AWS SDKs' name; botocore reads only the next
            or session.get_config_variable("region")  # AWS_DEFAULT_REGION, then the profile
            or "us-east-1"
        )
        refreshable: Any = None
        key, secret, token = self.access_key_id, self.secret_access_key, self.session_token
        if not (key and secret):
            # Each field given in the options wins; the others come from the AWS chain.
            credentials = session.get_credentials()
            if credentials is not None:
                frozen = credentials.get_frozen_credentials()
                if not (key or secret or token) and isinstance(
                    credentials, botocore.credentials.RefreshableCredentials
                ):
                    refreshable = session
                key = key or frozen.access_key
                secret = secret or frozen.secret_key
                token = token or frozen.token
        if not (key and secret):
            raise AccessDeniedError(
                f"{url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, an AWS profile, or storage_options="
                "{'access_key_id': ..., 'secret_access_key': ...}"
            )
        allow_http = self.allow_http
        if allow_http is None:
            allow_http = bool(endpoint and endpoint.startswith("http://"))
        return ResolvedS3(
            options=self,
            endpoint_url=endpoint,
            region=region,
            access_key_id=key,
            secret_access_key=secret,
            session_token=token,
            allow_http=allow_http,
            refresh_session=refreshable,
        )


def _profile_value(session: Any, name: str) -> str | None:
    try:
        value = session.get_scoped_config().get(name)
    except Exception:  # a missing profile is reported by the credential lookup instead
        return None
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ResolvedS3:
    """:class:`S3Options` with endpoint, region and credentials filled in.

    Attributes:
        refresh_session: the botocore session whose credentials expire and must be refreshed
            (temporary credentials from SSO / role assumption), or None for static ones.
    """

    options: S3Options
    endpoint_url: str | None
    region: str
    access_key_id: str
    secret_access_key: str
    session_token: str | None
    allow_http: bool
    refresh_session: Any = None
