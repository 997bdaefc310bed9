"""``greenroom reclaim ROOT --kubernetes``: the janitor that knows which pods still exist.

The lock rule (``greenroom.dirs.reclaim``) only knows that no process holds a dir. On a
Kubernetes node we know more, through the pods bound to this node (field selector
``spec.nodeName``, the node name from the downward API):

- a dir whose owner record names a pod UID (``pod_uid``, written by ``RankDir`` from
  ``$GREENROOM_POD_UID``, which the chart sets from ``metadata.uid``) that no longer
  exists is stale at once, without waiting for ``--min-age``;
- a dir of a pod that still exists and has not finished is never touched, even with its
  lock free: the pod is between container restarts and will come back to its files;
- a dir without a pod UID, or of a pod that has finished (Succeeded/Failed, it cannot
  restart), is left to the lock rule and ``--min-age``.
- a dir whose owner record was written after the listing is kept for that pass: its pod
  may have started since, and the listing cannot say.

The per-pod dirs themselves (``<root>/<pod uid>/``, made by the chart's init container)
go too once they are empty and their pod is gone or finished: a pod that never wrote a
rank dir (cpu target, an early failure) or whose ranks cleaned up after themselves would
otherwise leave one empty dir per pod on the node forever. Only trees greenroom made
(each dir holding its marker, ``greenroom.dirs.rankdir`` Note [made parents]): a dir named
like a pod UID that the init container did not make (the kubelet's, with the init
container turned off; one of an older chart; a user's) stays.

A ``--node-name`` that is not this node would make every pod here look gone, so it is
refused before anything is deleted: in a pod the listing must hold the janitor's own pod,
outside one the Node must be this host, by name or address.

Every reclaim becomes a Kubernetes Event on the Node (reason ``StaleOffloadReclaimed``,
bytes freed, the pod and job it belonged to) and moves Prometheus counters served on
``--metrics-port``. Without the pod listing a restarting pod's dir cannot be told from a
dead one's, so a failed listing deletes nothing: an unreachable API, a 5xx or 429, and a
401/403 (RBAC not, or no longer, granted) skip that pass, count an ``api`` error and are
retried with exponential backoff, so the janitor picks up again once the API or its
ClusterRole is back. The lock rule decides alone only where the operator gave a
``--min-age`` above 0 (longer than a container restart): then with no credentials at all,
and for the passes that get a 401/403. Without one, no credentials is a one-line error.

Imports no torch: the janitor image runs only this.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from greenroom.dirs.rankdir import MADE_NAME, OWNER_NAME, remove_made_dir
from greenroom.dirs.reclaim import Decision, ReclaimReport, check_interval, check_seconds, print_report, reclaim
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.log import get_logger

EVENT_REASON = "StaleOffloadReclaimed"
COMPONENT = "greenroom-janitor"
# Events about cluster-scoped objects (a Node) live in "default", as the kubelet's do.
EVENT_NAMESPACE = "default"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
MAX_BACKOFF_SECONDS = 300.0
REQUEST_TIMEOUT = (5, 30)  # connect, read: a hung API server must not hang the janitor
log = get_logger(__name__)


@dataclass(kw_only=True, slots=True)
class JanitorConfig:
    """What one janitor process does."""

    root: str
    """The node's offload root (the chart's hostPath, mounted into the janitor)."""
    node_name: str
    """This node's name (``--node-name``, from the downward API ``spec.nodeName``)."""
    pod: str = ""
    """This janitor's own pod, ``namespace/name`` (``$POD_NAMESPACE``/``$POD_NAME``, which the
    chart sets from the downward API), that every listing of its node must hold; empty
    outside a pod, where the Node must be this host instead (``check_node_is_this_host``)."""
    interval: float | None = None
    """Seconds between passes; None runs one pass and exits."""
    metrics_port: int = 0
    """Port of the Prometheus text endpoint; 0 serves none."""
    metrics_address: str = "0.0.0.0"
    """Address the metrics endpoint binds (loopback in tests)."""
    min_age: float = 0.0
    """``--min-age`` for dirs the pod rule leaves to the lock rule. Above 0 it also lets the
    lock rule decide alone when there is no listing for want of access (see the module doc)."""
    dry_run: bool = False
    """Decide and report, remove nothing, emit no Events."""
    as_json: bool = False
    """Print each pass's report as one JSON object."""


@dataclass(slots=True)
class PodInfo:
    name: str
    namespace: str
    phase: str
    job: str = ""


class ApiUnavailable(Exception):
    """The pod listing failed in a way that may pass (unreachable, 5xx, 429)."""


