"""What a set of S3 credentials (a tenant's Secret, or an environment) asks for: keys, or no identity at all. Pure.

The operator builds a tenant's S3 client only from the tenant's Secret. Those keys must be complete, or the Secret
must ask for unsigned requests in so many words: anything else would let boto3 fall back to its default chain,
which in the operator is the operator's own identity (docs/security.md, "The operator's identity").
"""

from __future__ import annotations

from collections.abc import Mapping

# Set to "true" in a credentials Secret (or the runner's environment): unsigned requests, for a public bucket. It is
# the only way to go without keys once a Secret is named.
ANONYMOUS_KEY = "TOKENMILL_S3_ANONYMOUS"
# The keys explicit credentials must hold; AWS_SESSION_TOKEN is optional.
REQUIRED_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# Every key the operator reads from a credentials Secret (the others may hold anything, e.g. a DER key).
SECRET_KEYS = (*REQUIRED_KEYS, "AWS_SESSION_TOKEN", ANONYMOUS_KEY)


def asks_anonymous(values: Mapping[str, str]) -> bool:
    return values.get(ANONYMOUS_KEY, "").strip().lower() == "true"


def missing_keys(credentials: Mapping[str, str]) -> list[str]:
    """The required keys explicit credentials lack or leave empty ([] for anonymous ones)."""
    if asks_anonymous(credentials):
        return []
    return [key for key in REQUIRED_KEYS if not credentials.get(key, "").strip()]
