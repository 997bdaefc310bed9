"""``greenroom report METRICS.jsonl``: the phases, memory and reward of a run, as a PNG.

Three panels over wall time: which phase ran when (sync, sleep, rollout, wake, train),
device and host memory at the end of every phase, and the mean reward per iteration.
"""

from __future__ import annotations

import argparse
import json
import os

from greenroom.config import GB
from greenroom.errors import GreenroomError

PHASE_COLORS = {"sync": "#999999", "sleep": "#d62728", "rollout": "#1f77b4", "wake": "#2ca02c", "train": "#ff7f0e"}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS.jsonl", help="written by greenroom train --metrics")
    parser.add_argument("-o", "--output", metavar="PNG", help="default: METRICS with .png")


def read_records(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except FileNotFoundError:
        raise GreenroomError(f"{path}: no such metrics file (greenroom train writes one with --metrics)") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            record["events"]  # noqa: B018 - every greenroom train record has them
        except (ValueError, KeyError, TypeError):
            raise GreenroomError(f"{path}:{number}: not a greenroom train metrics line") from None
        records.append(record)
    if not records:
        raise GreenroomError(f"{path}: no metrics lines")
    return records


def draw(records: list[dict], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (phases, memory, rewards) = plt.subplots(3, 1, figsize=(11, 8), sharex=True,
                                                  gridspec_kw={"height_ratios": [1, 2, 2]})
    events = [e for r in records for e in r["events"]]
    for name, color in PHASE_COLORS.items():
        spans = [(e["start"], e["end"] - e["start"]) for e in events if e["phase"] == name]
        phases.broken_barh(spans, (0, 1), facecolors=color, label=name)
    phases.set_yticks([])
    phases.legend(ncol=len(PHASE_COLORS), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.suptitle(f"greenroom train on {records[0]['device']}, {records[0]['world_size']} rank(s), "
                 f"offload backend {records[0]['backend']}")
    ends = [e["end"] for e in events]
    memory.step(ends, [e["host_rss"] / GB for e in events], where="post", label="host RSS")
    device = [e["device_used"] if e["device_used"] is not None else e["actor_resident"] for e in events]
    label = "device memory in use" if events[0]["device_used"] is not None else "actor state resident"
    memory.step(ends, [d / GB for d in device], where="post", label=label)
    memory.set_ylabel("GB")
    memory.legend()
    rewards.plot([r["events"][-1]["end"] for r in records], [r["reward"] for r in records], marker=".")
    rewards.set_ylabel("mean reward")
    rewards.set_xlabel("seconds since start")
    rewards.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    records = read_records(args.metrics)
    output = args.output or os.path.splitext(args.metrics)[0] + ".png"
    draw(records, output)
    print(f"wrote {output} ({len(records)} iterations)")
    return 0
