"""A capped read (`Storage.get_capped`, every read of a small object someone else wrote: markers, seals, configs)
answers as the store does, on local disk and on a real S3 server (moto's). On S3 it is one GET sent through the
client's signer and connection pool without botocore's per-call pipeline (storage.py `_get_whole`), so what that
pipeline did for it is checked here: the signature S3 verifies, S3's errors and their retries, a body broken
midway, the stored checksum."""

from __future__ import annotations

import base64
import json
import os
import time
import zlib
from collections.abc import Iterator

import pytest

from tests import s3_server
from tests.conftest import free_port
from tests.faults.s3_proxy import Rule, S3FaultProxy
from tokenmill_runner.store import storage as storage_module
from tokenmill_runner.store.bounded_get import ObjectTooLarge, get_bounded
from tokenmill_runner.store.storage import (
    LocalStorage,
    S3Storage,
    StorageError,
    StorageRetry,
    check_checksum,
    s3_client,
)

BODY = bytes(range(256)) * 20  # 5,120 bytes, every byte value


def test_a_capped_read_returns_the_object_or_refuses_it_past_its_cap(storage, monkeypatch) -> None:
    storage.put("d/commits/a marker+1.json", BODY)
    assert storage.get_capped("d/commits/a marker+1.json", len(BODY)) == BODY
    assert storage.get_capped("d/commits/a marker+1.json", len(BODY) - 1) is None
    with pytest.raises(ObjectTooLarge, match=r"d/commits/a marker\+1.json is over the 100 bytes"):
        get_bounded(storage, "d/commits/a marker+1.json", 100)
    with pytest.raises(StorageError, match="does not exist"):
        storage.get_capped("d/commits/missing.json", 100)
    # A cap above what one GET reads whole (a checkpoint's) reads through the resumable body, with the same answers.
    monkeypatch.setattr(storage_module, "WHOLE_GET_BYTES", 16)
    assert storage.get_capped("d/commits/a marker+1.json", len(BODY)) == BODY
    assert storage.get_capped("d/commits/a marker+1.json", len(BODY) - 1) is None


def test_a_capped_read_survives_s3_errors_and_a_body_broken_midway(s3_endpoint, s3_bucket) -> None:
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="run/m.json", Body=BODY)
    with S3FaultProxy(s3_endpoint) as proxy:
        storage = S3Storage(f"s3://{s3_bucket}/run/", endpoint=proxy.url, retry=StorageRetry(budget_s=30.0))
        proxy.add(Rule("status", method="GET", path=r"/run/m\.json", times=2, status=503))
        proxy.add(Rule("reset_response", method="GET", path=r"/run/m\.json", times=1, after_bytes=len(BODY) // 2))
        assert storage.get_capped("m.json", 1 << 20) == BODY
        assert len(proxy.fired("status")) == 2 and len(proxy.fired("reset_response")) == 1
        assert len(proxy.requests("GET", r"/run/m\.json")) == 4  # two 503s, the broken body, the whole one

        proxy.add(Rule("status", method="GET", path=r"/run/m\.json", times=1, status=403))
        started = time.monotonic()
        with pytest.raises(StorageError, match=rf"cannot read s3://{s3_bucket}/run/m.json: .*AccessDenied"):
            storage.get_capped("m.json", 1 << 20)
        assert time.monotonic() - started < 5  # denied access is an answer, not retried for the budget

        # The pool serves the reads after a broken and a refused one.
        assert [storage.get_capped("m.json", 1 << 20) for _ in range(3)] == [BODY] * 3


def test_the_stored_checksum_is_checked_when_s3_returns_one() -> None:
    crc = base64.b64encode(zlib.crc32(BODY).to_bytes(4, "big")).decode()
    check_checksum({"x-amz-checksum-crc32": crc}, BODY, "s3://b/k")
    check_checksum({"x-amz-checksum-crc32": "AAAAAA==-3"}, BODY, "s3://b/k")  # a multipart's: over its parts
    check_checksum({}, BODY, "s3://b/k")
    with pytest.raises(StorageError, match=r"s3://b/k: the body read does not match its crc32 checksum"):
        check_checksum({"x-amz-checksum-crc32": crc}, BODY[:-1] + b"x", "s3://b/k")
    with pytest.raises(StorageError, match="sha256"):
        check_checksum({"x-amz-checksum-sha256": base64.b64encode(b"0" * 32).decode()}, BODY, "s3://b/k")


def test_an_object_written_through_botocore_is_read_back_with_its_checksum_checked(s3_endpoint, s3_bucket) -> None:
    # botocore writes a CRC32 with every PutObject (its default since 1.36) and the GET asks for it back: the check
    # above runs on every capped read of an object tokenmill wrote.
    storage = S3Storage(f"s3://{s3_bucket}/run/", endpoint=s3_endpoint)
    storage.put("c.json", BODY)
    head = s3_client(s3_endpoint).head_object(Bucket=s3_bucket, Key="run/c.json", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32") == base64.b64encode(zlib.crc32(BODY).to_bytes(4, "big")).decode()
    assert storage.get_capped("c.json", len(BODY)) == BODY


@pytest.fixture
def checking_s3() -> Iterator[tuple[str, dict[str, str]]]:
    """A moto server of its own that verifies signatures and policies (after the first three calls, which make a user,
    its key and its policy): the suite's shared server accepts any signature."""
    port = free_port()
    server = s3_server.spawn(port, env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3"))
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        for _ in range(300):
            try:
                iam.create_user(UserName="tenant")
                break
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.05)
        key = iam.create_access_key(UserName="tenant")["AccessKey"]
        iam.put_user_policy(UserName="tenant", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        yield endpoint, {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    finally:
        server.terminate()
        server.wait()


def test_a_capped_read_is_signed_as_s3_verifies_it(checking_s3) -> None:
    endpoint, credentials = checking_s3
    s3_client(endpoint, credentials=credentials).create_bucket(Bucket="signed")
    storage = S3Storage("s3://signed/run/", endpoint=endpoint, credentials=credentials)
    storage.put("d/commits/2026 12+06~a.json", BODY)  # a key that percent-encoding and the signature both see
    assert storage.get_capped("d/commits/2026 12+06~a.json", len(BODY)) == BODY
    forged = S3Storage("s3://signed/run/", endpoint=endpoint, credentials=dict(credentials,
                                                                                AWS_SECRET_ACCESS_KEY="not-it"))
    with pytest.raises(StorageError, match=r"cannot read s3://signed/run/d/commits/.*SignatureDoesNotMatch"):
        forged.get_capped("d/commits/2026 12+06~a.json", len(BODY))
