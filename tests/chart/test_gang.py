"""Gang scheduling: with `gang.scheduler` the chart renders what Volcano, the coscheduling
plugin of scheduler-plugins or Kueue reads to place or admit all the trainer pods at once,
and refuses in one line what would leave the pods placed one by one (real helm).
tests/k8s/test_gang.py applies the same manifests to the real API server with the
schedulers' own CRDs."""

import pytest

from tests.chart.support import by_kind, manifests, pod_template, reject

pytestmark = pytest.mark.helm

MULTI = ("nodes=4", "gpu.count=8", "procsPerNode=8")


@pytest.mark.parametrize("workload", ["job", "jobset"])
def test_volcano_gets_a_podgroup_of_every_rank_and_pods_that_name_it(workload):
    docs = manifests(sets=(*MULTI, "gang.scheduler=volcano", f"workload={workload}"))
    (pg,) = by_kind(docs, "PodGroup")
    assert pg["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert pg["metadata"]["name"] == "rel-greenroom" and pg["metadata"]["namespace"] == "train"
    assert pg["spec"] == {"minMember": 4, "minResources": {"nvidia.com/gpu": "32"}, "queue": "default"}
    pod = pod_template(docs)
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "rel-greenroom"
    assert pod["spec"]["schedulerName"] == "volcano"
    docs = manifests(sets=(*MULTI, "gang.scheduler=volcano", "gang.queue=team-a", "schedulerName=vc-gpu"))
    assert by_kind(docs, "PodGroup")[0]["spec"]["queue"] == "team-a"
    assert pod_template(docs)["spec"]["schedulerName"] == "vc-gpu"


@pytest.mark.parametrize("workload", ["job", "jobset"])
def test_coscheduling_gets_its_podgroup_and_pods_labelled_with_it(workload):
    docs = manifests(
        sets=(
            *MULTI,
            "gang.scheduler=coscheduling",
            "schedulerName=scheduler-plugins-scheduler",
            f"workload={workload}",
        )
    )
    (pg,) = by_kind(docs, "PodGroup")
    assert pg["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert pg["spec"] == {"minMember": 4, "minResources": {"nvidia.com/gpu": "32"}}
    pod = pod_template(docs)
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "rel-greenroom"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert "scheduling.k8s.io/group-name" not in pod["metadata"]["annotations"]


def test_kueue_gets_a_suspended_job_with_its_queue_label():
    docs = manifests(sets=(*MULTI, "gang.scheduler=kueue", "gang.queue=team-a"))
    (job,) = by_kind(docs, "Job")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["suspend"] is True
    assert not by_kind(docs, "PodGroup")
    docs = manifests(sets=(*MULTI, "gang.scheduler=kueue", "gang.queue=team-a", "workload=jobset"))
    (js,) = by_kind(docs, "JobSet")
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and js["spec"]["suspend"] is True
    assert "suspend" not in js["spec"]["replicatedJobs"][0]["template"]["spec"]


def test_no_gang_renders_none_of_it():
    docs = manifests(sets=MULTI)
    assert not by_kind(docs, "PodGroup")
    (job,) = by_kind(docs, "Job")
    assert "suspend" not in job["spec"] and "schedulerName" not in pod_template(docs)["spec"]


@pytest.mark.parametrize(
    "sets, line",
    [
        (
            ("schedulerName=volcano", "nodes=2"),
            "schedulerName volcano without gang.scheduler volcano: Volcano would place the 2 pods one by one",
        ),
        (
            ("gang.scheduler=coscheduling", "nodes=2"),
            "gang.scheduler coscheduling needs schedulerName: the scheduler profile that runs the coscheduling plugin",
        ),
        (
            ("gang.scheduler=volcano", "schedulerName=default-scheduler"),
            "gang.scheduler volcano with schedulerName default-scheduler: the default scheduler ignores",
        ),
        (("gang.scheduler=kueue",), "gang.scheduler kueue needs gang.queue: the LocalQueue"),
        (
            ("gang.scheduler=kueue", "gang.queue=a", "jobLabels.kueue\\.x-k8s\\.io/queue-name=a"),
            "jobLabels kueue.x-k8s.io/queue-name beside gang.scheduler kueue: name the LocalQueue once, in gang.queue",
        ),
        (("gang.queue=a",), "gang.queue a needs gang.scheduler volcano or kueue"),
        (
            ("gang.scheduler=coscheduling", "schedulerName=s", "podLabels.scheduling\\.x-k8s\\.io/pod-group=x"),
            "podLabels scheduling.x-k8s.io/pod-group beside gang.scheduler coscheduling",
        ),
        (
            ("gang.scheduler=volcano", "podAnnotations.scheduling\\.k8s\\.io/group-name=x"),
            "podAnnotations scheduling.k8s.io/group-name beside gang.scheduler volcano",
        ),
        (("gang.scheduler=slurm",), "at '/gang/scheduler'"),
    ],
)
def test_what_would_not_be_a_gang_is_refused_in_one_line(sets, line):
    err = reject(*sets)
    assert line in err, err
    assert "allOf" not in err


def test_one_node_on_volcano_needs_no_gang():
    docs = manifests(sets=("schedulerName=volcano",))
    assert pod_template(docs)["spec"]["schedulerName"] == "volcano" and not by_kind(docs, "PodGroup")
