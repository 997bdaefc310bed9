"""What ``greenroom train`` prints (rank 0): the header that says what the run does with
its memory, and one line per iteration. Text only: the trainer passes the facts."""

from __future__ import annotations

import torch

from greenroom.config import OffloadConfig
from greenroom.io.compression import ResolvedCodec
from greenroom.tensors import local_tensor
from greenroom.units import GB, rate_text, size_text


def header(
    o: OffloadConfig,
    *,
    params: int,
    dtype: str,
    device: torch.device,
    world_size: int,
    backend: str,
    optimizer,
    rank_dir_path: str | None,
    start: int,
    compression: ResolvedCodec | None,
) -> str:
    """The run's first line: model, ranks, offload, streaming, codec, staging, host cache,
    rank dir and where a resumed run starts. ``compression``: the codec the run's
    mechanisms were handed (None where nothing goes to disk)."""
    offload = f"{o.offload_train_target} ({backend})" if o.offload_train else "off"
    streaming = "off"
    if o.stream_optimizer_state_to_disk:
        streaming = (
            f"on ({o.stream_optimizer_state_moment_dtype} moments, {masters_words(optimizer.store)}): "
            f"{streaming_words(optimizer)}"
        )
    parts = [
        f"greenroom train: {params:,} params ({dtype}) on {device}",
        f"{world_size} rank(s)",
        f"offload {offload}",
        f"streaming {streaming}",
    ]
    if compression is not None:
        parts.append(compression.line)
    if o.staging_bytes_per_rank:
        count = o.staging_bytes_per_rank // o.chunk_bytes
        parts.append(
            f"staging {count} x {o.offload_train_disk_chunk_mb} MiB host memory per rank"
            + (" (one per mechanism)" if count > 1 else "")
        )
    if o.host_cache_bytes:
        parts.append(
            host_cache_words(optimizer.store, o.stream_optimizer_state_host_cache_gb, pinned=device.type == "cuda")
        )
    if rank_dir_path is not None:
        parts.append(f"rank dir {rank_dir_path}")
    if start:
        parts.append(f"resuming at iteration {start + 1}")
    return ", ".join(parts)


def masters_words(store) -> str:
    """How the streamed params' fp32 masters are stored: the flag's layout applies to bf16
    params only, and an fp32 param is its own master (nothing stored)."""
    kinds = sorted({"as remainders" if e.remainder else "whole" for e in store.entries if e.master})
    return f"masters {' and '.join(kinds)}" if kinds else "no masters (fp32 params are their own)"


def streaming_words(opt) -> str:
    """What streams and what stays resident on this rank."""
    streamed = sum(local_tensor(p).numel() for p in opt.streamed)
    resident = sum(local_tensor(p).numel() for p in opt.resident)
    words = (
        f"{streamed:,} params stream ({size_text(opt.store.state_bytes)} of optimizer state "
        f"in {len(opt.store.buckets)} bucket file(s): each optimizer step reads every bucket and writes it "
        "back, but the one it ends on stays on the device for the next step and is written back when the "
        "actor sleeps, the run saves or it ends), "
        f"{resident:,} stay resident (fp32 params of at most {opt.resident_numel:,} elements)"
    )
    if not streamed:
        words += (
            "; WARNING: nothing streams, every param is a small fp32 one: use --dtype mixed or bf16, "
            "or a larger --d-model"
        )
    return words


def host_cache_words(store, budget_gb: float, *, pinned: bool) -> str:
    """What ``--stream-optimizer-state-host-cache-gb`` holds on this rank (whole buckets only)."""
    budget = f"{budget_gb:g} GB"
    memory = "pinned host memory" if pinned else "host memory"
    if not store.buckets:
        return f"host cache {budget} unused: no param streams (all are small fp32 ones, kept on the device)"
    if not store.host_cache:
        smallest = min(b.data_bytes for b in store.buckets)
        return (
            f"host cache {budget} holds no bucket (the smallest takes {smallest / GB:.3g} GB): "
            "every bucket streams from disk"
        )
    return (
        f"host cache {len(store.host_cache)} of {len(store.buckets)} buckets, "
        f"{store.host_cache_bytes / GB:.3g} GB of {memory} per rank (of {budget}), "
        f"disk {store.disk_bytes_per_step / GB:.3g} GB each way per step"
    )


def iteration_line(record: dict, *, on_disk: bool) -> str:
    """One iteration's record (``Trainer.iteration``) in a line; ``on_disk``: the run has a
    rank dir, whose stored bytes the record counts."""
    return (
        f"iter {record['iteration']:>3}/{record['iterations']}  reward {record['reward']:.3f}  "
        f"loss {record['loss']:+.4f}  train {record['train_s']:.2f}s  rollout {record['rollout_s']:.2f}s  "
        f"sleep {record['sleep_s']:.3f}s ({rate_text(record['sleep_gbps'] * GB)}, "
        f"offloaded {size_text(record['offloaded_bytes'])}, wrote {size_text(record['sleep_written'])})  "
        f"wake {record['wake_s']:.3f}s ({rate_text(record['wake_gbps'] * GB)})  "
        + (
            f"streamed read {size_text(record['stream_read_bytes'])} written "
            f"{size_text(record['stream_written_bytes'])} ("
            + (
                f"{size_text(record['stream_sleep_written_bytes'])} of it at sleep, "
                if record.get("stream_sleep_written_bytes")
                else ""
            )
            + f"steps {rate_text(record['stream_gbps'] * GB)}"
            + (f", {size_text(record['stream_kept_bytes'])} kept on the device" if record["stream_kept_bytes"] else "")
            + ")  "
            if record["stream_read_bytes"] or record["stream_written_bytes"]
            else ""
        )
        + (f"on disk {size_text(record['disk_stored_bytes'])}  " if on_disk else "")
        + f"peak dev {size_text(record['peak_device_bytes'])}  host {size_text(record['peak_host_rss'])}"
    )
