"""The text report of ``greenroom bench stream`` (``greenroom.cli.bench.stream``): the
figures ``stream_measure.measure`` returns, one line per phase, and why a step moved
nothing where it did not.
"""

from __future__ import annotations

from greenroom.cli.bench import explain
from greenroom.units import GB, rate_text, size_text


def print_text(r: dict) -> None:
    """Print the result ``r`` of ``stream_measure.measure`` as text (without ``--json``)."""
    print(
        f"bench stream: {r['params']:,} {r['param_dtype']} params, {r['moment_dtype']} moments, on {r['device']}; "
        f"{_buckets_words(r)}, state {size_text(r['state_bytes'])} "
        f"in {r['dir']} ({r['filesystem']}, O_DIRECT {'on' if r['o_direct'] else 'off'}, "
        f"checksums {'verified' if r['verify'] else 'OFF (--no-verify)'})"
    )
    if r["host_cache_budget_bytes"]:
        print(
            f"host cache: {r['cached_buckets']} of {r['buckets']} buckets, {size_text(r['host_cache_bytes'])} of "
            f"{size_text(r['host_cache_budget_bytes'])} ({'pinned' if r['device'].startswith('cuda') else 'plain'} "
            "host memory); the rest streams"
        )
    print(
        f"raw disk (same run): read {rate_text(r['raw_read_bytes_per_s'])}, "
        f"write {rate_text(r['raw_write_bytes_per_s'])}"
    )
    init_device = r["init_peak_device_bytes"]
    print(
        f"init: {r['init_seconds']:.2f} s"
        + (f", peak device {size_text(init_device)}" if init_device is not None else "")
    )
    for i, s in enumerate(r["steps"], 1):
        moved = (
            f"on disk {size_text(s['disk_bytes'])}, {rate_text(s['disk_bytes'] / s['seconds'])}"
            if s["disk_bytes"]
            else f"no disk I/O, no bandwidth measured ({_why_no_io(r)})"
        )
        print(
            f"step {i}: {s['seconds']:.2f} s, state read {size_text(s['bytes_read'])} + written "
            f"{size_text(s['bytes_written'])}, {moved}, CPU {s['cpu_seconds']:.2f} s"
            + (f", peak device +{size_text(s['peak_device_bytes'])}" if s["peak_device_bytes"] is not None else "")
        )
        where = explain.line(
            f"  step {i}", s["breakdown"], s["overlapped_ratio"], "the overlapped bound of its stored bytes"
        )
        if where is not None:
            print(where)
    if r["kept_bucket_bytes"]:
        print(
            f"between steps one bucket ({size_text(r['kept_bucket_bytes'])}) stays on the device: a step after "
            "another reads and writes that much less"
        )
    if r["ratio"] is None:
        print(f"disk bound 0 s: the last step moved nothing through the disk ({_why_no_io(r)}); no step/bound ratio")
    else:
        print(f"disk bound {r['disk_bound_seconds']:.2f} s, step/bound {r['ratio']:.2f}")
    if r["overlapped_ratio"] is not None:
        print(
            f"reads and writes at once (same run): read {rate_text(r['raw_mixed_read_bytes_per_s'])}, write "
            f"{rate_text(r['raw_mixed_write_bytes_per_s'])}; a fully overlapped step's bound "
            f"{r['overlapped_bound_seconds']:.2f} s, step / it {r['overlapped_ratio']:.2f}"
        )
    masters = f"masters {r['master_layout']}: {r['disk_bytes_per_param']:.3f} disk bytes/param stored"
    if r["ratio"] is None:  # a step that moved nothing is not compared with a bound that moves everything
        print(masters)
    else:
        print(
            f"{masters}; step / bound of the uncompressed whole-master {r['full_master_bytes'] / r['params']:g} "
            f"B/param ({r['full_master_bound_seconds']:.2f} s) {r['full_master_ratio']:.2f}; with a probe after "
            f"the steps too (read {rate_text(r['raw_after_read_bytes_per_s'])}, write "
            f"{rate_text(r['raw_after_write_bytes_per_s'])}), against the mean of both bounds "
            f"{r['full_master_ratio_bracketed']:.2f}"
        )
    print(
        f"{r['compression']}; {r['state']} state: on disk read {size_text(r['disk_bytes_read'])}, written "
        f"{size_text(r['disk_bytes_written'])} in the last step ("
        + (
            f"{r['stored_ratio']:.2f}x smaller than the state"
            if r["stored_ratio"] is not None
            else f"it wrote nothing: {_why_no_io(r)}; the files hold what init and earlier steps wrote"
        )
        + "); "
        f"1000 such steps write {size_text(r['disk_bytes_written_per_1000_steps'])}"
    )
    if r["checkpoint"] is not None:
        c = r["checkpoint"]
        i = c["in_step"]
        print(
            f"checkpoint in the step by {i['mode']}: {i['step_seconds']:.2f} s against plain steps "
            f"{i['plain_step_seconds'][0]:.2f} / {i['plain_step_seconds'][1]:.2f} s ({i['ratio']:.2f}x, "
            f"{i['extra_seconds']:+.2f} s, of it publish {i['publish_seconds']:.2f} s); extra read "
            f"{size_text(i['extra_bytes_read'])}, extra written {size_text(i['extra_bytes_written'])}; "
            f"the step after it {i['step_after_ratio']:.2f}x the one before; its read-back "
            f"{size_text(i['verify_bytes_read'])} in {i['verify_seconds']:.2f} s"
        )
        print(
            f"checkpoint between steps ({c['save_kind']}) of {size_text(c['bytes'])}: {c['save_seconds']:.2f} s, "
            f"read {size_text(c['save_bytes_read'])}, written {size_text(c['save_bytes_written'])}; "
            f"with verify=True {c['save_verify_seconds']:.2f} s, read {size_text(c['save_verify_bytes_read'])}; "
            f"verified load {c['load_seconds']:.2f} s"
        )
    if r["state_dict"] is not None:
        for name, d in r["state_dict"].items():
            print(
                f"{name.replace('_', ' ')}: {d['seconds']:.2f} s, {size_text(d['bytes'])}, "
                f"{rate_text(d['bytes'] / d['seconds'])}; host RSS +{size_text(d['rss_growth_bytes'])} "
                f"(anonymous +{size_text(d['anon_growth_bytes'])}, budget staging + 1.1 GB = "
                f"{size_text((r['chunk_bytes'] + (1 << 30)))}), "
                f"page cache +{size_text(d['page_cache_growth_bytes'])}"
            )
    print(
        f"host RSS peak {size_text(r['host_rss_peak_bytes'])} (budget {size_text(r['host_rss_budget_bytes'])}: "
        f"before + staging + 1.1 GB; at init {size_text(r['init_host_rss_peak_bytes'])}), "
        f"page cache growth {size_text(r['page_cache_growth_bytes'])}"
    )
    print(
        "host RSS (anonymous) after: "
        + ", ".join(f"{name} {p['rss'] / GB:.2f} ({p['anon'] / GB:.2f}) GB" for name, p in r["host_rss_phases"].items())
    )


