"""``greenroom report METRICS.jsonl``: the phases, memory and reward of a run, as a PNG.

Four panels over wall time: which phase ran when (sync, sleep, rollout, wake, train),
device and host memory at the end of every phase, the GB/s of every sleep, wake and
streamed optimizer step, and the mean reward per iteration.

A metrics file a resumed run appended to (``--load`` with the same ``--metrics``) holds
several run segments, each with its clock starting at 0: the time axis continues from
one segment to the next, and each segment's start is marked with its first iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

from greenroom.errors import GreenroomError
from greenroom.log import get_logger
from greenroom.train.preflight import metrics_record
from greenroom.units import GB

log = get_logger(__name__)

SOFTWARE = "greenroom report"
"""The PNG's Software text: what tells a plot of ours, which a new report may replace."""
PHASE_COLORS = {"sync": "#999999", "sleep": "#d62728", "rollout": "#1f77b4", "wake": "#2ca02c", "train": "#ff7f0e"}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS.jsonl", help="written by greenroom train --metrics")
    parser.add_argument("-o", "--output", metavar="PNG", help="default: METRICS with .png")
    parser.add_argument(
        "--json", action="store_true", help="print what was drawn as one JSON object (output, iterations, run segments)"
    )


def read_records(path: str) -> list[dict]:
    """The records of ``path``, one run's, each iteration once. A torn last line (a run
    killed mid-write) is left out, and a resumed segment's records replace those of the
    iterations it trained again, both said on stderr; anything else that is not one
    run's records is refused in one line naming the line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(enumerate(f, 1))
    except FileNotFoundError:
        raise GreenroomError(f"{path}: no such metrics file (greenroom train writes one with --metrics)") from None
    except UnicodeDecodeError:
        raise GreenroomError(f"{path}: not a greenroom train metrics file (not UTF-8 text)") from None
    except OSError as e:
        raise GreenroomError(
            f"{path}: cannot read it ({e.strerror}); give the file greenroom train --metrics wrote"
        ) from None
    lines = [(number, line) for number, line in lines if line.strip()]
    if lines and not lines[-1][1].endswith("\n") and lines[-1][1].startswith('{"iteration": '):
        try:
            json.loads(lines[-1][1])
        except ValueError:
            log.warning(f"{path}:{lines[-1][0]}: left out a torn last line (its run was killed while writing it)")
            lines.pop()
    records, numbers = [], []
    for number, line in lines:
        record = _record(line)
        if record is None:
            raise GreenroomError(f"{path}:{number}: not a greenroom train metrics line")
        records.append(record)
        numbers.append(number)
    if not records:
        raise GreenroomError(f"{path}: no metrics lines")
    return _one_run(path, records, numbers)


_PHASE_FIELDS = ("start", "end", "host_rss", "actor_resident")


def _record(line: str) -> dict | None:
    """The record on ``line``, or None where it lacks what ``draw`` reads."""
    record = metrics_record(line)
    if record is None or not (
        isinstance(record.get("reward"), (int, float)) and {"device", "world_size", "backend"} <= set(record)
    ):
        return None
    events = record["events"]
    if not all(
        isinstance(e, dict)
        and all(isinstance(e.get(k), (int, float)) for k in _PHASE_FIELDS)
        and "device_used" in e
        and isinstance(e["device_used"], (int, float, type(None)))
        for e in events
    ):
        return None
    return record if {e.get("phase") for e in events} >= set(PHASE_COLORS) else None


def _one_run(path: str, records: list[dict], numbers: list[int]) -> list[dict]:
    """A segment that starts again at an iteration logged before is a resume from an
    earlier checkpoint: its records replace the killed run's of those iterations. One
    that starts at iteration 1 is another run: refused, as the plot would draw two runs
    as one (and call the second a resume)."""
    kept = []
    for i, (record, number) in enumerate(zip(records, numbers)):
        previous = records[i - 1] if i else None
        new_segment = previous is not None and (
            record["events"][0]["start"] < previous["events"][-1]["end"] or record["iteration"] <= previous["iteration"]
        )
        if new_segment and record["iteration"] == 1:
            raise GreenroomError(
                f"{path}:{number}: a new run starts at iteration 1 after iteration "
                f"{previous['iteration']} (line {numbers[i - 1]}): the file holds more than one "
                "run; give one run's file"
            )
        if new_segment:
            superseded = [r for r in kept if r["iteration"] >= record["iteration"]]
            if superseded:
                log.warning(
                    f"{path}:{number}: a resumed run trained iterations {superseded[0]['iteration']}-"
                    f"{superseded[-1]['iteration']} again: drew its records, not the earlier ones"
                )
                kept = kept[: len(kept) - len(superseded)]
        kept.append(record)
    return kept


def segments(records: list[dict]) -> list[tuple[int, float]]:
    """Where each run segment starts: (index of its first record, seconds to add to its
    clock). A segment starts where a record's clock goes back (a new process)."""
    starts = [(0, 0.0)]
    offset = 0.0
    for i in range(1, len(records)):
        previous_end = records[i - 1]["events"][-1]["end"]
        if records[i]["events"][0]["start"] < previous_end:
            offset += previous_end
            starts.append((i, offset))
    return starts


