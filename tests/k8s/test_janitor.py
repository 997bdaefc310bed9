"""``greenroom reclaim ROOT --kubernetes``: the pod rule, Events, metrics, fallback, bad input.

No Kubernetes API server can run here, so the API is a small in-process HTTP server
(``http.server`` on 127.0.0.1, in a thread) that speaks the three paths the janitor uses:
``GET /api/v1/pods?fieldSelector=spec.nodeName=...``, ``GET /api/v1/nodes/NAME`` (outside a
pod) and ``POST /api/v1/namespaces/default/events``. The janitor talks to it with the REAL
``kubernetes`` Python client, configured through a kubeconfig, over loopback. That fake
server is the only stand-in: the dirs are real, their locks are held by real processes
(``tests/rank_holder.py`` holding a ``RankDir``), the metrics are scraped over HTTP.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# The janitor talks through the kubernetes client; where it is not installed (the GPU
# machine) the module skips instead of failing to import.
pytest.importorskip("kubernetes", reason="the kubernetes client is not installed (pip install kubernetes)")

from greenroom.dirs import janitor as k8s_janitor
from greenroom.dirs import names  # noqa: E402
from greenroom.dirs.janitor import Janitor, JanitorConfig  # noqa: E402
from tests.cli_support import REPO, greenroom, one_line_error

HOLDER = os.path.join(REPO, "tests", "rank_holder.py")
NODE = "gpu-node-7"
# The janitor's own pod, on NODE in every listing of the fake API (the chart's POD_NAMESPACE/POD_NAME).
JANITOR_NAMESPACE, JANITOR_POD = "greenroom-system", "greenroom-janitor-x7k2p"
# Another node's address: TEST-NET-3, assigned to no host (TEST-NET-1 is this sandbox's own network).
OTHER_NODE_IP = "203.0.113.77"


class FakeApi:
    """Pods bound to nodes, the Nodes, the Events posted, and a number of failures to answer first."""

    def __init__(self) -> None:
        self.pods: list[dict] = []
        self.nodes: dict[str, list[tuple[str, str]]] = {}  # name: its status.addresses, (type, address)
        self.nodes_read: list[str] = []
        self.node_status = 200  # 403: reading a Node is forbidden
        self.events: list[dict] = []
        self.selectors: list[str] = []
        self.fail_next = 0
        self.fail_status = 500
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_pod(self, uid: str, name: str, phase: str = "Running", node: str = NODE, namespace: str = "train") -> None:
        self.pods.append(
            {
                "metadata": {
                    "uid": uid,
                    "name": name,
                    "namespace": namespace,
                    "labels": {"batch.kubernetes.io/job-name": "grpo"},
                },
                "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "greenroom"}]},
                "status": {"phase": phase},
            }
        )

    def add_node(self, name: str, addresses: list[tuple[str, str]]) -> None:
        self.nodes[name] = addresses

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                if url.path.startswith("/api/v1/nodes/"):
                    return self._node(url.path.removeprefix("/api/v1/nodes/"))
                if url.path != "/api/v1/pods":
                    return self._send(404, {"kind": "Status", "code": 404})
                if api.fail_next:
                    api.fail_next -= 1
                    return self._send(api.fail_status, {"kind": "Status", "code": api.fail_status})
                selector = urllib.parse.parse_qs(url.query).get("fieldSelector", [""])[0]
                api.selectors.append(selector)
                node = selector.removeprefix("spec.nodeName=")
                items = [p for p in api.pods if p["spec"]["nodeName"] == node]
                self._send(
                    200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}
                )

            def _node(self, name: str) -> None:
                api.nodes_read.append(name)
                if api.node_status != 200:
                    return self._send(api.node_status, {"kind": "Status", "code": api.node_status})
                if name not in api.nodes:
                    return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                self._send(
                    200,
                    {
                        "kind": "Node",
                        "apiVersion": "v1",
                        "metadata": {"name": name},
                        "status": {
                            "addresses": [{"type": kind, "address": address} for kind, address in api.nodes[name]]
                        },
                    },
                )

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/api/v1/namespaces/default/events":
                    return self._send(404, {"kind": "Status", "code": 404})
                api.events.append(body)
                self._send(201, body)

        return Handler

    def kubeconfig(self, directory: str) -> str:
        path = os.path.join(directory, "kubeconfig")
        with open(path, "w") as f:
            json.dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "janitor", "user": {"token": "t"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "janitor"}}],
                },
                f,
            )
        return path

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api(tmp_path, monkeypatch):
    fake = FakeApi()
    fake.add_pod(str(uuid.uuid4()), JANITOR_POD, namespace=JANITOR_NAMESPACE)
    # NODE is this host (its InternalIP is loopback), for the tests that run the janitor outside a pod.
    fake.add_node(NODE, [("InternalIP", "127.0.0.1")])
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", fake.kubeconfig(str(tmp_path)))
    monkeypatch.setenv("POD_NAMESPACE", JANITOR_NAMESPACE)
    monkeypatch.setenv("POD_NAME", JANITOR_POD)
    yield fake
    fake.close()


def made_dirs(root: str, *parts: str) -> str:
    """Dirs below ``root`` as greenroom makes them (the chart's init container the ``<pod
    uid>`` dir, ``RankDir`` the ``<job>/<role>`` ones), each with its marker (``tree``
    Note [made parents])."""
    path = root
    for part in parts:
        path = os.path.join(path, part)
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, names.MADE_NAME), "w").close()
    return path


def hold(root: str, pod_uid: str | None, job: str):
    """A real process holding a rank dir under the chart's layout ``<root>/<pod uid>/``
    (that dir made as the init container makes it)."""
    env = dict(os.environ)
    env.pop("GREENROOM_POD_UID", None)
    if pod_uid:
        env["GREENROOM_POD_UID"] = pod_uid
        made_dirs(root, pod_uid)
    base = os.path.join(root, pod_uid or "no-pod")
    proc = subprocess.Popen(
        [sys.executable, HOLDER, base, job, "actor", "0"], stdout=subprocess.PIPE, text=True, env=env
    )
    path = proc.stdout.readline().strip()
    assert path, "holder did not start"
    return proc, path


def dead(root: str, pod_uid: str | None, job: str, written_ago: float = 10) -> str:
    """A rank dir whose owner was SIGKILLed: no cleanup ran, the lock is free. Its owner
    record dates from ``written_ago`` seconds back: the janitor leaves a record newer than
    its pod listing to the next pass."""
    proc, path = hold(root, pod_uid, job)
    proc.kill()
    proc.wait()
    if written_ago:
        then = time.time() - written_ago
        os.utime(os.path.join(path, "owner.json"), (then, then))
    return path


def decisions(report) -> dict:
    return {d.path: (d.action, d.reason) for d in report.decisions}


def test_pod_rule_keeps_existing_pods_and_reclaims_gone_ones_at_once(api, disk_dir):
    api.add_pod("uid-restarting", "grpo-0")  # still exists, between container restarts
    api.add_pod("uid-live", "grpo-1")
    api.add_pod("uid-done", "grpo-2", phase="Succeeded")
    api.add_pod("uid-elsewhere", "grpo-3", node="other-node")  # not this node's pod
    restarting = dead(disk_dir, "uid-restarting", "grpo")
    gone = dead(disk_dir, "uid-gone", "grpo")
    done = dead(disk_dir, "uid-done", "grpo")
    elsewhere = dead(disk_dir, "uid-elsewhere", "grpo")
    no_pod = dead(disk_dir, None, "slurm-1")
    live_proc, live = hold(disk_dir, "uid-live", "grpo")
    gone_locked_proc, gone_locked = hold(disk_dir, "uid-gone-but-running", "grpo")
    try:
        # --min-age an hour: only the pod rule may reclaim young dirs.
        janitor = Janitor(JanitorConfig(root=disk_dir, node_name=NODE, min_age=3600), out=open(os.devnull, "w"))
        janitor.connect()
        report = janitor.one_pass()
        got = decisions(report)
        assert api.selectors == [f"spec.nodeName={NODE}"]
        assert got[restarting] == ("kept", "kept by policy (its owner still exists)")
        assert got[live] == ("kept", "locked by a live process")
        assert got[gone_locked] == ("kept", "locked by a live process")
        for young in (done, no_pod):  # left to the lock rule and --min-age
            assert got[young][0] == "kept" and "younger than --min-age" in got[young][1]
        assert got[gone] == ("reclaimed", "owner gone") and got[elsewhere] == ("reclaimed", "owner gone")
        assert not os.path.exists(gone) and not os.path.exists(elsewhere)
        for kept in (restarting, live, gone_locked, done, no_pod):
            assert os.path.exists(os.path.join(kept, "offload", "state.bin")), kept
        freed = {d.path: d.bytes for d in report.reclaimed}
        assert all(b >= 65536 for b in freed.values())

        assert len(api.events) == 2
        by_uid = {e["metadata"]["annotations"]["greenroom.dev/pod-uid"]: e for e in api.events}
        event = by_uid["uid-gone"]
        assert event["reason"] == "StaleOffloadReclaimed" and event["type"] == "Normal"
        assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE}
        assert event["metadata"]["annotations"]["greenroom.dev/bytes-freed"] == str(freed[gone])
        assert event["metadata"]["annotations"]["greenroom.dev/job"] == "grpo"
        assert f"{freed[gone]} bytes freed" in event["message"] and "uid-gone" in event["message"]
        # A pod seen in an earlier listing is named in the Event once it is gone.
        api.pods = [p for p in api.pods if p["metadata"]["uid"] != "uid-restarting"]
        report = janitor.one_pass()
        assert [d.path for d in report.reclaimed] == [restarting]
        assert "pod train/grpo-0 (uid uid-restarting), job grpo" in api.events[-1]["message"]

        values = metric_values(janitor.metrics.registry)
        assert values["greenroom_reclaim_dirs_total"] == 3
        assert values["greenroom_reclaim_bytes_total"] == sum(freed.values()) + report.bytes_freed
        assert values['greenroom_reclaim_errors_total{kind="reclaim"}'] == 0
    finally:
        for proc in (live_proc, gone_locked_proc):
            proc.terminate()
            proc.wait()


def metric_values(registry) -> dict:
    from prometheus_client import generate_latest

    return parse_metrics(generate_latest(registry).decode())


def parse_metrics(text: str) -> dict:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse_metrics(response.read().decode())


def wait_for(condition, what: str):
    """Poll ``condition`` until it is truthy; a generous bound only catches a hung janitor."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            value = condition()
        except OSError:  # the metrics endpoint is not up yet
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"janitor never got to: {what}")


