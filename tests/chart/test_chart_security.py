"""The chart's security settings rendered with helm: the operator pod's NetworkPolicy, the bind address, and the
tenant policy the operator enforces (docs/security.md)."""

from __future__ import annotations

from typing import Any

from .tools import one, template


def _env(objects: list[dict[str, Any]]) -> dict[str, str]:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_the_operator_pod_admits_only_the_scraper_namespace_on_the_metrics_port(helm: str, henv: dict[str, str]):
    objects = template(helm, env=henv)
    policy = one(objects, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"] == \
        one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    env = _env(objects)
    assert env["TOKENMILL_SCRAPER_NAMESPACE"] == "monitoring"  # the runners' and servers' policies use it too
    assert env["TOKENMILL_HEALTH_ADDRESS"] == env["TOKENMILL_METRICS_ADDRESS"] == "0.0.0.0"


def test_without_a_scraper_namespace_nothing_is_admitted(helm: str, henv: dict[str, str]):
    objects = template(helm, "--set", "metrics.scraperNamespace=", env=henv)
    assert not one(objects, "NetworkPolicy")["spec"].get("ingress")
    assert [o for o in template(helm, "--set", "networkPolicy.enabled=false", env=henv)
            if o["kind"] == "NetworkPolicy"] == []


def test_by_default_the_operator_never_lends_its_identity_and_any_image_may_run(helm: str, henv: dict[str, str]):
    env = _env(template(helm, env=henv))
    assert env["TOKENMILL_AMBIENT_S3_BUCKETS"] == "" and env["TOKENMILL_AMBIENT_S3_ENDPOINTS"] == ""
    assert env["TOKENMILL_ALLOWED_IMAGES"] == "" and env["TOKENMILL_ALLOWED_SECRETS"] == ""


def test_the_tenant_policy_reaches_the_operator(helm: str, henv: dict[str, str]):
    env = _env(template(helm, "--set", "operator.policy.ambientS3Buckets={models,shared-data}",
                        "--set", "operator.policy.allowedImages={lmsysorg/sglang:,ghcr.io/tokenmill/}",
                        "--set", "operator.policy.allowedSecrets={s3-creds}",
                        "--set", "operator.bindAddress=127.0.0.1", env=henv))
    assert env["TOKENMILL_AMBIENT_S3_BUCKETS"] == "models,shared-data"
    assert env["TOKENMILL_ALLOWED_IMAGES"] == "lmsysorg/sglang:,ghcr.io/tokenmill/"
    assert env["TOKENMILL_ALLOWED_SECRETS"] == "s3-creds"
    assert env["TOKENMILL_METRICS_ADDRESS"] == "127.0.0.1"


def test_allowed_secrets_narrow_what_the_operator_may_read(helm: str, henv: dict[str, str]):
    """Cluster scope grants `get` on every Secret of the cluster by name; with allowedSecrets only those names."""
    def secret_rules(objects):
        return [r for r in one(objects, "ClusterRole")["rules"] if "secrets" in r["resources"]]

    assert secret_rules(template(helm, env=henv)) == [{"apiGroups": [""], "resources": ["secrets"],
                                                       "verbs": ["get", "create"]}]
    narrowed = secret_rules(template(helm, "--set", "operator.policy.allowedSecrets={s3-creds,team-b-s3}", env=henv))
    assert narrowed == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
                         "resourceNames": ["s3-creds", "team-b-s3"]},
                        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]


def test_allowed_secrets_leave_every_other_rule_in_place(helm: str, henv: dict[str, str]):
    """security-a87e82b.md W4: on a87e82b the PVC and Kueue Workload rules sat inside the allowedSecrets `else`
    (_rbac.tpl:50-76), so narrowing Secrets made every shared-cache claim and every Workload a 403."""
    def others(objects):
        kinds = [o for o in objects if o["kind"] in ("ClusterRole", "Role")]
        return sorted((tuple(r.get("apiGroups", [])), tuple(r["resources"]), tuple(r["verbs"]))
                      for role in kinds for r in role["rules"] if "secrets" not in r["resources"])

    for scope in (["--set", "rbac.scope=cluster"], ["--set", "rbac.scope=namespace",
                                                     "--set", "rbac.namespaces={team-a}"]):
        wide = others(template(helm, *scope, env=henv))
        narrowed = others(template(helm, *scope, "--set", "operator.policy.allowedSecrets={team-a-s3}", env=henv))
        assert narrowed == wide
        assert (("",), ("persistentvolumeclaims",), ("get", "create", "patch")) in narrowed
        assert (("kueue.x-k8s.io",), ("workloads",), ("get", "list", "create", "delete")) in narrowed
        assert (("kueue.x-k8s.io",), ("workloads/status",), ("patch",)) in narrowed


def test_the_operator_can_be_told_to_require_a_kueue_queue(helm: str, henv: dict[str, str]):
    assert _env(template(helm, env=henv))["TOKENMILL_REQUIRE_QUEUE"] == "false"
    assert _env(template(helm, "--set", "operator.kueue.requireQueue=true", env=henv))["TOKENMILL_REQUIRE_QUEUE"] \
        == "true"
