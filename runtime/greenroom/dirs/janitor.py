"""``greenroom reclaim ROOT --kubernetes``: the janitor that knows which pods still exist.

Each pass lists the pods bound to this node (``k8s_api``: field selector
``spec.nodeName``, the node name from the downward API, checked to be this node's) and
runs ``greenroom.dirs.reclaim`` with the pod rule (``pod_rule``): a gone pod's dirs are
stale at once, a live pod's are kept even with their locks free, the rest are left to the
lock rule and ``--min-age``; then the empty dirs of gone pods go.

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

import datetime
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import urllib3
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from greenroom.dirs.k8s_api import (
    REQUEST_TIMEOUT,
    ApiUnavailable,
    NoApiAccess,
    check_listing,
    check_node_is_this_host,
    list_node_pods,
    load_api,
)
from greenroom.dirs.pod_rule import PodInfo, PodRule, remove_empty_pod_dirs
from greenroom.dirs.reclaim import Decision, ReclaimReport, check_interval, check_seconds, print_report, reclaim
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.log import get_logger

EVENT_REASON = "StaleOffloadReclaimed"
COMPONENT = "greenroom-janitor"
# Events about cluster-scoped objects (a Node) live in "default", as the kubelet's do.
EVENT_NAMESPACE = "default"
MAX_BACKOFF_SECONDS = 300.0
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
