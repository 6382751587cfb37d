"""The S3 backend (boto3): AWS S3, SeaweedFS, MinIO, Ceph RGW, moto.

Every object lives at `<prefix>/<key>` in one bucket. A PUT of a chunk-sized
object is atomic in S3 (readers see the old object or the whole new one), so
no multipart or temp-key dance is needed. botocore's own retries are turned
off: retrying is `RetryingBackend`'s job, so there is exactly one retry policy
and a dead endpoint fails in bounded time.

Errors are mapped onto Strata's: connection failures, timeouts, 5xx and
throttling -> BackendUnavailable (retried); 403 and bad keys -> AccessDenied;
a missing bucket -> BackendError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import boto3
import botocore.exceptions
from botocore.config import Config

from .backend import ObjectInfo, ObjectVersion, check_key, parallel_has
from .errors import AccessDenied, BackendError, BackendUnavailable, InvalidInput, NotFound

_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "403"}
_TRANSIENT = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "503", "500", "502", "504"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


@dataclass(frozen=True)
class S3Config:
    """Where and how to reach the bucket. Empty strings mean boto3's defaults; empty
    `access_key`/`secret_key` leave the credentials to boto3's default chain."""

    bucket: str
    prefix: str = ""
    endpoint: str = ""
    region: str = ""
    access_key: str = ""
    secret_key: str = ""
    path_style: bool = True
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_connections: int = 32

    @classmethod
    def from_url(cls, url: str, *, endpoint: str = "", region: str = "", path_style: bool = True) -> "S3Config":
        """Build from `s3://BUCKET/PREFIX` and the caller's settings (the environment is not read:
        credentials are left to boto3's default chain)."""
        if not url.startswith("s3://"):
            raise InvalidInput(f"not an s3:// URL: {url!r}")
        bucket, _, prefix = url[5:].partition("/")
        if not bucket:
            raise InvalidInput(f"s3 URL {url!r} names no bucket")
        return cls(bucket=bucket, prefix=prefix.strip("/"), endpoint=endpoint, region=region, path_style=path_style)


class S3Backend:
    """A `Backend` over one S3 bucket and key prefix."""

    def __init__(self, config: S3Config, *, client: object | None = None) -> None:
        if config.prefix:
            check_key(config.prefix)
        self.config = config
        self._prefix = f"{config.prefix}/" if config.prefix else ""
        self._workers = config.max_connections
        if client is None:
            boto_config = Config(
                connect_timeout=config.connect_timeout,
                read_timeout=config.read_timeout,
                retries={"max_attempts": 1, "mode": "standard"},
                max_pool_connections=config.max_connections,
                s3={"addressing_style": "path" if config.path_style else "virtual"},
            )
            session = boto3.session.Session()  # its default chain: AWS_* variables, ~/.aws, instance roles
            client = session.client(
                "s3",
                endpoint_url=config.endpoint or None,
                region_name=config.region or session.region_name or "us-east-1",
                aws_access_key_id=config.access_key or None,
                aws_secret_access_key=config.secret_key or None,
                config=boto_config,
            )
        self._client = client

    def describe(self) -> str:
        where = f" at {self.config.endpoint}" if self.config.endpoint else ""
        return f"s3://{self.config.bucket}/{self.config.prefix}{where}"

    def _error(self, exc: Exception, what: str) -> Exception:
        where = self.describe()
        if isinstance(exc, botocore.exceptions.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            message = exc.response.get("Error", {}).get("Message", "") or code
            if code in _MISSING or (status == "404" and code != "NoSuchBucket"):
                return NotFound(f"object {what} not found in {where}")
            if code == "NoSuchBucket":
                return BackendError(f"bucket {self.config.bucket!r} does not exist ({where}); create it first")
            if code in _DENIED or status == "403":
                return AccessDenied(f"access denied by {where} ({code}: {message}); check the credentials")
            if code in _TRANSIENT or status.startswith("5"):
                return BackendUnavailable(f"{where} failed transiently on {what} ({code}: {message})")
            return BackendError(f"{where} refused {what} ({code}: {message})")
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return AccessDenied(f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        if isinstance(exc, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionError)):
            return BackendUnavailable(f"cannot reach {where} ({exc})")
        if isinstance(exc, (botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError)):
            return BackendUnavailable(f"timed out talking to {where} ({exc})")
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return BackendError(f"S3 client error for {where}: {exc}")
        return exc

    def _key(self, key: str) -> str:
        return self._prefix + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.config.bucket, Key=self._key(key), Body=data)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(exc, key) from None

    def head(self, key: str) -> ObjectVersion | None:
        try:
            response = self._client.head_object(Bucket=self.config.bucket, Key=self._key(key))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            err = self._error(exc, key)
            if isinstance(err, NotFound):
                return None
            raise err from None
        return ObjectVersion(int(response["ContentLength"]), response["LastModified"].timestamp(),
                             str(response["ETag"]))

    def put_new(self, key: str, data: bytes) -> str | None:
        return self._conditional_put(key, data, IfNoneMatch="*")

    def put_if(self, key: str, data: bytes, version: str) -> str | None:
        return self._conditional_put(key, data, IfMatch=version)

    def _conditional_put(self, key: str, data: bytes, **condition: str) -> str | None:
        """PutObject with If-None-Match/If-Match: the new ETag, or None when
        the condition failed (412, or 409 when another conditional write of
        the key raced this one)."""
        try:
            response = self._client.put_object(Bucket=self.config.bucket, Key=self._key(key), Body=data,
                                               **condition)
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in ("412", "409"):
                return None
            if code in ("NoSuchKey", "NotFound") and "IfMatch" in condition:
                return None
            raise self._error(exc, key) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise self._error(exc, key) from None
        return str(response["ETag"])

    def get(self, key: str) -> bytes:
        try:
            response = self._client.get_object(Bucket=self.config.bucket, Key=self._key(key))
            body = response["Body"]
            try:
                data = body.read()
            finally:
                body.close()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(exc, key) from None
        return data

    def stat(self, key: str) -> int | None:
        info = self.head(key)
        return None if info is None else info.size

    def has_many(self, keys: Iterable[str]) -> set[str]:
        return parallel_has(self.stat, keys, workers=self._workers)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix:
            check_key(prefix.rstrip("/") or "x")
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.config.bucket, Prefix=self._prefix + prefix):
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][len(self._prefix) :], int(item["Size"]),
                                     item["LastModified"].timestamp())
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(exc, f"listing {prefix or '/'}") from None

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.config.bucket, Key=self._key(key))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            err = self._error(exc, key)
            if not isinstance(err, NotFound):
                raise err from None

    def delete_many(self, keys: Iterable[str]) -> None:
        """DeleteObjects, 1,000 keys a request (S3's limit)."""
        keys = [check_key(k) for k in keys]
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            try:
                response = self._client.delete_objects(
                    Bucket=self.config.bucket,
                    Delete={"Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True})
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                raise self._error(exc, f"deleting {len(batch)} objects") from None
            errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise BackendError(f"deleting {first.get('Key')}: {first.get('Code')}: {first.get('Message')} "
                                   f"({len(errors)} of {len(batch)} failed)")

    def check_bucket(self) -> None:
        """Fail early, with a clear message, if the bucket is unusable."""
        try:
            self._client.head_bucket(Bucket=self.config.bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            err = self._error(exc, "bucket check")
            if isinstance(err, NotFound):
                raise BackendError(f"bucket {self.config.bucket!r} does not exist ({self.describe()}); create it first") from None
            raise err from None

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None:
            close()
