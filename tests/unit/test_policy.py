"""The operator's tenant policy: its own identity never reaches a tenant's storage unless an administrator named the
buckets and endpoints; images and Secrets limited when a list is set (docs/security.md)."""

from __future__ import annotations

import base64

import pytest

from tokenmill_operator.decide.policy import TenantPolicy, credentials_refusal, refusal
from tokenmill_operator.kube import decode_secret_keys
from tokenmill_runner.spec.resource import DatasetGenerationSpec, parse_document
from tokenmill_runner.store.credentials import SECRET_KEYS


def spec(**output):
    document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "t"},
                "spec": {"model": {"path": "s3://models/kimi/"},
                         "datasets": [{"name": "a", "source": "s3://p/a.jsonl"}],
                         "output": {"uri": "s3://finance-prod-bucket/anything/", **output}}}
    return parse_document(document).spec


def test_without_a_secret_the_operators_identity_is_refused_naming_the_buckets():
    why = refusal(spec(endpoint="http://attacker.example:5057"), TenantPolicy())
    assert why and "spec.output.credentialsSecret is not set" in why
    assert "finance-prod-bucket, models" in why and "TOKENMILL_AMBIENT_S3_BUCKETS" in why


def test_named_buckets_and_endpoint_allow_the_operators_identity():
    allowed = TenantPolicy(ambient_buckets=("finance-prod-bucket", "models"), ambient_endpoints=("https://s3.local",))
    assert refusal(spec(), allowed) is None  # the default endpoint
    assert refusal(spec(endpoint="https://s3.local"), allowed) is None
    other = refusal(spec(endpoint="http://attacker.example:5057"), allowed)
    assert other and "endpoint http://attacker.example:5057" in other
    assert "bucket(s) finance-prod-bucket" in refusal(spec(), TenantPolicy(ambient_buckets=("models",)))


def test_a_named_secret_is_used_instead_unless_the_list_of_secrets_leaves_it_out():
    assert refusal(spec(credentialsSecret="team-a-s3"), TenantPolicy()) is None
    listed = TenantPolicy(allowed_secrets=("team-a-s3",))
    assert refusal(spec(credentialsSecret="team-a-s3"), listed) is None
    why = refusal(spec(credentialsSecret="some-other-apps-secret"), listed)
    assert why and "'some-other-apps-secret' is not among the Secrets" in why


def test_images_outside_the_allowed_prefixes_are_refused():
    policy = TenantPolicy(allowed_images=("lmsysorg/sglang:", "ghcr.io/tokenmill/"))
    document = spec(credentialsSecret="s").model_dump(by_alias=True)
    document["runner"]["image"] = "attacker/exfil:latest"
    why = refusal(DatasetGenerationSpec.model_validate(document), policy)
    assert why and "spec.runner.image 'attacker/exfil:latest'" in why
    assert refusal(spec(credentialsSecret="s"), policy) is None  # the default SGLang image


def test_the_settings_come_from_comma_separated_lists():
    policy = TenantPolicy.from_env({"TOKENMILL_AMBIENT_S3_BUCKETS": "a, b,", "TOKENMILL_ALLOWED_IMAGES": "x/"})
    assert policy == TenantPolicy(ambient_buckets=("a", "b"), allowed_images=("x/",))


def test_only_the_keys_used_are_decoded_from_a_secret():
    data = {"AWS_ACCESS_KEY_ID": base64.b64encode(b"AKIA1").decode(),
            "client.der": base64.b64encode(bytes([0x30, 0x82, 0xFF, 0xFE])).decode()}
    assert decode_secret_keys(data, ("AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN"), "Secret ns/s") == {
        "AWS_ACCESS_KEY_ID": "AKIA1"}
    with pytest.raises(LookupError, match="Secret ns/s key client.der is not UTF-8 text"):
        decode_secret_keys(data, ("client.der",), "Secret ns/s")


# The data of the Secret the operator itself makes for every run (manifests.api_key_secret): no AWS key at all.
SERVER_KEY_SECRET = {"api-key": "tm-5f3c9e1d"}


