"""How the tokenmill command writes its log: one line per record, and no secret in any line.

Messages quote what users wrote (a sample id, a row's text), so a newline or an ANSI escape in a row could forge a
log line or repaint the terminal: control characters are escaped. At -vv botocore logs every request's headers,
the session token (x-amz-security-token) among them: those values, and the secrets this process holds in its
environment, are replaced by `***`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

from .spec.config import API_KEY_ENV

REDACTED = "***"
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", API_KEY_ENV)
# Header values botocore prints at debug level: in the canonical request (name:value), in header dicts
# ('X-Amz-Security-Token': b'...'), and the request signature.
SECRET_HEADERS = re.compile(
    r"(?i)((?:x-amz-security-token|authorization)['\"]?\s*[:=]\s*b?['\"]?)([^'\"\n}]+)")
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    return CONTROL.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


def redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return SECRET_HEADERS.sub(lambda match: match.group(1) + REDACTED, text)


class SafeFormatter(logging.Formatter):
    """A record's message on one line with secrets redacted; a traceback (debug level) keeps its lines."""

    def __init__(self, fmt: str, secrets: Iterable[str] = ()) -> None:
        super().__init__(fmt)
        self.secrets = tuple(secret for secret in secrets if len(secret) >= 8)  # a short value would redact words

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escape_controls(redact(record.message, self.secrets))
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: N802 - logging's name
        return redact(super().formatException(ei), self.secrets)


def setup(level: int, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter(fmt, (os.environ.get(name, "") for name in SECRET_ENV)))
    logging.basicConfig(level=level, handlers=[handler])
