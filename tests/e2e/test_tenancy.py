"""A tenant's resource on the real API server: the bounds the CRD shares with pydantic, the flags extraArgs may not
set, and the operator's own identity kept out of a tenant's storage (docs/security.md)."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client as k8s

from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
    Operator,
    b5_resource,
    condition,
    crd,
    credentials,
    dsgen,
    s3_world,
)

pytestmark = pytest.mark.e2e

OUT_OF_BOUNDS = [
    ("server.replicas", -1, "spec.server.replicas"),  # int-or-"auto": passed kubectl apply before
    ("server.replicas", 100_000, "spec.server.replicas"),
    ("server.nodes", 100_000, "spec.server.nodes"),
    ("runner.concurrency", 10_000_000, "spec.runner.concurrency"),
    ("runner.shardMaxSamples", 10**9, "spec.runner.shardMaxSamples"),
    ("runner.shardMaxSeconds", 10**9, "spec.runner.shardMaxSeconds"),
    ("sampling.maxNewTokens", 2**40, "spec.sampling.maxNewTokens"),
    # SGLang's argparse takes abbreviations (0.5.23 server_args.py:679): every prefix of a managed flag is refused.
    ("server.extraArgs", ["--api-ke=known-key"], "nor abbreviate one"),
    ("server.extraArgs", ["--hos=127.0.0.1"], "nor abbreviate one"),
    ("server.extraArgs", ["--trust-remote-code"], "nor abbreviate one"),
    ("server.extraArgs", ["--config", "/tmp/args.yaml"], "nor abbreviate one"),
    # Stored literally by S3, but a store or proxy that normalises keys would write outside the prefix.
    ("output.uri", "s3://tokenmill-data/runs/a/../../escaped/", "must not hold '.' or '..' segments"),
    ("output.uri", "s3://tokenmill-data/runs/b%2F..%2Fc/", "must not hold '.' or '..' segments"),
    # accepted on a87e82b (security-a87e82b.md W14)
    ("output.uri", "s3://tokenmill-data/runs/%2e%2e/x/", "must not hold '.' or '..' segments"),
    ("output.uri", "s3://tokenmill-data/runs//x/", "must not hold '.' or '..' segments"),
    # accepted on f9665d2 (security-f9665d2.md W12): '..' decoded twice, a NUL, '..' under NFKC
    ("output.uri", "s3://tokenmill-data/runs/%252e%252e/x/", "must not hold '.' or '..' segments"),
    ("output.uri", "s3://tokenmill-data/runs/x%00/", "must not hold '.' or '..' segments"),
    ("output.uri", "s3://tokenmill-data/runs/\u2024\u2024/x/", "must not hold '.' or '..' segments"),
    # A local model path would name the operator's own folders (W10); only S3, a PVC or a hub id in a cluster.
    ("model.path", "/etc", "spec.model.path must be s3://bucket/prefix/"),
    ("model.path", "../../proc/self", "spec.model.path must be s3://bucket/prefix/"),
    ("model.tokenizer", "/var/lib/kubelet", "spec.model.tokenizer must be s3://bucket/prefix/"),
]


@pytest.mark.parametrize(("path", "value", "message"), OUT_OF_BOUNDS, ids=[f"{p}={v}" for p, v, _ in OUT_OF_BOUNDS])
def test_the_api_server_refuses_what_pydantic_refuses(cluster, namespace, crd, path, value, message):
    result = cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", **{path: value}), check=False)
    assert result.returncode != 0, f"{path}={value!r} was accepted"
    assert message in result.stderr, result.stderr


def test_bounds_and_flags_within_reach_are_accepted(cluster, namespace, crd):
    within = {"server.replicas": 256, "runner.concurrency": 4096, "server.extraArgs": ["--chunked-prefill-size",
                                                                                       "4096", "--enable-metrics"],
              "model.tokenizer": "moonshotai/Kimi-K2.5"}
    result = cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", suspend=True, **within), check=False)
    assert result.returncode == 0, result.stderr


class Capture(ThreadingHTTPServer):
    """An S3 endpoint a tenant controls: it records every request (and the credentials it carries)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                capture.requests.append((self.command, self.path, dict(self.headers)))
                self.send_response(403)
                self.end_headers()

            do_GET = do_HEAD = do_PUT = do_POST = _record

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def capture() -> Iterator[Capture]:
    server = Capture()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()