def test_a_secret_without_the_keys_is_refused_naming_them_not_left_to_the_default_chain():
    # On a87e82b a named Secret stopped every check (policy.py:52) and its empty keys sent boto3 to the operator's
    # own identity (security-a87e82b.md, B1).
    named = spec(credentialsSecret="other-run-server-key", endpoint="http://attacker.example:5057")
    assert refusal(named, TenantPolicy()) is None  # names a Secret: the ambient check passes it on ...
    keys = {k: v for k, v in SERVER_KEY_SECRET.items() if k in SECRET_KEYS}  # what decode_secret_keys returns
    why = credentials_refusal(named, keys)  # ... to the check of what the Secret holds
    assert why and "Secret 'other-run-server-key'" in why
    assert "AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY" in why and "TOKENMILL_S3_ANONYMOUS" in why
    half = credentials_refusal(named, {"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": " "})
    assert half and "has no AWS_SECRET_ACCESS_KEY," in half and "AWS_ACCESS_KEY_ID or" not in half
    assert credentials_refusal(named, {"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s"}) is None


def test_a_secret_may_ask_for_unsigned_requests_but_not_with_a_model_cache():
    named = spec(credentialsSecret="public-bucket")
    assert credentials_refusal(named, {"TOKENMILL_S3_ANONYMOUS": "true"}) is None
    assert credentials_refusal(named, {"TOKENMILL_S3_ANONYMOUS": "yes please"}), "only the literal true"
    document = named.model_dump(by_alias=True)
    document["model"]["cache"] = {"mode": "nodeLocal"}
    cached = DatasetGenerationSpec.model_validate(document)
    why = credentials_refusal(cached, {"TOKENMILL_S3_ANONYMOUS": "true"})
    assert why and "spec.model.cache" in why


def test_a_run_without_s3_needs_no_keys_in_its_secret():
    document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "t"},
                "spec": {"model": {"path": "/models/kimi"}, "datasets": [{"name": "a", "source": "/data/a.jsonl"}],
                         "output": {"uri": "/out/", "credentialsSecret": "tls"}}}
    assert credentials_refusal(parse_document(document).spec, {}) is None


@pytest.mark.parametrize(("prefix", "image", "allowed"), [
    ("ghcr.io/tokenmill", "ghcr.io/tokenmill/runner:1", True),
    ("ghcr.io/tokenmill", "ghcr.io/tokenmill:1", True),
    ("ghcr.io/tokenmill", "ghcr.io/tokenmill@sha256:abc", True),
    ("ghcr.io/tokenmill", "ghcr.io/tokenmill-evil/r:1", False),  # allowed on a87e82b (security-a87e82b.md W1)
    ("ghcr.io/tokenmill", "ghcr.io/tokenmillevil:1", False),
    ("lmsysorg/sglang:", "lmsysorg/sglang:v0.5.23", True),
    ("lmsysorg/sglang:", "lmsysorg/sglang-evil:v1", False),
    ("ghcr.io/tokenmill/", "ghcr.io/tokenmill-evil/r:1", False),
])
def test_an_image_prefix_matches_only_at_a_delimiter(prefix, image, allowed):
    document = spec(credentialsSecret="s").model_dump(by_alias=True)
    document["runner"]["image"] = image
    why = refusal(DatasetGenerationSpec.model_validate(document), TenantPolicy(allowed_images=(prefix,
                                                                                             "lmsysorg/sglang:")))
    assert (why is None) == allowed, why


def test_the_operators_log_keeps_credential_libraries_quiet_and_redacts_signatures():
    import logging

    from tokenmill_operator.log_safety import QUIET, RedactingFilter, protect

    root = logging.getLogger("tm-test-root")
    handler = logging.StreamHandler()
    root.addHandler(handler)
    levels = {name: logging.getLogger(name).level for name in QUIET}
    try:
        protect(root)
        protect(root)  # idempotent
        assert [type(f) for f in handler.filters] == [RedactingFilter]
        assert all(logging.getLogger(name).getEffectiveLevel() == logging.WARNING for name in QUIET)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    record = logging.LogRecord("x", logging.DEBUG, "", 0, "headers %s", ({"X-Amz-Security-Token": "TOKEN-abc",
                               "Authorization": "AWS4-HMAC-SHA256 Credential=AKIATEAMB/2026"},), None)
    handler.filters[0].filter(record)
    assert "TOKEN-abc" not in record.getMessage() and "AKIATEAMB" not in record.getMessage()
