"""``greenroom.io.timeline``: the split of a window's wall time (Note [where the time went])
on hand-made intervals whose every boundary is a binary fraction, so every sum is exact."""

import threading

from greenroom.io.timeline import Timeline, span


def test_summary_splits_the_disks_idle_time_by_the_first_active_kind():
    t = Timeline()
    # The disk: two overlapping reads (one started before the window), a write, and one after it.
    for start, end in ((-1.0, 2.0), (1.0, 3.0), (6.0, 7.0), (9.0, 10.0)):
        t.add("disk", start, end)
    t.add("codec", 2.0, 5.0)  # 1 s under the disk, 2 s alone
    t.add("host", 4.0, 6.0)  # 1 s under the codec, which comes first in the order
    t.add("sync", 7.5, 8.5)  # past the window's end: clipped
    s = t.summary(0.0, 8.0)
    assert s["wall_s"] == 8.0
    assert s["disk_busy_s"] == 4.0 and s["disk_busy_fraction"] == 0.5
    assert s["disk_idle_s"] == 4.0 and s["disk_idle_fraction"] == 0.5
    parts = s["parts"]
    assert {k: p["idle_s"] for k, p in parts.items()} == {
        "codec": 2.0,
        "device_copy": 0.0,
        "host": 1.0,
        "sync": 0.5,
        "other": 0.5,  # 7.0 to 7.5: nothing recorded
    }
    assert {k: p["idle_fraction"] for k, p in parts.items()} == {
        "codec": 0.25,
        "device_copy": 0.0,
        "host": 0.125,
        "sync": 0.0625,
        "other": 0.0625,
    }
    # Each kind's own time in the window, under the disk or not.
    assert {k: p["busy_s"] for k, p in parts.items()} == {
        "codec": 3.0,
        "device_copy": 0.0,
        "host": 2.0,
        "sync": 0.5,
        "other": None,
    }
    assert sum(p["idle_s"] for p in parts.values()) == s["disk_idle_s"]
    assert s["largest"] == "codec"
    # In flight while busy: 2 + 2 + 1 s of requests (clipped to the window) over 4 s busy.
    assert s["disk_depth"] == 1.25


def test_disk_depth_is_the_mean_number_of_requests_in_flight_while_busy():
    t = Timeline()
    for _ in range(3):
        t.add("disk", 0.0, 2.0)  # three at once, then one alone
    t.add("disk", 2.0, 4.0)
    assert t.summary(0.0, 4.0)["disk_depth"] == 2.0
    t.clear()
    assert t.summary(0.0, 4.0)["disk_depth"] is None  # never busy


def test_a_window_the_disk_filled_names_no_largest_share_and_an_empty_one_names_other():
    t = Timeline()
    t.add("disk", 0.0, 4.0)
    t.add("codec", 1.0, 2.0)  # under the disk: no idle time of its own
    full = t.summary(0.0, 4.0)
    assert full["disk_busy_fraction"] == 1.0 and full["disk_idle_s"] == 0.0 and full["largest"] is None
    assert full["parts"]["codec"] == {"idle_s": 0.0, "idle_fraction": 0.0, "busy_s": 1.0}
    t.clear()
    empty = t.summary(0.0, 2.0)
    assert empty["disk_busy_s"] == 0.0 and empty["parts"]["other"]["idle_s"] == 2.0 and empty["largest"] == "other"


def test_intervals_from_many_threads_are_all_kept_and_none_without_a_timeline():
    t = Timeline()

    def work(k: int) -> None:
        for i in range(1000):
            t.add("host", 1000.0 * k + i, 1000.0 * k + i + 0.5)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.summary(0.0, 4000.0)["parts"]["host"]["busy_s"] == 2000.0
    with span(None, "host"):  # the engine's default: nothing is recorded, nothing fails
        pass
