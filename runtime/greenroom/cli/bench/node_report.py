"""The text report of ``greenroom bench node`` (``greenroom.cli.bench.node``): each rank
count's raw probe, the targets, and one line per rank count and phase with a verdict per target.
"""

from __future__ import annotations

from greenroom.units import rate_text, size_text


def _met(value: bool | None) -> str:
    return "-" if value is None else "met" if value else "MISSED"


def print_text(r: dict) -> None:
    print(
        f"bench node {r['dir']} ({r['filesystem']}): ranks {','.join(map(str, r['ranks']))} at once on "
        f"{r['device']}; each {r['params_per_rank']:,} {r['param_dtype']} params ({r['moment_dtype']} moments, "
        f"{r['steps']} steps{', I/O only' if r['io_only'] else ''}) and a {size_text(r['actor_bytes_per_rank'])} "
        f"actor ({r['cycles']} sleep/wake cycles); {r['compression']}"
    )
    for run_n in r["runs"]:
        raw = run_n["raw"]
        print(
            f"raw disk for {run_n['ranks']} rank(s), probed at their concurrency before they start "
            f"({size_text(raw['bytes'])} each way): read {rate_text(raw['read_bytes_per_s'])}, write "
            f"{rate_text(raw['write_bytes_per_s'])} (into fresh blocks {rate_text(raw['first_write_bytes_per_s'])}); "
            f"at once {rate_text(raw['mixed_read_bytes_per_s'])} and "
            f"{rate_text(raw['mixed_write_bytes_per_s'])}"
        )
    t = r["targets"]
    print(
        f"targets: aggregate >= {t['vs_one_rank_at_least']:.2f} of one rank's, no rank over "
        f"{t['spread_at_most']:.2f}x the mean, plan within {t['plan_within']:.0%} of the measured seconds"
    )
    print(
        f"{'ranks':>5} {'phase':<6}{'aggregate':>12}{'of raw':>8}{'vs 1 rank':>10}{'spread':>8}"
        f"{'plan s':>9}{'measured s':>11}{'plan/meas':>10}   vs 1 rank / spread / plan"
    )
    for run_n in r["runs"]:
        for name in ("step", "sleep", "wake"):  # a run's order (a JSON read back sorts them)
            p = run_n["phases"][name]
            m = p["targets_met"]
            ratio = "-" if p["plan_ratio"] is None else f"{p['plan_ratio']:.2f}"
            print(
                f"{run_n['ranks']:>5} {name:<6}{rate_text(p['aggregate_bytes_per_s']):>12}"
                f"{p['of_disk_bound']:>8.2f}{p['vs_one_rank']:>10.2f}{p['spread']:>8.3f}"
                f"{p['plan_seconds']:>9.2f}{p['measured_seconds']:>11.2f}{ratio:>10}   "
                f"{_met(m['vs_one_rank'])} / {_met(m['spread'])} / {_met(m['plan'])}"
            )
    exact = all(run_n["bit_exact"] for run_n in r["runs"])
    print(f"every rank's actor bit-exact after its last wake: {exact}")
