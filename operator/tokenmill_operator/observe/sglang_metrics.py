"""The edge that reads a server replica's /metrics: one bounded GET with a timeout. What the text means is
`server_metrics.parse_metrics` (pure).

SGLang serves /metrics on its HTTP port without the API key (0.5.23 utils/auth.py:101-106), so nothing secret is
sent; the server NetworkPolicy admits the operator's pods (manifests.network_policy). A replica that cannot be read
(not up yet, a slow answer, a policy that drops the operator) gives None: the check waits, the run is not touched.
"""

from __future__ import annotations

import logging
import urllib.request

from ..decide.server_metrics import Scrape, parse_metrics

logger = logging.getLogger(__name__)

TIMEOUT_S = 3.0
MAX_BYTES = 4 << 20  # SGLang's /metrics is some hundred KB with its histograms
# In-cluster addresses: never through an HTTP(S)_PROXY the operator's environment may set for the outside.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read_metrics(base_url: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> Scrape | None:
    url = base_url.rstrip("/") + "/metrics"
    try:
        with _OPENER.open(url, timeout=timeout_s) as response:
            body = response.read(max_bytes + 1)
    except (OSError, ValueError) as error:  # URLError, timeouts, refused connections, a bad URL
        logger.debug("cannot read %s: %s", url, error)
        return None
    if len(body) > max_bytes:
        logger.warning("%s answered more than %d bytes: not read", url, max_bytes)
        return None
    return parse_metrics(body.decode("utf-8", errors="replace"))