def _buckets_words(r: dict) -> str:
    """The buckets as built: a param larger than ``--bucket-numel`` gets a bucket of its
    own, so the largest may exceed it."""
    count = f"{r['buckets']} bucket{'s' if r['buckets'] != 1 else ''}"
    largest = f"largest {r['largest_bucket_numel']:,} elements ({size_text(r['largest_bucket_bytes'])})"
    if r["largest_bucket_numel"] > r["bucket_numel"]:
        return (
            f"{count}, {largest}: a param over --bucket-numel {r['bucket_numel']:,} gets a bucket of its own "
            f"(--param-numel {r['param_numel']:,})"
        )
    return f"{count} of up to --bucket-numel {r['bucket_numel']:,} elements, {largest}"


def _why_no_io(r: dict) -> str:
    """Why a step moved nothing through the disk: the bucket the last step kept on the
    device, the host cache's buckets, or both, hold all of the state."""
    reasons = []
    if r["kept_bucket_bytes"]:
        reasons.append(
            "the one bucket stayed on the device between steps"
            if r["buckets"] == 1
            else "the bucket kept on the device between steps"
        )
    if r["cached_buckets"]:
        reasons.append(f"{r['cached_buckets']} of {r['buckets']} buckets in the host cache")
    return " and ".join(reasons) or "nothing streams"