class NoApiAccess(Exception):
    """No credentials, or the API refuses this identity (401/403)."""


# Said wherever the janitor deletes nothing for want of API access.
LOCK_RULE_HINT = (
    "pass --min-age SECONDS, longer than any container restart, to let the lock rule decide alone meanwhile"
)


class Metrics:
    """The janitor's Prometheus counters, in a registry of their own."""

    def __init__(self, root: str) -> None:
        self.registry = CollectorRegistry()
        self.dirs = Counter("greenroom_reclaim_dirs", "Per-rank dirs reclaimed", registry=self.registry)
        self.bytes = Counter(
            "greenroom_reclaim_bytes", "Bytes freed by reclaiming per-rank dirs", registry=self.registry
        )
        self.errors = Counter(
            "greenroom_reclaim_errors", "Errors, by where they happened", ["kind"], registry=self.registry
        )
        for kind in ("reclaim", "api", "event"):
            self.errors.labels(kind)  # exported at 0 from the start, so rate() works
        self.passes = Counter("greenroom_reclaim_passes", "Reclaim passes completed", registry=self.registry)
        self.free = Gauge(
            "greenroom_reclaim_root_free_bytes", "Free bytes on the offload root's filesystem", registry=self.registry
        )
        self.free.set_function(lambda: fs.free_bytes(root))

    def record(self, report: ReclaimReport) -> None:
        if report.dry_run:
            return
        self.dirs.inc(len(report.reclaimed))
        self.bytes.inc(report.bytes_freed)
        self.errors.labels("reclaim").inc(len(report.errors))
        self.passes.inc()


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


_POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


MTIME_SLACK_S = 1.0


def remove_empty_pod_dirs(root: str, pods: dict[str, PodInfo], *, listed_at: float, dry_run: bool) -> list[str]:
    """Remove ``<root>/<pod uid>/`` trees of dirs greenroom made that hold nothing but their
    markers, of pods that are not on the node any more (or finished). Only dirs already
    there when the pod listing was taken (``listed_at``): a pod started since is not in it,
    and its init container may have just made its dir. ``rmdir`` only, so a file written
    meanwhile keeps its dir."""
    removed = []
    # A ROOT given as a symlink: the dev of the dir it names, as ``reclaim`` resolves it (the
    # link's own, on another filesystem, would match no pod dir, and none would ever go).
    root = os.path.realpath(root)
    root_dev = os.lstat(root).st_dev
    for entry in os.scandir(root):
        pod = pods.get(entry.name)
        if not _POD_UID.match(entry.name) or (pod is not None and pod.phase not in TERMINAL_PHASES):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            # A second of slack: file times come from the kernel's coarse clock, which lags
            # time.time() by up to a tick, so a dir made just after the listing can carry
            # a time just before it.
            if (
                not entry.is_dir(follow_symlinks=False)
                or st.st_dev != root_dev
                or st.st_mtime >= listed_at - MTIME_SLACK_S
            ):
                continue
            tree = list(os.walk(entry.path, topdown=False))
        except OSError:
            continue
        if any(files != [MADE_NAME] for _, _, files in tree):
            continue  # a file of its own, or a dir greenroom did not make (no marker)
        # Deepest first (a bottom-up walk); something that appeared meanwhile, or a dir
        # gone, stops it and leaves the rest.
        if not dry_run and not all(remove_made_dir(path) for path, _, _ in tree):
            continue
        removed.append(entry.path)
    return removed


@dataclass
class PodRule:
    """The owner policy for ``greenroom.dirs.reclaim``: decides by the pod named in the record."""

    pods: dict[str, PodInfo]
    listed_at: float
    """When the pod listing was asked for (``time.time()``)."""
    # The pods of this listing and the last one (``Janitor.seen``), so an Event can name a
    # pod just gone.
    seen: dict[str, PodInfo] = field(default_factory=dict)

    def __call__(self, path: str, owner: dict) -> str | None:
        # A record written after the listing may be a pod started since, which the listing
        # does not have: its rank, dead at once or between restarts, would pass for a gone
        # pod's. The next pass's listing has that pod.
        try:
            if (
                os.stat(os.path.join(path, OWNER_NAME), follow_symlinks=False).st_mtime
                >= self.listed_at - MTIME_SLACK_S
            ):
                return "keep"
        except FileNotFoundError:
            return "keep"  # rewritten or removed meanwhile: decided by the next pass
        uid = owner.get("pod_uid")
        if not uid:
            # The chart mounts each pod's dir at <root>/<pod uid>/ (subPathExpr): a record
            # written without $GREENROOM_POD_UID still sits under its live pod's UID.
            if any(part in self.pods and self.pods[part].phase not in TERMINAL_PHASES for part in path.split(os.sep)):
                return "keep"
            return None
        pod = self.pods.get(uid)
        if pod is None:
            return "stale"
        return None if pod.phase in TERMINAL_PHASES else "keep"

    def describe(self, owner: dict) -> str:
        uid = owner.get("pod_uid")
        pod = self.seen.get(uid) if uid else None
        who = f"pod {pod.namespace}/{pod.name} (uid {uid})" if pod else (f"pod uid {uid}" if uid else "no pod")
        return f"{who}, job {owner.get('job', 'unknown')}"


