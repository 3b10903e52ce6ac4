"""The edge that reads a server replica's /metrics: one GET, bounded in bytes and in wall-clock time (the connection
is closed at the deadline, `deadline.py`), to the address asked and nowhere else. What the text means is
`server_metrics.parse_metrics` (pure).

SGLang serves /metrics on its HTTP port without the API key (0.5.23 utils/auth.py:101-106), so nothing secret is
sent; the server NetworkPolicy admits the operator's pods (manifests.network_policy). The pod's image is the
tenant's: it may answer slowly, at length, or with a redirect to another tenant's server or an internal address
(security-f9665d2.md B3, B4). So: plain http to the pod's own address (names.metrics_urls), no proxy, no redirect
followed (any answer but 200 is no figures), at most MAX_BYTES, within TIMEOUT_S in all. A replica that cannot be
read gives None: the check waits, the run is not touched.
"""

from __future__ import annotations

import http.client
import logging
from urllib.parse import urlsplit

from ..decide.server_metrics import Scrape, parse_metrics
from . import deadline
from .deadline import DeadlineExceeded

logger = logging.getLogger(__name__)

# The whole GET: connect, headers and body. SGLang answers in milliseconds; a busy scheduler (and the tests' loaded
# simulator) can take seconds, and dropping the slow answers would bias the window towards idle moments.
TIMEOUT_S = 10.0
MAX_BYTES = 4 << 20  # SGLang's /metrics is some hundred KB with its histograms


def metrics_url(base_url: str) -> tuple[str, int, str] | None:
    """(host, port, path) of the replica's /metrics; None for anything but a plain http:// URL with a host."""
    try:
        parts = urlsplit(base_url.rstrip("/") + "/metrics")
        port = parts.port or 80
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
        return None
    return parts.hostname, port, parts.path + (f"?{parts.query}" if parts.query else "")


def read_metrics(base_url: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> Scrape | None:
    target = metrics_url(base_url)
    url = base_url.rstrip("/") + "/metrics"
    if target is None:
        logger.warning("%s is not a plain http:// address: not read", url)
        return None
    host, port, path = target
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        with deadline.deadline(timeout_s, f"GET {url}"):
            connection.request("GET", path, headers={"Accept": "text/plain"})
            response = connection.getresponse()
            if response.status != 200:  # a redirect included: never followed
                logger.warning("%s answered HTTP %d: not read (no redirect is followed)", url, response.status)
                return None
            body = response.read(max_bytes + 1)
    except (OSError, http.client.HTTPException, DeadlineExceeded, ValueError) as error:
        logger.debug("cannot read %s: %s", url, error)
        return None
    finally:
        connection.close()
    if len(body) > max_bytes:
        logger.warning("%s answered more than %d bytes: not read", url, max_bytes)
        return None
    return parse_metrics(body.decode("utf-8", errors="replace"))
