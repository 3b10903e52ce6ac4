"""`exists` tells a missing object from a store it cannot read, against a real S3 server (moto's) and a folder.

An object HEAD answer has no body, so botocore makes the HTTP status its error code (botocore 1.44
parsers.py:1426-1451, RestXMLParser._do_error_parse falls back to _parse_error_from_http_status): a missing key
and a missing bucket both arrive as code "404", which is why `exists` asks the bucket before answering False.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenmill_runner.store.storage import LocalStorage, S3Storage, StorageError


def test_exists_answers_true_for_an_object_and_false_for_a_missing_one(storage) -> None:
    storage.put("run.json", b"{}")
    assert storage.exists("run.json") is True
    assert storage.exists("other.json") is False
    assert storage.exists("run") is False  # a prefix of a key is not an object


def test_a_folder_lists_as_s3_does_in_key_order_after_a_horizon(storage) -> None:
    """A folder lists its keys in S3's order (by the key's characters: `d-x` before `d/a`), and a listing after a
    horizon yields exactly the keys S3's StartAfter would, nested folders and partial names included (issue 44: a
    local steady pass lists after the horizon without walking and sorting every name)."""
    keys = ["d/commits/2026-01-01-a.json", "d/commits/2026-01-02-b.json", "d/commits/2026-01-03-c.json",
            "d/commits/sub/x.json", "d/commits-old.json", "d-x/y.json", "d/shards/w001-a.parquet",
            "d/shards/w002-b.parquet"]
    for key in keys:
        storage.put(key, b"1")
    assert list(storage.list("")) == sorted(keys)
    assert list(storage.list("d/commits/", "d/commits/2026-01-01-a.json")) == [
        "d/commits/2026-01-02-b.json", "d/commits/2026-01-03-c.json", "d/commits/sub/x.json"]
    assert list(storage.list("d/commits")) == ["d/commits-old.json", *sorted(k for k in keys if "commits/" in k)]
    assert list(storage.list("d/commits", "d/commits-old.json")) == sorted(k for k in keys if "commits/" in k)
    assert list(storage.list("d/shards/w001-")) == ["d/shards/w001-a.parquet"]
    assert list(storage.list_sizes("d/", "d/commits/sub/")) == [("d/commits/sub/x.json", 1),
                                                                ("d/shards/w001-a.parquet", 1),
                                                                ("d/shards/w002-b.parquet", 1)]


def test_a_bucket_that_does_not_exist_raises_instead_of_answering_false(s3_endpoint: str) -> None:
    storage = S3Storage("s3://no-such-bucket-here/run/", endpoint=s3_endpoint)
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-here' of s3://no-such-bucket-here/run/ does not"):
        storage.exists("run.json")


class _DenyEverything(BaseHTTPRequestHandler):
    """An S3 endpoint whose credentials are refused: 403 to every request (botocore does not retry a 403)."""

    def _deny(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = do_PUT = _deny

    def log_message(self, *args: object) -> None:  # keep the test output clean
        pass


@pytest.fixture
def denying_endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DenyEverything)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_denied_access_raises_naming_the_object(denying_endpoint: str) -> None:
    storage = S3Storage("s3://bucket-one/run/", endpoint=denying_endpoint)
    with pytest.raises(StorageError, match=r"cannot tell whether s3://bucket-one/run/run.json exists: .*403"):
        storage.exists("run.json")


def test_the_operator_progress_read_raises_on_an_unreadable_store(s3_endpoint: str) -> None:
    # Before, an unreadable store read as "no run.json yet": no progress, and a completed Job then ended the run as
    # "0 of 0 samples missing". Now the reconcile pass raises and kopf retries it.
    from tokenmill_operator.observe.gather import OutputIndex, observe_progress

    storage = S3Storage("s3://no-such-bucket-here/run/", endpoint=s3_endpoint)
    with pytest.raises(StorageError, match="does not exist"):
        observe_progress(storage, OutputIndex(), datetime.now(UTC), None)


def test_local_files_get_the_mode_of_any_new_file_so_a_teammate_can_read_them(tmp_path) -> None:
    """Temporary files are created 0600 and a rename keeps that: every way a local file is written ends with the
    mode open() would give it (0666 less the umask), so a report on a shared file system is readable by the group."""
    import os
    import stat

    from tokenmill_runner.store.storage import FILE_MODE

    mask = os.umask(0o022)
    os.umask(mask)
    assert FILE_MODE == 0o666 & ~mask
    storage = LocalStorage(tmp_path / "out")
    storage.put("report/report.json", b"{}")
    storage.put_new("commits/a.json", b"{}")
    spooled = tmp_path / "spooled"
    spooled.write_bytes(b"x")
    spooled.chmod(0o600)
    storage.put_file("shards/a.parquet", spooled)
    for key in ("report/report.json", "commits/a.json", "shards/a.parquet"):
        assert stat.S_IMODE((tmp_path / "out" / key).stat().st_mode) == FILE_MODE, key
