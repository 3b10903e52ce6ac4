"""Object storage at the edge: a local folder or an S3 prefix behind one small interface.

Keys are '/'-separated paths relative to the storage root. Every `put` is atomic (a reader sees the whole object
or nothing): local files are written to a temporary name and renamed, S3 objects appear whole on completion.
That atomicity is what the commit protocol in `shards.py` relies on.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

logger = logging.getLogger(__name__)

MULTIPART_THRESHOLD = 64 * 1024 * 1024
TMP_MARK = ".tmp-"
COPY_CHUNK = 8 * 1024 * 1024
# Error codes that mean "no such object". A HEAD answer has no body, so botocore reports the HTTP status ("404")
# as the code; some S3-compatible stores name it.
MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI."""


class Storage(Protocol):
    root_uri: str

    def put(self, key: str, data: bytes) -> None: ...
    def put_file(self, key: str, path: Path) -> None: ...  # atomic like put; the local file may be moved
    def get(self, key: str) -> bytes: ...
    def list(self, prefix: str = "") -> Iterator[str]: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...  # False only for a missing object; raises when it cannot tell
    def open_read(self, key: str) -> IO[bytes]: ...
    def uri(self, key: str) -> str: ...


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ends with "/"

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise StorageError(f"{uri!r} is not an s3:// URI")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise StorageError(f"{uri!r} has no bucket name")
        prefix = prefix.strip("/")
        return cls(bucket, prefix + "/" if prefix else "")


class LocalStorage:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root_uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: Path) -> None:
        """Move (or, across file systems, copy) a finished local file into place, atomically."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, target)
            return
        except OSError:
            pass  # another file system: copy to a temporary name beside the target, then rename
        fd, tmp = tempfile.mkstemp(prefix=target.name + TMP_MARK, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle, open(path, "rb") as source:
                shutil.copyfileobj(source, handle, COPY_CHUNK)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StorageError(f"{self.uri(key)} does not exist") from None

    def open_read(self, key: str) -> IO[bytes]:
        try:
            return self._path(key).open("rb")
        except FileNotFoundError:
            raise StorageError(f"{self.uri(key)} does not exist") from None

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self._path(prefix)
        folder = base if base.is_dir() else base.parent
        # A missing root must list nothing, not its parent folder.
        if not folder.is_dir() or not folder.is_relative_to(self.root):
            return
        for path in sorted(folder.rglob("*")):
            key = path.relative_to(self.root).as_posix()
            if path.is_file() and key.startswith(prefix):
                yield key

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def uri(self, key: str) -> str:
        return str(self._path(key))


class S3Storage:
    def __init__(self, uri: str, endpoint: str | None = None, region: str | None = None,
                 credentials: Mapping[str, str] | None = None) -> None:
        self.location = S3Location.parse(uri)
        self.root_uri = f"s3://{self.location.bucket}/{self.location.prefix}"
        self._client = s3_client(endpoint, region, credentials)

    def _key(self, key: str) -> str:
        return self.location.prefix + key

    def put(self, key: str, data: bytes) -> None:
        import io

        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)
        try:
            self._client.upload_fileobj(io.BytesIO(data), self.location.bucket, self._key(key), Config=config)
        except Exception as error:  # botocore raises many unrelated types
            raise StorageError(f"cannot write {self.uri(key)}: {error}") from error

    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (multipart above MULTIPART_THRESHOLD); the object appears whole on completion."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)
        try:
            self._client.upload_file(str(path), self.location.bucket, self._key(key), Config=config)
        except Exception as error:  # botocore raises many unrelated types
            raise StorageError(f"cannot write {self.uri(key)}: {error}") from error

    def get(self, key: str) -> bytes:
        with self.open_read(key) as body:
            return body.read()

    def open_read(self, key: str) -> IO[bytes]:
        try:
            response = self._client.get_object(Bucket=self.location.bucket, Key=self._key(key))
        except self._client.exceptions.NoSuchKey:
            raise StorageError(f"{self.uri(key)} does not exist") from None
        except Exception as error:
            raise StorageError(f"cannot read {self.uri(key)}: {error}") from error
        return response["Body"]

    def list(self, prefix: str = "") -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self._key(prefix)):
                for item in page.get("Contents", []):
                    yield item["Key"][len(self.location.prefix):]
        except Exception as error:
            raise StorageError(f"cannot list {self.uri(prefix)}: {error}") from error

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.location.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        """Whether the object is there. Only "not found" answers no: any other failure (an unreachable endpoint,
        denied access, a missing bucket) raises StorageError, so a store that cannot be read never looks empty."""
        try:
            self._client.head_object(Bucket=self.location.bucket, Key=self._key(key))
            return True
        except Exception as error:  # botocore raises many unrelated types
            if not _is_missing(error):
                raise StorageError(f"cannot tell whether {self.uri(key)} exists: {error}") from error
        self._check_bucket()
        return False

    def _check_bucket(self) -> None:
        # An object HEAD in a bucket that does not exist is a bare 404 as well: ask the bucket before saying no.
        try:
            self._client.head_bucket(Bucket=self.location.bucket)
        except Exception as error:
            if _is_missing(error):
                raise StorageError(f"bucket {self.location.bucket!r} of {self.root_uri} does not exist") from error
            raise StorageError(f"cannot read bucket {self.location.bucket!r} of {self.root_uri}: {error}") from error

    def uri(self, key: str) -> str:
        return f"s3://{self.location.bucket}/{self._key(key)}"


def _is_missing(error: Exception) -> bool:
    response = getattr(error, "response", None)  # botocore's ClientError carries the parsed answer
    return isinstance(response, dict) and str((response.get("Error") or {}).get("Code")) in MISSING_CODES


def s3_client(endpoint: str | None = None, region: str | None = None,
              credentials: Mapping[str, str] | None = None):  # -> botocore client
    """An S3 client; credentials (AWS_* keys, e.g. from a Kubernetes Secret) default to the environment."""
    import boto3
    from botocore.config import Config

    # Path-style addressing works with every S3-compatible store; virtual-host style needs DNS per bucket.
    config = Config(s3={"addressing_style": "path"}, retries={"max_attempts": 8, "mode": "standard"})
    return boto3.client(
        "s3",
        endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
        region_name=region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=config,
        aws_access_key_id=(credentials or {}).get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=(credentials or {}).get("AWS_SECRET_ACCESS_KEY"),
        aws_session_token=(credentials or {}).get("AWS_SESSION_TOKEN"),
    )


def open_storage(uri: str, endpoint: str | None = None, region: str | None = None,
                 credentials: Mapping[str, str] | None = None) -> Storage:
    if uri.startswith("s3://"):
        return S3Storage(uri, endpoint, region, credentials)
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return LocalStorage(uri)


def split_uri(uri: str) -> tuple[str, str]:
    """Split a file URI into (parent URI, name) so a single object can be read through `open_storage`."""
    stripped = uri.rstrip("/")
    parent, _, name = stripped.rpartition("/")
    return parent or ".", name
