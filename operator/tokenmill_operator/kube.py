"""The one layer that talks to the Kubernetes API (besides kopf itself): apply, get, list, delete, patch.

Children are applied with server-side apply under one field manager, so re-running a reconcile is a no-op and
fields other controllers own (StatefulSet status, Job status) are never touched.
"""

from __future__ import annotations

import base64
import json
import logging
from functools import cache
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from urllib3.exceptions import HTTPError

logger = logging.getLogger(__name__)

FIELD_MANAGER = "tokenmill-operator"
# A read that fails for any reason but "not found": the API server is down, overloaded or slow.
TRANSIENT = (ApiException, HTTPError, OSError)
# Client-side timeout of one request (connect, read): a hung API server must not hold a reconcile pass for long.
REQUEST_TIMEOUT = (5, 30)


class KubeUnavailable(RuntimeError):
    """The API server could not be read; says what was being read."""


def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class ApiNotServed(LookupError):
    """The API server does not serve this kind (its CRD is not installed)."""


class ChildRefused(RuntimeError):
    """The API server refused a child the operator made (a ResourceQuota, an admission policy, an invalid value):
    reported in the resource's status, not only in the operator's log."""


REFUSED_CODES = (400, 403, 422)


def _refused(error: ApiException, body: dict[str, Any]) -> ChildRefused:
    try:
        message = json.loads(error.body or "{}").get("message") or error.reason
    except (ValueError, AttributeError):
        message = error.reason
    meta = body.get("metadata", {})
    return ChildRefused(f"the API server refused {body.get('kind')} {meta.get('namespace')}/{meta.get('name')} "
                        f"(HTTP {error.status}): {message}")


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api_client = api_client or client.ApiClient()
        self.dynamic = DynamicClient(self.api_client)
        self._resources: dict[tuple[str, str], Any] = {}

    def _resource(self, api_version: str, kind: str) -> Any:
        key = (api_version, kind)
        if key not in self._resources:
            try:
                self._resources[key] = self.dynamic.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError as error:
                raise ApiNotServed(f"{kind} ({api_version})") from error
        return self._resources[key]

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        resource = self._resource(body["apiVersion"], body["kind"])
        meta = body["metadata"]
        try:
            result = resource.server_side_apply(body=body, name=meta["name"], namespace=meta.get("namespace"),
                                                field_manager=FIELD_MANAGER, force_conflicts=True)
        except ApiException as error:
            if error.status in REFUSED_CODES:
                raise _refused(error, body) from error
            raise
        return result.to_dict()

    def create_if_absent(self, body: dict[str, Any]) -> bool:
        """Create; leave an existing object alone (Jobs: their pod template is immutable; Secrets: keep the key)."""
        resource = self._resource(body["apiVersion"], body["kind"])
        try:
            resource.create(body=body, namespace=body["metadata"].get("namespace"))
        except ApiException as error:
            if error.status == 409:
                return False
            if error.status in REFUSED_CODES:
                raise _refused(error, body) from error
            raise
        return True

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
        """The object, None when it does not exist; KubeUnavailable when the API server cannot tell."""
        try:
            return self._resource(api_version, kind).get(name=name, namespace=namespace,
                                                         _request_timeout=REQUEST_TIMEOUT).to_dict()
        except NotFoundError:
            return None
        except TRANSIENT as error:
            raise KubeUnavailable(f"cannot read {kind} {namespace}/{name} from the API server: {error}") from error

    def list(self, api_version: str, kind: str, namespace: str | None,
             selector: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of a kind matching `selector`, in `namespace` (None: a cluster-scoped kind, e.g. Node)."""
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        try:
            items = self._resource(api_version, kind).get(namespace=namespace, label_selector=label_selector,
                                                          _request_timeout=REQUEST_TIMEOUT)
        except TRANSIENT as error:
            raise KubeUnavailable(f"cannot list {kind} in {namespace} from the API server: {error}") from error
        return [item.to_dict() for item in items.items]

    def delete(self, api_version: str, kind: str, name: str, namespace: str, propagation: str = "Background") -> bool:
        """Delete; Foreground keeps the object until its dependents (a Job's pods) are gone."""
        try:
            self._resource(api_version, kind).delete(name=name, namespace=namespace,
                                                     body={"propagationPolicy": propagation},
                                                     _request_timeout=REQUEST_TIMEOUT)
        except NotFoundError:
            return False
        return True

    def patch(self, api_version: str, kind: str, name: str, namespace: str, body: dict[str, Any]) -> None:
        self._resource(api_version, kind).patch(name=name, namespace=namespace, body=body,
                                                content_type="application/merge-patch+json",
                                                _request_timeout=REQUEST_TIMEOUT)

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str, body: dict[str, Any]) -> None:
        """JSON merge patch of the status subresource (the operator never writes spec)."""
        self._resource(api_version, kind).status.patch(name=name, namespace=namespace, body={"status": body},
                                                       content_type="application/merge-patch+json",
                                                       _request_timeout=REQUEST_TIMEOUT)

    def secret_data(self, name: str, namespace: str, keys: tuple[str, ...]) -> dict[str, str]:
        """The Secret's `keys` as text; only those are decoded, so another key may hold binary data."""
        secret = self.get("v1", "Secret", name, namespace)
        if secret is None:
            raise LookupError(f"Secret {namespace}/{name} does not exist")
        return decode_secret_keys(secret.get("data") or {}, keys, f"Secret {namespace}/{name}")


def decode_secret_keys(data: dict[str, str], keys: tuple[str, ...], where: str) -> dict[str, str]:
    """`keys` of a Secret's base64 data as UTF-8 text (the keys it lacks left out); a key that is not text is a
    LookupError naming it, never a traceback on every pass."""
    decoded = {}
    for key in keys:
        if key in data:
            try:
                decoded[key] = base64.b64decode(data[key]).decode()
            except ValueError:  # binascii.Error and UnicodeDecodeError both are
                raise LookupError(f"{where} key {key} is not UTF-8 text") from None
    return decoded


@cache
def default_kube() -> Kube:
    load_config()
    return Kube()