OPERATOR_IDENTITY = {"AWS_ACCESS_KEY_ID": "AKIAOPERATORROLE0001", "AWS_SECRET_ACCESS_KEY": "operator-secret",
                     "AWS_SESSION_TOKEN": "OPERATOR-SESSION-TOKEN-abc"}


def operator_with(cluster, namespace: str, log: Path, identity: dict[str, str] = OPERATOR_IDENTITY,
                  **env: str) -> Operator:
    """The operator with an identity of its own in its environment, as IRSA or an instance profile would give it."""
    running = Operator(cluster, namespace, log)
    for name in OPERATOR_IDENTITY:
        running.env.pop(name, None)
    running.env.update({**identity, **env})
    running.start()
    return running


def test_without_a_secret_the_operator_never_lends_its_identity(cluster, namespace, crd, capture, tmp_path):
    operator = operator_with(cluster, namespace, tmp_path / "operator.log")
    try:
        resource = b5_resource(namespace, capture.url)
        del resource["spec"]["output"]["credentialsSecret"]
        resource["spec"]["output"]["uri"] = "s3://finance-prod-bucket/anything/"
        cluster.apply(resource)

        def refused():
            obj = dsgen(cluster, namespace)
            ready = condition(obj, "Ready")
            return obj if ready and ready["reason"] == "NotAllowed" else None

        obj = cluster.wait_for(refused, "Ready=False NotAllowed", timeout=60)
        message = condition(obj, "Ready")["message"]
        assert "spec.output.credentialsSecret is not set" in message and "finance-prod-bucket" in message
        assert capture.requests == [], "the operator called the tenant's endpoint with its own credentials"
        assert not cluster.apps.list_namespaced_stateful_set(namespace).items
        assert "OPERATOR-SESSION-TOKEN" not in operator.tail()
    finally:
        operator.stop()


def test_an_administrator_may_allow_the_operators_identity_for_named_buckets(cluster, namespace, crd, s3_world,
                                                                              tmp_path):
    operator = operator_with(cluster, namespace, tmp_path / "operator.log",
                             TOKENMILL_AMBIENT_S3_BUCKETS="models,tokenmill-data",
                             identity={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
                             TOKENMILL_AMBIENT_S3_ENDPOINTS=s3_world)
    try:
        resource = b5_resource(namespace, s3_world)
        del resource["spec"]["output"]["credentialsSecret"]
        cluster.apply(resource)
        cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace),
                         "the server, planned from config.json read with the allowed identity", timeout=60)
        # No scraper namespace set for this operator: the runner pods admit nobody, the server only its runner.
        networking = cluster.api(k8s.NetworkingV1Api)
        runner = networking.read_namespaced_network_policy(f"{NAME}-runner", namespace)
        assert runner.spec.pod_selector.match_labels["app.kubernetes.io/component"] == "runner"
        assert not runner.spec.ingress
        server = networking.read_namespaced_network_policy(f"{NAME}-server", namespace)
        assert len(server.spec.ingress) == 2, "the runner and the replica's ranks, no label-only scraper"
    finally:
        operator.stop()


def test_a_binary_value_in_the_credentials_secret_does_not_stop_the_operator(cluster, namespace, crd, s3_world,
                                                                              tmp_path):
    der = bytes([0x30, 0x82, 0x01, 0x0A, 0xFF, 0xFE, 0x80])  # a DER key: not UTF-8
    cluster.core.create_namespaced_secret(namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name="s3-creds"),
        data={"AWS_ACCESS_KEY_ID": base64.b64encode(b"testing").decode(),
              "AWS_SECRET_ACCESS_KEY": base64.b64encode(b"testing").decode(),
              "client.der": base64.b64encode(der).decode()}))
    operator = operator_with(cluster, namespace, tmp_path / "operator.log")
    try:
        cluster.apply(b5_resource(namespace, s3_world))
        cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace),
                         "the server, the Secret's AWS keys decoded and the DER key left alone", timeout=60)
        assert "UnicodeDecodeError" not in operator.tail()
    finally:
        operator.stop()