def _event(node_name: str, decision: Decision, rule: PodRule | None) -> k8s.CoreV1Event:
    now = datetime.datetime.now(datetime.timezone.utc)
    belonged = rule.describe(decision.owner) if rule else f"job {decision.owner.get('job', 'unknown')}"
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(
            name=f"{node_name}.greenroom-{uuid.uuid4().hex[:16]}",
            namespace=EVENT_NAMESPACE,
            annotations={
                "greenroom.dev/bytes-freed": str(decision.bytes),
                "greenroom.dev/pod-uid": str(decision.owner.get("pod_uid", "")),
                "greenroom.dev/job": str(decision.owner.get("job", "")),
            },
        ),
        involved_object=k8s.V1ObjectReference(api_version="v1", kind="Node", name=node_name),
        reason=EVENT_REASON,
        type="Normal",
        count=1,
        first_timestamp=now,
        last_timestamp=now,
        message=f"reclaimed {decision.path}: {decision.bytes} bytes freed, {belonged}",
        source=k8s.V1EventSource(component=COMPONENT, host=node_name),
        reporting_component=COMPONENT,
        reporting_instance=node_name,
    )


class Janitor:
    """One node's janitor: passes of reclaim with the pod rule, Events and metrics."""

    def __init__(self, config: JanitorConfig, *, out=sys.stdout) -> None:
        self.config = config
        self.metrics = Metrics(config.root)
        self.out = out
        self.api: k8s.CoreV1Api | None = None
        self.lock_rule_only = False
        # Outside a pod: whether check_node_is_this_host has passed. Once is enough, as a
        # node keeps its name; until then (the API down) every pass asks again.
        self.node_is_this_host = False
        self.failures = 0
        self.seen: dict[str, PodInfo] = {}
        self.last_listing: dict[str, PodInfo] = {}
        self.stop = threading.Event()

    def connect(self) -> None:
        try:
            self.api = load_api()
        except NoApiAccess as e:
            # With an age of 0 the lock rule alone would remove the files of every pod
            # between container restarts: missing credentials are no reason to delete more.
            if not self.config.min_age:
                raise ConfigError(
                    f"no Kubernetes API access: {e}; without its node's pod listing the janitor "
                    f"cannot tell a restarting pod from a gone one and deletes nothing: "
                    f"{LOCK_RULE_HINT}"
                ) from None
            self.lock_rule_only = True
            log.warning(
                f"no Kubernetes API access: {e}; the lock rule alone, --min-age {self.config.min_age:g}s on every dir"
            )

    def one_pass(self) -> ReclaimReport:
        """Reclaim once. ApiUnavailable or NoApiAccess when the pod listing failed and
        nothing was deleted."""
        rule = None
        if not self.lock_rule_only:
            try:
                # In a pod, check_listing's own-pod check is enough and needs no access to nodes.
                if not self.config.pod and not self.node_is_this_host:
                    check_node_is_this_host(self.api, self.config.node_name)
                    self.node_is_this_host = True
                listed_at = time.time()
                pods = list_node_pods(self.api, self.config.node_name)
            except (ApiUnavailable, NoApiAccess) as e:
                self.metrics.errors.labels("api").inc()
                # A 401/403 is tried again each pass (RBAC gets fixed); meanwhile it only
                # lets the lock rule decide where the operator gave it an age.
                if isinstance(e, ApiUnavailable) or not self.config.min_age:
                    raise
                log.warning(f"{e}; this pass uses the lock rule alone, --min-age {self.config.min_age:g}s on every dir")
            else:
                check_listing(pods, self.config.node_name, self.config.pod)
                # Names for the Events: this listing's pods and the last one's. A gone pod's
                # dirs go in the first pass after it left the listing, named from the one
                # before; one gone longer is named by its UID. (Keeping every pod ever
                # seen grew with each pod the node ran, for the life of the process.)
                self.seen = {**self.last_listing, **pods}
                self.last_listing = pods
                rule = PodRule(pods, listed_at, self.seen)
        # A node where nothing ran yet has no root: an empty pass, not a crash loop.
        report = reclaim(
            self.config.root, dry_run=self.config.dry_run, min_age=self.config.min_age, policy=rule, missing_ok=True
        )
        if rule is not None and os.path.isdir(self.config.root):
            for path in remove_empty_pod_dirs(
                self.config.root, rule.pods, listed_at=listed_at, dry_run=self.config.dry_run
            ):
                log.info(f"{'would remove' if self.config.dry_run else 'removed'} the empty dir of a gone pod: {path}")
        self.metrics.record(report)
        print_report(report, as_json=self.config.as_json, out=self.out)
        self.out.flush()
        if self.api is not None and not self.config.dry_run:
            for decision in report.reclaimed:
                self._emit(decision, rule)
        return report

    def _emit(self, decision: Decision, rule: PodRule | None) -> None:
        try:
            self.api.create_namespaced_event(
                EVENT_NAMESPACE, _event(self.config.node_name, decision, rule), _request_timeout=REQUEST_TIMEOUT
            )
        except (k8s.ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            # The files are gone either way; a lost Event is counted, never fatal.
            self.metrics.errors.labels("event").inc()
            log.warning(
                f"could not post the {EVENT_REASON} event for {decision.path}: "
                f"{getattr(e, 'status', '')} {getattr(e, 'reason', e)}"
            )

    def next_delay(self) -> float:
        interval = self.config.interval or 0.0
        if self.failures == 0:
            return interval
        # The exponent is capped: 2.0 ** 1024 overflows a float (after days without an API).
        return min(interval * 2.0 ** min(self.failures, 32), max(interval, MAX_BACKOFF_SECONDS))

    def serve(self) -> int:
        """The periodic loop; returns when ``stop`` is set (SIGTERM/SIGINT)."""
        while not self.stop.is_set():
            try:
                self.one_pass()
                self.failures = 0
            except (ApiUnavailable, NoApiAccess) as e:
                self.failures += 1
                delay = self.next_delay()
                log.warning(
                    f"{e}; skipping this pass (a pod between restarts cannot be "
                    f"told from a gone one), retrying in {delay:.1f}s"
                )
            self.stop.wait(self.next_delay())
        return 0


def check_root(root: str) -> None:
    """One line per problem with the node root; ValueError (exit 2)."""
    no_permission = (
        f"reclaim ROOT {root}: no permission to read and delete in it (uid {os.getuid()}); "
        "run the janitor as the trainers' uid or as root"
    )
    try:
        os.stat(root)
    except PermissionError:
        raise ConfigError(no_permission) from None
    except FileNotFoundError:
        raise ConfigError(
            f"reclaim ROOT {root} does not exist: mount the node's offload root there (the chart's hostPath)"
        ) from None
    if not os.path.isdir(root):
        raise ConfigError(f"reclaim ROOT {root} is not a directory: pass the node's offload root")
    if fs.is_memory_backed(root):
        raise ConfigError(
            f"reclaim ROOT {root} is on {fs.mount_of(root).fstype}: the node root must be on "
            "node-local disk (NVMe); point the janitor at the same hostPath the trainers use"
        )
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(no_permission)


def run_janitor(config: JanitorConfig) -> int:
    """``greenroom reclaim ROOT --kubernetes``: one pass, or a loop with ``interval``."""
    if not config.node_name:
        raise ConfigError(
            "--node-name is required with --kubernetes (the chart passes $(NODE_NAME) from "
            "the downward API spec.nodeName)"
        )
    check_seconds("--min-age", config.min_age)
    if config.interval is not None:
        check_interval(config.interval)
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be 0 (off) or a TCP port, got {config.metrics_port}")
    check_root(config.root)
    janitor = Janitor(config)
    janitor.connect()
    if config.interval is None:
        try:
            report = janitor.one_pass()
        except ApiUnavailable as e:
            raise ConfigError(
                f"{e} (is the API server reachable from this node? check the kubeconfig or "
                "the in-cluster service account)"
            ) from None
        except NoApiAccess as e:
            raise ConfigError(f"{e}; nothing deleted ({LOCK_RULE_HINT})") from None
        return 1 if report.errors else 0
    if config.metrics_port:
        try:
            start_http_server(config.metrics_port, addr=config.metrics_address, registry=janitor.metrics.registry)
        except OSError as e:
            raise ConfigError(f"--metrics-port {config.metrics_port}: cannot listen ({e.strerror})") from None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: janitor.stop.set())
    return janitor.serve()
