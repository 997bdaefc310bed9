"""The pod rule of ``greenroom reclaim ROOT --kubernetes`` (``greenroom.dirs.janitor``):
which dirs a listing of the node's pods makes stale, and which it keeps.

The lock rule (``greenroom.dirs.reclaim``) only knows that no process holds a dir. On a
Kubernetes node we know more, through the pods bound to this node (``k8s_api`` lists
them):

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
(each dir holding its marker, ``greenroom.dirs.tree`` Note [made parents]): a dir named
like a pod UID that the init container did not make (the kubelet's, with the init
container turned off; one of an older chart; a user's) stays.

Imports neither torch nor the kubernetes client.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from greenroom.dirs.names import MADE_NAME, OWNER_NAME
from greenroom.dirs.tree import remove_made_dir

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(slots=True)
class PodInfo:
    name: str
    namespace: str
    phase: str
    job: str = ""


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
