"""The Kubernetes API calls the restart controller makes, as plain HTTPS with the service
account's token: list pods, evict one, read and patch the objects that hold the replica
count (a handful of calls do not justify a client library)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import httpx

from embedserve.config import ControllerSettings
from embedserve.contracts.surge import Owner
from embedserve.settings_errors import ConfigError

log = logging.getLogger("embedserve.restart_controller")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class EvictionBlocked(Exception):
    """The API server refused the eviction (PDB would be violated): try next round."""


#: Where each owner keeps the count a surge raises: (API path prefix, JSON pointer).
COUNT_FIELDS: dict[Owner, tuple[str, str]] = {
    "deployment": ("/apis/apps/v1/namespaces/{ns}/deployments", "/spec/replicas"),
    "hpa": ("/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers", "/spec/minReplicas"),
    "scaledobject": ("/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects", "/spec/minReplicaCount"),
}


class ServiceAccountToken(httpx.Auth):
    """The projected token is rotated by the kubelet (hourly): read it for every request."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.path.read_text().strip()}"
        yield request


class KubeApi:
    """The calls the controller needs, as plain HTTPS with a bearer token."""

    def __init__(
        self,
        base_url: str,
        namespace: str,
        token: httpx.Auth | None,
        verify: str | bool = True,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.namespace = namespace
        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers={"Accept": "application/json"},
            auth=token,
            verify=verify,
            timeout=timeout_s,
            transport=transport,
        )

    @classmethod
    def in_cluster(cls, cfg: ControllerSettings) -> KubeApi:
        """Service-account token, CA and namespace from the pod's mounted secret."""
        token = ServiceAccountToken(SA_DIR / "token") if (SA_DIR / "token").exists() else None
        namespace = cfg.namespace
        if namespace is None and (SA_DIR / "namespace").exists():
            namespace = (SA_DIR / "namespace").read_text().strip()
        base = cfg.api_url
        if base is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")  # set by the kubelet
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ConfigError(
                    "EMBEDSERVE_CONTROLLER__API_URL must be set outside a cluster "
                    "(KUBERNETES_SERVICE_HOST is not), e.g. https://127.0.0.1:6443"
                )
            base = f"https://{host}:{port}"
        ca = SA_DIR / "ca.crt"
        return cls(
            base,
            namespace or "default",
            token,
            verify=str(ca) if ca.exists() else True,
            timeout_s=cfg.api_timeout_s,
        )

    async def list_pods(self, label_selector: str) -> list[dict[str, Any]]:
        r = await self._client.get(
            f"/api/v1/namespaces/{self.namespace}/pods",
            params={"labelSelector": label_selector},
        )
        r.raise_for_status()
        items = r.json().get("items", [])
        return [i for i in items if isinstance(i, dict)]

    async def evict(self, pod: str, dry_run: bool = False) -> None:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": self.namespace},
        }
        if dry_run:
            body["deleteOptions"] = {"dryRun": ["All"]}
        r = await self._client.post(f"/api/v1/namespaces/{self.namespace}/pods/{pod}/eviction", json=body)
        if r.status_code == 429:
            raise EvictionBlocked(_message(r))
        if r.status_code == 404:
            log.info("pod %s is already gone", pod)
            return
        r.raise_for_status()

    def _path(self, owner: Owner, name: str) -> str:
        return COUNT_FIELDS[owner][0].format(ns=self.namespace) + f"/{name}"

    async def get(self, owner: Owner, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none (a ScaledObject without KEDA installed)."""
        r = await self._client.get(self._path(owner, name))
        if r.status_code == 404:
            return None
        r.raise_for_status()
        body = r.json()
        return body if isinstance(body, dict) else None

    async def list_hpas(self) -> list[dict[str, Any]]:
        r = await self._client.get(COUNT_FIELDS["hpa"][0].format(ns=self.namespace))
        r.raise_for_status()
        return [i for i in r.json().get("items", []) if isinstance(i, dict)]

    async def set_count(
        self, owner: Owner, name: str, expect: int | None, value: int | None, dry_run: bool = False
    ) -> bool:
        """Set the owner's count to ``value`` (None: unset it) only if it still reads
        ``expect``: False, and nothing changed, when someone else set it meanwhile."""
        pointer = COUNT_FIELDS[owner][1]
        ops: list[dict[str, Any]] = []
        if expect is not None:
            ops.append({"op": "test", "path": pointer, "value": expect})
        ops.append(
            {"op": "remove", "path": pointer}
            if value is None
            else {"op": "add", "path": pointer, "value": value}
        )
        r = await self._client.patch(
            self._path(owner, name),
            content=json.dumps(ops),
            headers={"Content-Type": "application/json-patch+json"},
            params={"dryRun": "All"} if dry_run else None,
        )
        if r.status_code in (409, 422):  # the test failed: not ours to change any more
            log.info("%s/%s: %s", owner, name, _message(r))
            return False
        r.raise_for_status()
        return True

    async def annotate(self, owner: Owner, name: str, key: str, value: str | None) -> None:
        """Set (or with None remove) one annotation."""
        r = await self._client.patch(
            self._path(owner, name),
            content=json.dumps({"metadata": {"annotations": {key: value}}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        r.raise_for_status()

    async def aclose(self) -> None:
        await self._client.aclose()


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))
    except ValueError:
        return r.text