def test_a_secret_without_aws_keys_never_lends_the_operators_identity(cluster, namespace, crd, credentials, s3_world,
                                                                      capture, tmp_path):
    """The operator's own `<run>-server-key` Secret (made for every run) named as a second run's credentials, the
    operator holding an identity of its own: refused naming the missing keys, nothing sent to the tenant's endpoint.
    On a87e82b the request arrived signed with the operator's key id and session token (security-a87e82b.md B1)."""
    operator = operator_with(cluster, namespace, tmp_path / "operator.log")
    try:
        cluster.apply(b5_resource(namespace, s3_world))  # a first run: the operator makes its server-key Secret
        server_key = f"{NAME}-server-key"
        cluster.wait_for(lambda: cluster.core.read_namespaced_secret(server_key, namespace), server_key, timeout=60)
        borrower = b5_resource(namespace, capture.url, name="borrower", **{
            "output.uri": "s3://finance-prod-bucket/anything/", "output.credentialsSecret": server_key,
            "model.path": "s3://finance-prod-bucket/models/llama/"})
        cluster.apply(borrower)

        def refused():
            obj = dsgen(cluster, namespace, "borrower")
            ready = condition(obj, "Ready")
            return obj if ready and ready["reason"] == "NotAllowed" else None

        message = condition(cluster.wait_for(refused, "Ready=False NotAllowed", timeout=60), "Ready")["message"]
        assert f"Secret '{server_key}'" in message
        assert "AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY" in message, message
        assert capture.requests == [], [(m, p, h.get("Authorization")) for m, p, h in capture.requests]
        selector = "app.kubernetes.io/instance=borrower"
        assert not cluster.apps.list_namespaced_stateful_set(namespace, label_selector=selector).items
        log = operator.tail(10**7)
        assert "OPERATOR-SESSION-TOKEN" not in log and "AKIAOPERATORROLE0001" not in log
    finally:
        operator.stop()


def test_at_the_highest_verbosity_no_tenant_credential_reaches_the_operators_log(cluster, namespace, crd, s3_world,
                                                                                 tmp_path):
    """security-a87e82b.md W6: at --verbose botocore logged a tenant's key id and session token (and the Kubernetes
    client the Secret's data) into the operator's log."""
    tenant = {"AWS_ACCESS_KEY_ID": "AKIATEAMBKEY00000001", "AWS_SECRET_ACCESS_KEY": "teamb-secret-key-0123456789",
              "AWS_SESSION_TOKEN": "TEAMB-SESSION-TOKEN-FwoGZXIvYXdzEJr"}
    cluster.core.create_namespaced_secret(namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="team-b-s3"),
                                                                  string_data=tenant))
    operator = Operator(cluster, namespace, tmp_path / "operator.log")
    operator.args = ["--verbose", "--debug"]
    operator.start()
    try:
        cluster.apply(b5_resource(namespace, s3_world, **{"output.credentialsSecret": "team-b-s3"}))
        cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace),
                         "the server, planned from config.json read with the tenant's keys", timeout=60)
    finally:
        operator.stop()
    log = operator.log.read_text(errors="replace")
    assert "DEBUG" in log, "the operator ran at DEBUG"
    encoded = [base64.b64encode(v.encode()).decode() for v in tenant.values()]
    leaked = [v for v in [*tenant.values(), *encoded] if v in log]
    assert not leaked, f"in the operator's log: {leaked}"


def test_a_child_the_api_server_refuses_is_reported_in_the_status(cluster, namespace, crd, credentials, s3_world,
                                                                  tmp_path):
    """On a87e82b a refused child raised out of the pass before the status was written: the reason reached only the
    operator's log (security-a87e82b.md W8)."""
    cluster.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-statefulsets",
                                                                             "namespace": namespace},
                   "spec": {"hard": {"count/statefulsets.apps": "0"}}})
    operator = operator_with(cluster, namespace, tmp_path / "operator.log")
    try:
        cluster.apply(b5_resource(namespace, s3_world))

        def refused():
            obj = dsgen(cluster, namespace)
            ready = condition(obj, "Ready")
            return obj if ready and ready["reason"] == "ChildRefused" else None

        message = condition(cluster.wait_for(refused, "Ready=False ChildRefused", timeout=60), "Ready")["message"]
        assert f"StatefulSet {namespace}/{NAME}-server" in message and "exceeded quota" in message, message
    finally:
        operator.stop()
