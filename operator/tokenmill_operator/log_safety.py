"""No tenant secret in the operator's log, at any verbosity.

kopf's --verbose and --debug put the root logger at DEBUG (kopf/_core/actions/loggers.py `configure`). There,
botocore logs each request's canonical headers and signature (a tenant's key id in `Credential=`, its session
token in x-amz-security-token) and the Kubernetes client logs response bodies (a Secret's base64 data). Those
libraries are kept at WARNING whatever kopf's level, and every line the operator's handlers write goes through the
runner's redaction of signature and token headers (runner logs.py) in case another library prints them.
"""

from __future__ import annotations

import logging

from tokenmill_runner.logs import redact

# Libraries whose DEBUG records carry credentials or Secret data; the operator's own loggers keep kopf's level.
QUIET = ("botocore", "boto3", "s3transfer", "urllib3", "kubernetes")


class RedactingFilter(logging.Filter):
    """Rewrites a record's message with the signature and token header values replaced by ***."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = redact(message, ())
        if safe != message:
            record.msg, record.args = safe, None
        return True


def protect(root: logging.Logger | None = None) -> None:
    """Pin the libraries' loggers at WARNING and redact through every handler of the root logger (idempotent)."""
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    root = root or logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
