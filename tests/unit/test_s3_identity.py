"""Which identity an S3 client signs with: a tenant's explicit credentials are used alone or not at all, and an
anonymous Secret sends unsigned requests, whatever identity the process itself has (docs/security.md)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenmill_runner.store.storage import StorageError, open_storage

AMBIENT = {"AWS_ACCESS_KEY_ID": "AKIAOPERATORROLE0001", "AWS_SECRET_ACCESS_KEY": "operator-secret",
           "AWS_SESSION_TOKEN": "OPERATOR-SESSION-TOKEN-abc"}


class Capture(ThreadingHTTPServer):
    """An endpoint a tenant controls: it records each request's headers; its buckets exist, empty."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                capture.headers.append(dict(self.headers))
                bucket_only = self.path.split("?")[0].strip("/").count("/") == 0
                self.send_response(200 if bucket_only else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_PUT = _record

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[Capture]:
    for key, value in AMBIENT.items():  # the process's own identity, as IRSA or an instance profile gives it
        monkeypatch.setenv(key, value)
    server = Capture()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()


@pytest.mark.parametrize("credentials", [{}, {"AWS_ACCESS_KEY_ID": "AKIATENANT"}, {"AWS_SECRET_ACCESS_KEY": "x"}],
                         ids=["no-keys", "no-secret-key", "no-key-id"])
def test_incomplete_credentials_never_fall_back_to_the_process_identity(capture, credentials):
    # On a87e82b `{}` gave boto3 None keys and it signed with the environment's (storage.py:530).
    with pytest.raises(StorageError, match="lack .*refusing to fall back"):
        open_storage("s3://finance-prod-bucket/x/", capture.url, credentials=credentials).exists("config.json")
    assert capture.headers == []


def test_an_anonymous_secret_sends_unsigned_requests(capture):
    storage = open_storage("s3://public-bucket/x/", capture.url, credentials={"TOKENMILL_S3_ANONYMOUS": "true"})
    assert storage.exists("config.json") is False  # answered, unsigned
    assert capture.headers, "the request reached the endpoint"
    for headers in capture.headers:
        lowered = {k.lower(): v for k, v in headers.items()}
        assert "authorization" not in lowered and "x-amz-security-token" not in lowered, headers


def test_complete_credentials_sign_with_those_keys_only(capture):
    tenant = {"AWS_ACCESS_KEY_ID": "AKIATENANTKEY0000001", "AWS_SECRET_ACCESS_KEY": "tenant-secret"}
    open_storage("s3://team-a/x/", capture.url, credentials=tenant).exists("config.json")
    signed = [h.get("Authorization", "") for h in capture.headers]
    assert signed and all("Credential=AKIATENANTKEY0000001/" in a for a in signed), signed
    assert not any("OPERATOR-SESSION-TOKEN" in str(h) for h in capture.headers), "no session token of the process"