def continued(records: list[dict]) -> list[dict]:
    """The records with every event's times on one clock across segments."""
    bounds = segments(records) + [(len(records), 0.0)]
    out = []
    for (first, offset), (end, _) in zip(bounds, bounds[1:]):
        for r in records[first:end]:
            events = [dict(e, start=e["start"] + offset, end=e["end"] + offset) for e in r["events"]]
            out.append(dict(r, events=events))
    return out


def draw(records: list[dict], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts = segments(records)
    records = continued(records)
    fig, (phases, memory, bandwidth, rewards) = plt.subplots(
        4, 1, figsize=(11, 10), sharex=True, gridspec_kw={"height_ratios": [1, 2, 2, 2]}
    )
    events = [e for r in records for e in r["events"]]
    for name, color in PHASE_COLORS.items():
        spans = [(e["start"], e["end"] - e["start"]) for e in events if e["phase"] == name]
        phases.broken_barh(spans, (0, 1), facecolors=color, label=name)
    phases.set_yticks([])
    phases.legend(ncol=len(PHASE_COLORS), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    resumed = f", {len(starts)} run segments" if len(starts) > 1 else ""
    fig.suptitle(
        f"greenroom train on {records[0]['device']}, {records[0]['world_size']} rank(s), "
        f"offload backend {records[0]['backend']}{resumed}"
    )
    ends = [e["end"] for e in events]
    memory.step(ends, [e["host_rss"] / GB for e in events], where="post", label="host RSS")
    device = [e["device_used"] if e["device_used"] is not None else e["actor_resident"] for e in events]
    label = "device memory in use" if events[0]["device_used"] is not None else "actor state resident"
    memory.step(ends, [d / GB for d in device], where="post", label=label)
    memory.set_ylabel("GB")
    memory.legend()
    for key, phase in (("sleep_gbps", "sleep"), ("wake_gbps", "wake"), ("stream_gbps", "train")):
        points = [(next(e["end"] for e in r["events"] if e["phase"] == phase), r[key]) for r in records if r.get(key)]
        if points:
            bandwidth.plot(
                *zip(*points),
                marker=".",
                color=PHASE_COLORS[phase],
                label={"train": "streamed optimizer steps"}.get(phase, phase),
            )
    bandwidth.set_ylabel("GB/s")
    if bandwidth.lines:
        bandwidth.legend()
    rewards.plot([r["events"][-1]["end"] for r in records], [r["reward"] for r in records], marker=".")
    rewards.set_ylabel("mean reward")
    rewards.set_xlabel("seconds since the first run started (run time only)")
    rewards.set_ylim(0, 1)
    for index, _offset in starts[1:]:
        at = records[index]["events"][0]["start"]
        for axis in (phases, memory, bandwidth, rewards):
            axis.axvline(at, color="black", linestyle="--", linewidth=0.8)
        rewards.annotate(
            f"resumed at iteration {records[index]['iteration']}",
            (at, 0.95),
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
            va="top",
        )
    fig.tight_layout()
    # Written beside and moved into place: a failed write leaves no partial PNG, and an
    # earlier report stays whole until the new one is complete.
    tmp = os.path.join(os.path.dirname(os.path.abspath(output)), f".{os.path.basename(output)}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=110, format="png", metadata={"Software": SOFTWARE})
        os.replace(tmp, output)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise GreenroomError(f"-o {output}: cannot write it ({e.strerror}); give a path in a writable dir") from None
    finally:
        plt.close(fig)


def check_output(output: str) -> None:
    """``output`` is a PNG path that holds nothing, or a report drawn before (told by the
    mark ``draw`` leaves in it): never the metrics file or another file of the user's."""
    if not output.lower().endswith(".png"):
        raise GreenroomError(f"-o {output}: greenroom report writes a PNG; give a path ending in .png")
    if os.path.isdir(output):
        raise GreenroomError(f"-o {output} is a directory; give a file path ending in .png")
    if not os.path.lexists(output):
        return
    try:
        with open(output, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise GreenroomError(f"-o {output}: cannot read what is there ({e.strerror})") from None
    if not head.startswith(b"\x89PNG\r\n\x1a\n") or b"tEXtSoftware\x00" + SOFTWARE.encode() not in head:
        raise GreenroomError(
            f"-o {output} exists and is not a plot greenroom report drew; refusing to overwrite "
            "it: give another -o, or move the file away"
        )


def run(args: argparse.Namespace) -> int:
    records = read_records(args.metrics)
    output = args.output or os.path.splitext(args.metrics)[0] + ".png"
    check_output(output)
    draw(records, output)
    starts = segments(records)
    if args.json:
        print(
            json.dumps(
                {
                    "output": output,
                    "iterations": len(records),
                    "segments": [
                        {"first_iteration": records[i]["iteration"], "offset_s": offset} for i, offset in starts
                    ],
                },
                sort_keys=True,
            )
        )
        return 0
    print(f"wrote {output} ({len(records)} iterations" + (f", {len(starts)} run segments)" if len(starts) > 1 else ")"))
    return 0
