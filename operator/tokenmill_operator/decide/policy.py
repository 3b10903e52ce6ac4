"""What the operator does on a tenant's behalf, bounded by its own settings: never its cloud identity for a tenant's
storage unless an administrator named the buckets, and only allowed images and Secrets when a list is set. Pure.

Creating a DatasetGeneration is as powerful as creating a pod in its namespace (docs/security.md): the operator
runs the images the resource names with the Secret it names. These settings let an administrator narrow that, and
keep the operator's own identity (IRSA, an instance profile, AWS_* in its environment) out of a tenant's reach: a
resource without spec.output.credentialsSecret would otherwise make boto3 fall back to it against an endpoint and
bucket the resource chose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.credentials import ANONYMOUS_KEY, asks_anonymous, missing_keys

AMBIENT_BUCKETS_ENV = "TOKENMILL_AMBIENT_S3_BUCKETS"
AMBIENT_ENDPOINTS_ENV = "TOKENMILL_AMBIENT_S3_ENDPOINTS"
ALLOWED_IMAGES_ENV = "TOKENMILL_ALLOWED_IMAGES"
ALLOWED_SECRETS_ENV = "TOKENMILL_ALLOWED_SECRETS"


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())


@dataclass(frozen=True)
class TenantPolicy:
    ambient_buckets: tuple[str, ...] = ()  # buckets the operator may reach with its own identity (none by default)
    ambient_endpoints: tuple[str, ...] = ()  # endpoints allowed with them; none: the default (AWS) endpoint only
    allowed_images: tuple[str, ...] = ()  # image prefixes a resource may run (empty: any image)
    allowed_secrets: tuple[str, ...] = ()  # Secrets spec.output.credentialsSecret may name (empty: any)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TenantPolicy:
        """Comma-separated lists, set by the chart from `operator.policy` (values.yaml)."""
        return cls(_names(env.get(AMBIENT_BUCKETS_ENV)), _names(env.get(AMBIENT_ENDPOINTS_ENV)),
                   _names(env.get(ALLOWED_IMAGES_ENV)), _names(env.get(ALLOWED_SECRETS_ENV)))


def s3_buckets(spec: DatasetGenerationSpec) -> list[str]:
    """The buckets the operator reads or writes for this resource: the output's, and the model files' on S3."""
    locations = [spec.output.uri, spec.model.path, spec.model.tokenizer]
    return list(dict.fromkeys(uri[len("s3://"):].partition("/")[0] for uri in locations
                              if uri and uri.startswith("s3://")))


def ambient_refusal(spec: DatasetGenerationSpec, policy: TenantPolicy) -> str | None:
    """Why the operator will not touch this resource's storage with its own identity, or None (a Secret is named,
    or every bucket and the endpoint are allowed)."""
    if spec.output.credentials_secret:
        return None
    buckets = s3_buckets(spec)
    outside = [bucket for bucket in buckets if bucket not in policy.ambient_buckets]
    endpoint = spec.output.endpoint
    if not buckets or (not outside and (endpoint is None or endpoint in policy.ambient_endpoints)):
        return None
    what = f"bucket(s) {', '.join(outside)}" if outside else f"endpoint {endpoint}"
    return (f"spec.output.credentialsSecret is not set, and the operator never uses its own cloud identity for a "
            f"tenant's storage unless its administrator allows the {what} ({AMBIENT_BUCKETS_ENV} / "
            f"{AMBIENT_ENDPOINTS_ENV}, chart values operator.policy.ambientS3Buckets / ambientS3Endpoints): create a "
            "Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY and name it in spec.output.credentialsSecret")


def credentials_refusal(spec: DatasetGenerationSpec, credentials: Mapping[str, str]) -> str | None:
    """Why the keys read from the named Secret cannot be used, or None. The tenant's S3 client is built only from
    them (or goes unsigned when the Secret says TOKENMILL_S3_ANONYMOUS=true): a Secret without them (a TLS Secret,
    the `<run>-server-key` Secret the operator makes for every run) must never leave boto3 to its default chain."""
    if not s3_buckets(spec):
        return None  # nothing on S3: the Secret's keys are never used
    secret = spec.output.credentials_secret
    missing = missing_keys(credentials)
    if missing:
        return (f"Secret {secret!r} (spec.output.credentialsSecret) has no {' or '.join(missing)}, and the operator "
                "builds a tenant's S3 client only from that Secret, never from its own cloud identity: add "
                f"{', '.join(missing)} to it, or set {ANONYMOUS_KEY}: \"true\" in it for unsigned requests to a "
                "public bucket")
    if asks_anonymous(credentials) and spec.model.cache is not None:
        return (f"Secret {secret!r} asks for unsigned S3 requests ({ANONYMOUS_KEY}), which spec.model.cache's copy "
                "(the aws CLI) cannot make: remove spec.model.cache or give the Secret keys")
    return None


IMAGE_DELIMITERS = ("/", ":", "@")


def image_allowed(image: str, prefix: str) -> bool:
    """Whether `image` is `prefix` or lies under it at a delimiter: `ghcr.io/tokenmill` allows
    `ghcr.io/tokenmill/runner:1` and `ghcr.io/tokenmill:1`, never `ghcr.io/tokenmill-evil/r:1` (a bare startswith
    did, security-a87e82b.md W1). A prefix that ends in a delimiter (`lmsysorg/sglang:`) is already one."""
    if prefix.endswith(IMAGE_DELIMITERS):
        return image.startswith(prefix)
    return image == prefix or image.startswith(tuple(prefix + d for d in IMAGE_DELIMITERS))


def image_refusal(spec: DatasetGenerationSpec, policy: TenantPolicy) -> str | None:
    if not policy.allowed_images:
        return None
    for field, image in (("spec.server.image", spec.server.image), ("spec.runner.image", spec.runner.image)):
        if image is not None and not any(image_allowed(image, prefix) for prefix in policy.allowed_images):
            return (f"{field} {image!r} is not among the images this operator runs ({', '.join(policy.allowed_images)}"
                    f"; {ALLOWED_IMAGES_ENV}, chart value operator.policy.allowedImages): use one of them")
    return None


def secret_refusal(spec: DatasetGenerationSpec, policy: TenantPolicy) -> str | None:
    secret = spec.output.credentials_secret
    if not policy.allowed_secrets or secret is None or secret in policy.allowed_secrets:
        return None
    return (f"spec.output.credentialsSecret {secret!r} is not among the Secrets this operator hands to runners "
            f"({', '.join(policy.allowed_secrets)}; {ALLOWED_SECRETS_ENV}, chart value operator.policy.allowedSecrets)")


def refusal(spec: DatasetGenerationSpec, policy: TenantPolicy) -> str | None:
    """The first reason the operator will not act on this resource at all, or None."""
    for check in (ambient_refusal, image_refusal, secret_refusal):
        if why := check(spec, policy):
            return why
    return None
