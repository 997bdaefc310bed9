"""The Kubernetes API calls of ``greenroom reclaim ROOT --kubernetes``
(``greenroom.dirs.janitor``): the client's credentials, the listing of the node's pods,
and the checks that the listing is this node's.

A ``--node-name`` that is not this node would make every pod here look gone, so it is
refused before anything is deleted: in a pod the listing must hold the janitor's own pod
(``check_listing``), outside one the Node must be this host, by name or address
(``check_node_is_this_host``).

The client's failures become two exceptions: ``NoApiAccess`` (no credentials, or a
401/403) and ``ApiUnavailable`` (unreachable, a 5xx or 429, an unreadable reply: what may
pass); the janitor decides what each one means for a pass.

Imports no torch.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from greenroom.dirs.pod_rule import PodInfo
from greenroom.errors import ConfigError

REQUEST_TIMEOUT = (5, 30)  # connect, read: a hung API server must not hang the janitor


class ApiUnavailable(Exception):
    """The pod listing failed in a way that may pass (unreachable, 5xx, 429)."""


class NoApiAccess(Exception):
    """No credentials, or the API refuses this identity (401/403)."""


def load_api() -> k8s.CoreV1Api:
    """The in-cluster service account's API, else the kubeconfig's; NoApiAccess if neither."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        try:
            # $KUBECONFIG read now, not when the client was imported.
            k8s_config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except (k8s_config.ConfigException, OSError) as e:
            raise NoApiAccess(f"no in-cluster service account and no usable kubeconfig ({e})") from None
    configuration = k8s.Configuration.get_default_copy()
    configuration.retries = 0  # our loop backs off; urllib3's own retries would only delay that
    return k8s.CoreV1Api(k8s.ApiClient(configuration))


@contextlib.contextmanager
def api_errors(doing: str, needs: str):
    """The client's failures while ``doing`` (``"listing pods"``): NoApiAccess for a
    401/403, with ``needs`` naming the access it takes; ApiUnavailable for the rest, which
    may pass."""
    try:
        yield
    except k8s.ApiException as e:
        if e.status in (401, 403):
            raise NoApiAccess(f"{doing} was refused (HTTP {e.status} {e.reason}): {needs}") from None
        raise ApiUnavailable(f"{doing} failed: HTTP {e.status} {e.reason}") from None
    except (urllib3.exceptions.HTTPError, OSError) as e:
        raise ApiUnavailable(f"{doing} failed: {type(e).__name__}: {e}") from None
    except ValueError as e:  # a reply the client's models reject (a proxy's error page, ...)
        raise ApiUnavailable(f"{doing} failed: unreadable reply ({str(e).splitlines()[0]})") from None


def list_node_pods(api: k8s.CoreV1Api, node_name: str) -> dict[str, PodInfo]:
    """Pods bound to ``node_name``, by UID."""
    with api_errors("listing pods", "the janitor's ServiceAccount needs the ClusterRole with list on pods"):
        pods = api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node_name}", _request_timeout=REQUEST_TIMEOUT
        )
    found = {}
    for pod in pods.items or []:
        meta = pod.metadata
        labels = meta.labels or {}
        job = labels.get("batch.kubernetes.io/job-name") or labels.get("job-name") or ""
        found[meta.uid] = PodInfo(meta.name, meta.namespace, (pod.status.phase if pod.status else "") or "", job)
    return found


def check_listing(pods: dict[str, PodInfo], node_name: str, own_pod: str) -> None:
    """A listing that cannot be this node's is a ConfigError: a misspelt ``--node-name``
    lists no pod, another node's name that node's, and either way every dir of a pod here
    would count as gone. In a pod, the janitor's own pod must be listed; outside one, a node
    runs at least one pod (its DaemonSets'), and ``check_node_is_this_host`` has refused
    another node's name before the listing."""
    if own_pod:
        if not any(f"{p.namespace}/{p.name}" == own_pod for p in pods.values()):
            raise ConfigError(
                f"the pods the API lists on node {node_name!r} do not include this janitor's own "
                f"pod {own_pod}: --node-name is not the node it runs on (the chart passes "
                "$(NODE_NAME) from spec.nodeName); nothing deleted"
            )
    elif not pods:
        raise ConfigError(
            f"the API lists no pod on node {node_name!r}: is --node-name right (kubectl get node "
            f"{node_name})? Every dir of a pod would have counted as gone; nothing deleted"
        )


def names_host(names: list[str], host: str) -> bool:
    """Whether one of ``names`` is ``host``, case-insensitively, a short name matching the
    first label of a dotted one (``gpu-7`` is ``gpu-7.cluster.local``; ``gpu-7.a`` is not
    ``gpu-7.b``). Never for ``localhost``: every host is that, so it says nothing."""
    host = host.lower().rstrip(".")
    short_host = host.split(".")[0]
    if short_host == "localhost":
        return False
    for name in (name.lower().rstrip(".") for name in names):
        if name in (host, short_host) or name.split(".")[0] == host:
            return True
    return False


def is_local_address(address: str) -> bool:
    """Whether ``address`` is assigned to this host. A connected UDP socket sends nothing,
    and the kernel gives it the destination itself as its source address only when that
    address is local. (A bind test passes any address where ``ip_nonlocal_bind`` is on, as
    on hosts that move a virtual IP, and passes 0.0.0.0 everywhere.)"""
    try:
        ip = ipaddress.ip_address(address)
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return ipaddress.ip_address(s.getsockname()[0]) == ip
    except (ValueError, OSError):  # not an address, no route to it (fe80:: without a scope): not here
        return False


def check_node_is_this_host(api: k8s.CoreV1Api, node_name: str) -> None:
    """Outside a pod, ``check_listing`` cannot tell another real node's listing from this
    one's (it is not empty), and with it every dir of a pod here would count as gone. So
    the Node ``node_name`` must be this host: its name or a Hostname address is this
    host's name, or an InternalIP/ExternalIP is assigned here. ConfigError if not;
    ApiUnavailable or NoApiAccess (needs get on nodes) if the Node cannot be read."""
    with api_errors(
        f"reading node {node_name!r}",
        "outside a pod the janitor checks that --node-name is this "
        "host, which needs get on nodes (or run the janitor in its chart, where its own pod in the "
        "listing is the check)",
    ):
        try:
            node = api.read_node(node_name, _request_timeout=REQUEST_TIMEOUT)
        except k8s.ApiException as e:
            if e.status != 404:
                raise
            node = None
    if node is None:
        raise ConfigError(
            f"the API has no node {node_name!r}: is --node-name right (kubectl get nodes)? Nothing deleted"
        )
    addresses = [(a.type, a.address) for a in (node.status.addresses if node.status else None) or []]
    names = [node_name] + [address for kind, address in addresses if kind == "Hostname"]
    hostname = socket.gethostname()
    ips = [address for kind, address in addresses if kind in ("InternalIP", "ExternalIP")]
    # The FQDN last: it may ask DNS.
    if names_host(names, hostname) or any(is_local_address(ip) for ip in ips) or names_host(names, socket.getfqdn()):
        return
    shown = ", ".join(f"{kind} {address}" for kind, address in addresses) or "no addresses"
    raise ConfigError(
        f"--node-name {node_name!r} is not this host {hostname!r}: node {node_name!r} has "
        f"{shown}, none of them this host's names or addresses, and every dir of a pod here would "
        "have counted as gone; nothing deleted. Pass this node's name, or run the janitor in its "
        "chart (there its own pod in the listing is the check)"
    )
