"""How a pass reaches a tenant's store: the credentials Secret's S3 keys, and the store opened with the pass's short
retry budget."""

from __future__ import annotations

from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.credentials import SECRET_KEYS
from tokenmill_runner.store.storage import Storage, StorageRetry, open_storage

from ..kube import Kube

# A pass gives up on a store that keeps failing after this long and says ObservationFailed; the next pass tries
# again. The runner's long budget (storage.py, 600 s) would hold a pass, and the resource's status, for minutes.
OBSERVE_RETRY = StorageRetry(budget_s=10.0)


def tenant_credentials(kube: Kube, spec: DatasetGenerationSpec, namespace: str) -> dict[str, str] | None:
    """The credentials Secret's S3 keys (credentials.SECRET_KEYS; its other keys may hold anything, e.g. a DER key),
    or None when none is named (the operator's own identity, where policy.ambient_refusal allowed it)."""
    secret = spec.output.credentials_secret
    return kube.secret_data(secret, namespace, SECRET_KEYS) if secret else None


def storage_for(uri: str, spec: DatasetGenerationSpec, credentials: dict[str, str] | None) -> Storage:
    return open_storage(uri, spec.output.endpoint, spec.output.region, credentials, OBSERVE_RETRY)