def start_cli(root: str, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "greenroom.cli.main",
            "reclaim",
            root,
            "--kubernetes",
            "--node-name",
            NODE,
            "--interval",
            "0.05",
            "--metrics-port",
            str(port),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out, err


def test_loop_survives_api_errors_with_backoff_then_reclaims_and_serves_metrics(api, disk_dir):
    api.fail_next = 3  # the API server answers 500 three times, then recovers
    gone = dead(disk_dir, "uid-gone", "grpo")
    port = free_port()
    proc = start_cli(disk_dir, port)
    try:
        wait_for(lambda: api.events, "an Event after the API recovered")
        values = wait_for(
            lambda: (v := scrape(port)).get("greenroom_reclaim_dirs_total") and v, "the reclaimed dir in the metrics"
        )
    finally:
        out, err = stop(proc)
    assert not os.path.exists(gone)
    assert values["greenroom_reclaim_dirs_total"] == 1
    assert values["greenroom_reclaim_bytes_total"] >= 65536
    assert values['greenroom_reclaim_errors_total{kind="api"}'] == 3
    assert values["greenroom_reclaim_root_free_bytes"] > 0
    retries = [line for line in err.splitlines() if "skipping this pass" in line]
    assert len(retries) == 3 and "HTTP 500" in retries[0]
    # Exponential backoff: each retry waits twice as long as the one before.
    assert [line.rsplit("retrying in ", 1)[1] for line in retries] == ["0.1s", "0.2s", "0.4s"]
    assert "Traceback" not in err
    assert f"reclaimed: {gone}" in out


def test_without_api_access_the_lock_rule_decides_alone_only_with_a_min_age(disk_dir, tmp_path):
    """No credentials at all: the lock rule, with an age of 0, would remove the files of a
    pod between container restarts; a warning saying so is not enough."""
    env = {"KUBECONFIG": str(tmp_path / "absent"), "KUBERNETES_SERVICE_HOST": ""}
    gone = dead(disk_dir, "uid-gone", "grpo")  # its owner record is 10 s old
    line = one_line_error(greenroom("reclaim", disk_dir, "--kubernetes", "--node-name", NODE, env=env))
    assert "no Kubernetes API access" in line and "deletes nothing" in line and "--min-age SECONDS" in line
    assert os.path.exists(gone)
    port = free_port()
    proc = start_cli(disk_dir, port, "--min-age", "5", env=env)
    try:
        wait_for(lambda: scrape(port).get("greenroom_reclaim_passes_total", 0) >= 3, "three passes")
    finally:
        out, err = stop(proc)
    assert not os.path.exists(gone)  # the lock rule reclaims a dead owner's dir older than --min-age
    notes = [line for line in err.splitlines() if "no Kubernetes API access" in line]
    assert len(notes) == 1 and "the lock rule alone, --min-age 5s on every dir" in notes[0]


def test_a_forbidden_listing_deletes_nothing_without_a_min_age(api, disk_dir):
    """A 401/403 switched the janitor to the lock rule with an age of 0: the dir of a pod
    between container restarts (lock free) went, and its <pod uid> dir with it."""
    api.fail_next, api.fail_status = 10**6, 403
    api.add_pod("uid-restarting", "grpo-0")
    restarting = dead(disk_dir, "uid-restarting", "grpo")
    line = one_line_error(greenroom("reclaim", disk_dir, "--kubernetes", "--node-name", NODE))
    assert "HTTP 403" in line and "ClusterRole" in line and "nothing deleted" in line and "--min-age" in line
    assert os.path.exists(os.path.join(restarting, "offload", "state.bin"))


def test_forbidden_listing_with_a_min_age_uses_the_lock_rule_for_that_pass(api, disk_dir):
    api.fail_next, api.fail_status = 10**6, 403
    young = dead(disk_dir, "uid-gone", "grpo")
    proc = greenroom(
        "reclaim",
        disk_dir,
        "--kubernetes",
        "--node-name",
        NODE,
        "--min-age",
        "3600",
        env={"KUBECONFIG": os.environ["KUBECONFIG"]},
        check_rc=0,
    )
    assert "HTTP 403" in proc.stderr and "ClusterRole" in proc.stderr and "lock rule alone" in proc.stderr
    assert os.path.exists(young)  # no pod listing: --min-age applies, nothing is reclaimed early
    assert api.events == []


def test_the_loop_waits_out_a_forbidden_listing_and_picks_up_when_rbac_is_fixed(api, disk_dir):
    """A 403 must not turn the pod rule off for the life of the process (with the chart's
    age of 0, that would remove a restarting pod's files)."""
    api.fail_next, api.fail_status = 3, 403  # the ClusterRole is granted after three tries
    api.add_pod("uid-restarting", "grpo-0")
    restarting = dead(disk_dir, "uid-restarting", "grpo")
    gone = dead(disk_dir, "uid-gone", "grpo")
    port = free_port()
    proc = start_cli(disk_dir, port)
    try:
        values = wait_for(lambda: (v := scrape(port)).get("greenroom_reclaim_passes_total", 0) >= 2 and v, "two passes")
    finally:
        out, err = stop(proc)
    assert os.path.exists(os.path.join(restarting, "offload", "state.bin"))
    assert not os.path.exists(gone)  # the pod rule again, once the listing is allowed
    assert [e["metadata"]["annotations"]["greenroom.dev/pod-uid"] for e in api.events] == ["uid-gone"]
    assert values['greenroom_reclaim_errors_total{kind="api"}'] == 3
    retries = [line for line in err.splitlines() if "skipping this pass" in line]
    assert len(retries) == 3 and all("HTTP 403" in line for line in retries)
    assert [line.rsplit("retrying in ", 1)[1] for line in retries] == ["0.1s", "0.2s", "0.4s"]


# Outside a pod, a misspelt name is no Node; another node's name: test_outside_a_pod_another_nodes_name_deletes_nothing.
@pytest.mark.parametrize("node, in_pod", [("gpu-node-77", True), ("other-node", True), ("gpu-node-77", False)])
def test_a_wrong_node_name_deletes_nothing(api, disk_dir, node, in_pod):
    """A misspelt --node-name lists no pod (another node's name, that node's): taken as is,
    every dir of a pod here would count as gone, the running ones' too once their lock is free."""
    api.add_pod("uid-restarting", "grpo-0")
    api.add_pod("uid-there", "grpo-9", node="other-node")
    restarting = dead(disk_dir, "uid-restarting", "grpo")
    env = {} if in_pod else {"POD_NAME": ""}
    line = one_line_error(greenroom("reclaim", disk_dir, "--kubernetes", "--node-name", node, env=env))
    assert f"node '{node}'" in line and "nothing deleted" in line.lower()
    assert (f"janitor's own pod {JANITOR_NAMESPACE}/{JANITOR_POD}" in line) == in_pod
    assert api.nodes_read == ([] if in_pod else [node])  # in a pod the janitor needs no access to nodes
    assert os.path.exists(os.path.join(restarting, "offload", "state.bin"))
    assert api.events == []


@pytest.mark.parametrize("interval", [None, "0.05"])
def test_outside_a_pod_another_nodes_name_deletes_nothing(api, disk_dir, interval):
    """Outside a pod, the listing of another real node is not empty, so it could pass for
    this node's: a pod here between container restarts (its lock free) would count as gone
    and its rank dir be removed. In loop mode too the janitor stops at once (the name will not
    get any better by waiting)."""
    api.add_pod("uid-restarting", "grpo-0")
    api.add_pod("uid-there", "grpo-9", node="other-node")
    api.add_node("other-node", [("InternalIP", OTHER_NODE_IP), ("Hostname", "other-node")])
    restarting = dead(disk_dir, "uid-restarting", "grpo")
    loop = ["--interval", interval] if interval else []
    proc = greenroom(
        "reclaim", disk_dir, "--kubernetes", "--node-name", "other-node", *loop, env={"POD_NAME": ""}, timeout=60
    )
    assert os.path.exists(os.path.join(restarting, "offload", "state.bin"))
    assert api.events == []
    line = one_line_error(proc)
    assert "--node-name 'other-node' is not this host" in line and "nothing deleted" in line
    assert f"InternalIP {OTHER_NODE_IP}, Hostname other-node" in line and repr(socket.gethostname()) in line
    assert "Pass this node's name, or run the janitor in its chart" in line


def this_host() -> str:
    hostname = socket.gethostname()
    if hostname.split(".")[0].lower() == "localhost":
        pytest.skip("this host is named localhost, which names every host")
    return hostname


@pytest.mark.parametrize("node_of_this_host", ["named after it", "its Hostname address", "its InternalIP"])
def test_outside_a_pod_this_hosts_node_reclaims_as_before(api, disk_dir, node_of_this_host):
    node, addresses = {
        "named after it": (lambda: (this_host(), [("InternalIP", OTHER_NODE_IP)])),
        # Compared case-insensitively, and the short name with a dotted one's first label.
        "its Hostname address": (lambda: ("worker-3", [("Hostname", this_host().upper() + ".cluster.local")])),
        "its InternalIP": (lambda: ("worker-4", [("InternalIP", OTHER_NODE_IP), ("ExternalIP", "127.0.0.1")])),
    }[node_of_this_host]()
    api.add_node(node, addresses)
    api.add_pod("uid-restarting", "grpo-0", node=node)
    restarting = dead(disk_dir, "uid-restarting", "grpo")
    gone = dead(disk_dir, "uid-gone", "grpo")
    proc = greenroom("reclaim", disk_dir, "--kubernetes", "--node-name", node, env={"POD_NAME": ""}, check_rc=0)
    assert f"reclaimed: {gone}" in proc.stdout and not os.path.exists(gone)
    assert os.path.exists(os.path.join(restarting, "offload", "state.bin"))
    assert api.nodes_read == [node]
    assert [e["involvedObject"]["name"] for e in api.events] == [node]


@pytest.mark.parametrize("node_status", [404, 403])
def test_outside_a_pod_a_node_that_cannot_be_read_deletes_nothing(api, disk_dir, node_status):
    gone = dead(disk_dir, "uid-gone", "grpo")
    node = NODE
    if node_status == 404:
        node = "gpu-node-8"  # no such node
    else:
        api.node_status = 403
    line = one_line_error(greenroom("reclaim", disk_dir, "--kubernetes", "--node-name", node, env={"POD_NAME": ""}))
    if node_status == 404:
        assert "the API has no node 'gpu-node-8'" in line and "kubectl get nodes" in line
    else:
        assert "HTTP 403" in line and "needs get on nodes" in line and "run the janitor in its chart" in line
    assert "nothing deleted" in line.lower()
    assert os.path.exists(gone) and api.selectors == [] and api.events == []


def test_names_and_addresses_of_this_host():
    from greenroom.dirs.k8s_api import is_local_address, names_host

    assert names_host(["gpu-7"], "GPU-7.cluster.local") and names_host(["gpu-7.cluster.local."], "gpu-7")
    assert not names_host(["gpu-7.a"], "gpu-7.b") and not names_host(["gpu-70"], "gpu-7")
    assert not names_host(["localhost"], "localhost.localdomain")  # every host's name
    assert is_local_address("127.0.0.1") and not is_local_address(OTHER_NODE_IP)
    for not_an_address_here in ("0.0.0.0", "127.0.0.2", "fe80::1", "gpu-7", ""):
        assert not is_local_address(not_an_address_here), not_an_address_here
    if socket.has_ipv6 and is_local_address("::1"):
        assert not is_local_address("2001:db8::77") and is_local_address("0:0::1")


def test_the_janitor_forgets_pods_gone_before_the_last_listing(api, disk_dir):
    """Janitor.seen kept every pod the node ever ran, for the life of the process. It holds
    this listing's pods and the last one's: enough to name a pod whose dir goes in the
    first pass after it left (test_pod_rule_keeps_existing_pods_and_reclaims_gone_ones_at_once)."""
    janitor = Janitor(JanitorConfig(root=disk_dir, node_name=NODE), out=open(os.devnull, "w"))
    janitor.connect()
    (own,) = api.pods
    for i in range(5):  # one short pod after another
        api.pods = [own]
        api.add_pod(f"uid-{i}", f"short-{i}")
        janitor.one_pass()
    assert sorted(janitor.seen) == sorted([own["metadata"]["uid"], "uid-3", "uid-4"])


def test_bad_input_is_one_line_and_exit_2(disk_dir, tmp_path):
    env = {"KUBECONFIG": str(tmp_path / "absent"), "KUBERNETES_SERVICE_HOST": "", "NODE_NAME": ""}
    a_file = os.path.join(disk_dir, "file")
    open(a_file, "w").close()
    line = one_line_error(greenroom("reclaim", a_file, "--kubernetes", "--node-name", NODE, env=env))
    assert "is not a directory" in line
    line = one_line_error(
        greenroom("reclaim", os.path.join(disk_dir, "nope"), "--kubernetes", "--node-name", NODE, env=env)
    )
    assert "does not exist" in line and "hostPath" in line
    line = one_line_error(greenroom("reclaim", disk_dir, "--kubernetes", env=env))
    assert "--node-name is required" in line
    line = one_line_error(greenroom("reclaim", disk_dir, "--interval", "5", env=env))
    assert "need --kubernetes" in line
    line = one_line_error(
        greenroom("reclaim", disk_dir, "--kubernetes", "--node-name", NODE, "--interval", "0", env=env)
    )
    assert "--interval must be more than 0" in line


def test_tmpfs_root_is_refused(tmp_path):
    from greenroom.io import fs

    shm = "/dev/shm"
    if not (os.path.isdir(shm) and fs.is_memory_backed(shm)):
        pytest.skip("no tmpfs at /dev/shm on this machine")
    root = os.path.join(shm, f"greenroom-janitor-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    try:
        line = one_line_error(
            greenroom(
                "reclaim", root, "--kubernetes", "--node-name", NODE, env={"KUBECONFIG": str(tmp_path / "absent")}
            )
        )
        assert "is on tmpfs" in line and "NVMe" in line
    finally:
        os.rmdir(root)


def test_root_without_permission_is_refused(disk_dir, tmp_path):
    """The CLI in a forked child that drops to uid nobody (root passes every permission check)."""
    from greenroom.cli.main import main

    locked = os.path.join(disk_dir, "locked")
    os.makedirs(locked, mode=0o700)  # owned by us, closed to everyone else
    if os.getuid() != 0:
        os.chmod(locked, 0o500)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        rc = 70
        try:
            os.dup2(write_end, 2)
            sys.stderr = os.fdopen(2, "w")  # pytest captures sys.stderr; the CLI writes there
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            os.environ["KUBECONFIG"] = str(tmp_path / "absent")
            rc = main(["reclaim", locked, "--kubernetes", "--node-name", NODE])
        finally:
            sys.stderr.flush()
            os._exit(rc)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        stderr = f.read()
    _, status = os.waitpid(pid, 0)
    line = one_line_error(subprocess.CompletedProcess([], os.waitstatus_to_exitcode(status), "", stderr))
    assert "no permission" in line and locked in line


def test_unreachable_api_is_one_line_in_a_single_pass(disk_dir, tmp_path):
    fake = FakeApi()
    config = fake.kubeconfig(str(tmp_path))
    fake.close()  # nothing listens on that port any more
    proc = greenroom(
        "reclaim",
        disk_dir,
        "--kubernetes",
        "--node-name",
        NODE,
        env={"KUBECONFIG": config, "KUBERNETES_SERVICE_HOST": ""},
    )
    line = one_line_error(proc)
    # Outside a pod (no POD_NAME here) the first call reads the Node.
    assert f"reading node '{NODE}' failed" in line and "reachable" in line


def test_an_unreadable_listing_skips_the_pass_and_counts_an_api_error(api, disk_dir):
    from greenroom.dirs.k8s_api import ApiUnavailable

    gone = dead(disk_dir, "uid-gone", "grpo")
    api.add_pod("uid-other", "broken")
    del api.pods[0]["spec"]["containers"]  # a reply the client's Pod model rejects
    janitor = Janitor(JanitorConfig(root=disk_dir, node_name=NODE), out=open(os.devnull, "w"))
    janitor.connect()
    with pytest.raises(ApiUnavailable, match="unreadable reply"):
        janitor.one_pass()
    assert os.path.exists(gone)  # nothing is decided without a listing
    assert metric_values(janitor.metrics.registry)['greenroom_reclaim_errors_total{kind="api"}'] == 1


def test_empty_dirs_of_gone_pods_are_removed_and_nothing_else(api, disk_dir, monkeypatch):
    """The init container makes <root>/<pod uid>/; a pod that never wrote a rank dir (or
    whose ranks cleaned up) leaves it empty. Gone or finished pods' empty trees go; a live
    pod's, one holding a file, one not named like a pod UID and one made after the pod
    listing (a pod started since: its init container may have just made it) stay."""
    gone, done, live, full, fresh = (str(uuid.uuid4()) for _ in range(5))
    root = os.path.join(disk_dir, "root")
    api.add_pod(live, "grpo-0")
    api.add_pod(done, "grpo-1", phase="Failed")
    for uid in (gone, done, live, full):
        made_dirs(root, uid, "job", "actor")
    with open(os.path.join(root, full, "job", "notes.txt"), "w") as f:
        f.write("not greenroom's to judge")
    os.makedirs(os.path.join(root, "not-a-pod-uid"))
    old = time.time() - 60
    for uid in (gone, done, live, full, "not-a-pod-uid"):
        os.utime(os.path.join(root, uid), (old, old))
    janitor = Janitor(JanitorConfig(root=root, node_name=NODE), out=open(os.devnull, "w"))
    janitor.connect()
    original = k8s_janitor.list_node_pods

    def listing_then_a_new_pod(api_, node):
        pods = original(api_, node)
        os.makedirs(os.path.join(root, fresh))  # after the listing: not in it
        return pods

    monkeypatch.setattr(k8s_janitor, "list_node_pods", listing_then_a_new_pod)
    janitor.one_pass()
    assert sorted(os.listdir(root)) == sorted([live, full, fresh, "not-a-pod-uid"])
    assert os.path.isdir(os.path.join(root, live, "job", "actor"))


def test_empty_dirs_greenroom_did_not_make_survive_the_sweep(api, disk_dir):
    """A dir named like a gone pod's UID that the init container did not make (a user's, the
    kubelet's with the init container off, an older chart's), and a user's empty
    ``<job>/<role>`` inside a pod dir greenroom made: the sweep removed every empty tree
    named like a pod UID, whoever made it."""
    theirs, ours = str(uuid.uuid4()), str(uuid.uuid4())  # neither pod is on the node
    root = os.path.join(disk_dir, "root")
    os.makedirs(os.path.join(root, theirs, "job", "actor"))
    os.makedirs(os.path.join(root, ours, "their-job", "actor"))
    with open(os.path.join(root, ours, ".greenroom-made"), "w"):
        pass  # the init container's marker: the pod dir is greenroom's, what is in it is not
    old = time.time() - 60
    for uid in (theirs, ours):
        os.utime(os.path.join(root, uid), (old, old))
    janitor = Janitor(JanitorConfig(root=root, node_name=NODE), out=open(os.devnull, "w"))
    janitor.connect()
    janitor.one_pass()
    assert os.path.isdir(os.path.join(root, theirs, "job", "actor"))
    assert os.path.isdir(os.path.join(root, ours, "their-job", "actor"))


def test_a_pod_started_after_the_listing_keeps_its_dir_until_a_listing_has_it(api, disk_dir, monkeypatch):
    """A pod that starts between the pod listing and the walk is not in the listing: its
    rank, dead at once (lock free, the container restarting), must not be taken for a gone
    pod's and removed with the pod's own dir while the pod lives."""
    root = os.path.join(disk_dir, "root")
    os.makedirs(root)
    new = str(uuid.uuid4())
    janitor = Janitor(JanitorConfig(root=root, node_name=NODE), out=open(os.devnull, "w"))
    janitor.connect()
    original = k8s_janitor.list_node_pods
    made = []

    def listing_then_a_new_pod(api_, node):
        pods = original(api_, node)
        if not made:
            made.append(dead(root, new, "grpo", written_ago=0))  # after the listing: not in it
        return pods

    monkeypatch.setattr(k8s_janitor, "list_node_pods", listing_then_a_new_pod)
    report = janitor.one_pass()
    (path,) = made
    assert decisions(report)[path][0] == "kept"
    assert os.path.exists(os.path.join(path, "offload", "state.bin"))
    api.add_pod(new, "grpo-0")  # the next listing has it: between restarts, kept
    assert decisions(janitor.one_pass())[path][0] == "kept"
    api.pods = [p for p in api.pods if p["metadata"]["uid"] != new]  # gone: reclaimed at once, its pod dir too
    then = time.time() - 10
    os.utime(os.path.join(path, "owner.json"), (then, then))
    assert decisions(janitor.one_pass())[path] == ("reclaimed", "owner gone")
    assert os.listdir(root) == []


def test_a_root_given_as_a_symlink_on_another_filesystem_still_loses_its_empty_pod_dirs(api, disk_dir):
    """``reclaim`` resolves ROOT; the empty-dir sweep compared each pod dir with the dev of
    the symlink itself (here on tmpfs) and so never removed one."""
    from greenroom.io import fs

    if not (os.path.isdir("/dev/shm") and fs.is_memory_backed("/dev/shm") and not fs.is_memory_backed(disk_dir)):
        pytest.skip("needs a tmpfs at /dev/shm and a disk-backed test dir")
    root = os.path.join(disk_dir, "root")
    gone = made_dirs(root, str(uuid.uuid4()))
    made_dirs(gone, "job", "actor")
    old = time.time() - 60
    os.utime(gone, (old, old))
    link = f"/dev/shm/greenroom-janitor-root-{os.getpid()}"
    os.symlink(root, link)
    try:
        janitor = Janitor(JanitorConfig(root=link, node_name=NODE), out=open(os.devnull, "w"))
        janitor.connect()
        janitor.one_pass()
        assert os.listdir(root) == []
    finally:
        os.unlink(link)
