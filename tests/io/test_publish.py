"""The checkpoint publish protocol on real dirs: every state a killed save can leave is
settled by ``recover`` from the generation records alone, and said."""

import json
import os

import pytest

from greenroom.errors import CheckpointError
from greenroom.io import publish


def make(path, payload):
    """A complete checkpoint dir at ``path`` holding ``payload``, published properly."""
    new, _ = publish.stage(path)
    with open(os.path.join(new, "data"), "w") as f:
        f.write(payload)
    publish.publish(path)


def content(path):
    with open(os.path.join(path, "data")) as f:
        return f.read()


def leftovers(path):
    return [p for p in (path + ".new", path + ".old") if os.path.lexists(p)]


def test_a_save_replaces_the_checkpoint_and_chains_generations(disk_dir):
    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    first = publish.generation(path)
    make(path, "two")
    assert content(path) == "two" and leftovers(path) == []
    assert publish.generation(path)["previous"] == first["id"]


def test_only_copy_under_old_is_restored(disk_dir):
    """The swap without RENAME_EXCHANGE killed after DIR -> DIR.old and with the
    new copy lost: the only good copy sits under the temporary name; recovery restores it."""
    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    os.rename(path, path + ".old")
    assert publish.recover(path) == f"restored the previous checkpoint from {path}.old"
    assert content(path) == "one" and leftovers(path) == []


def test_complete_new_with_the_old_aside_is_moved_in(disk_dir):
    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    new, _ = publish.stage(path)
    with open(os.path.join(new, "data"), "w") as f:
        f.write("two")
    publish.write_checked_json(
        os.path.join(new, publish.GENERATION), {"id": "b", "previous": publish.generation(path)["id"]}
    )
    os.rename(path, path + ".old")  # killed between the two renames
    said = publish.recover(path)
    assert "finished the save" in said and "discarded" in said
    assert content(path) == "two" and leftovers(path) == []


def test_a_damaged_generation_record_is_never_trusted(disk_dir):
    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    new, _ = publish.stage(path)
    publish.write_checked_json(
        os.path.join(new, publish.GENERATION), {"id": "b", "previous": publish.generation(path)["id"]}
    )
    record = os.path.join(new, publish.GENERATION)
    data = json.load(open(record))
    data["previous"] = "forged"
    json.dump(data, open(record, "w"))  # a valid JSON whose checksum no longer matches
    assert "incomplete" in publish.recover(path)
    assert content(path) == "one" and leftovers(path) == []


def test_a_foreign_dir_is_never_replaced(disk_dir):
    path = os.path.join(disk_dir, "mine")
    os.makedirs(path)
    open(os.path.join(path, "thesis.tex"), "w").write("years of work")
    with pytest.raises(CheckpointError, match="refusing to replace it"):
        publish.stage(path)
    assert os.listdir(path) == ["thesis.tex"] and leftovers(path) == []


@pytest.mark.parametrize(
    "text,message",
    [
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "no checksum field"),
        (b'{"a": 1, "crc32": "00000000"}', "does not match"),
    ],
)
def test_checked_json_names_the_file_and_the_fault(disk_dir, text, message):
    path = os.path.join(disk_dir, "meta.json")
    open(path, "wb").write(text)
    with pytest.raises(CheckpointError, match=message) as info:
        publish.read_checked_json(path, {})
    assert str(info.value).startswith(path)


def test_checked_json_requires_its_fields_with_their_types(disk_dir):
    path = os.path.join(disk_dir, "meta.json")
    publish.write_checked_json(path, {"iteration": True})
    with pytest.raises(CheckpointError, match="field 'iteration' is missing or not int"):
        publish.read_checked_json(path, {"iteration": int})


READER = """
import sys
from greenroom.io import publish
with publish.locked(sys.argv[1], reading=True):
    print("holding", flush=True)
    sys.stdin.readline()
"""


def another_reader(path):
    """A second process holding ``path``'s lock as a load does, until its stdin closes."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", READER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "holding\n"
    return proc


def test_loads_share_the_lock_and_a_save_is_refused_while_any_reads(disk_dir):
    """Every rank of an FSDP job loads its own and its peers' checkpoints at once: loads
    never refuse each other; a save meanwhile is refused in one line, never queued."""
    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    other = another_reader(path)
    try:
        with publish.locked(path, reading=True):
            assert publish.recover(path) is None and content(path) == "one"
        assert os.path.exists(path + ".lock"), "the other reader still holds it"
        with pytest.raises(CheckpointError, match=r"holds .*ck\.lock: it is saving there \(or resuming from it\)"):
            with publish.locked(path):
                pass
    finally:
        other.communicate("")
    with publish.locked(path):
        make(path, "two")
    assert content(path) == "two" and not os.path.exists(path + ".lock")


def _taken(lock_path):
    """Whether some open file holds ``lock_path``'s flock (a fresh open file of this
    process is refused by any other one, ours included)."""
    import fcntl

    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_the_last_holder_in_the_process_lets_go_even_on_another_thread(disk_dir):
    """The trainer holds the lock for the run and an --async-save publish inside it on its
    own thread; a publish given up by a second signal outlives the run's block. The lock
    stays taken until that publish is out of it too."""
    import threading

    path = os.path.join(disk_dir, "ck")
    inside, leave = threading.Event(), threading.Event()

    def publish_thread():
        with publish.locked(path):
            inside.set()
            leave.wait()

    thread = threading.Thread(target=publish_thread)
    with publish.locked(path):
        thread.start()
        assert inside.wait(10)
    assert _taken(path + ".lock"), "released under the publish"
    leave.set()
    thread.join()
    assert not os.path.exists(path + ".lock")


RELEASING_READER = """
import fcntl, os, sys, time
lock = sys.argv[1] + ".lock"
fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)  # the instant a releasing reader learns it is the last one...
print("exclusive", flush=True)
time.sleep(float(sys.argv[2]))
os.unlink(lock)  # ...and removes the file
os.close(fd)
"""


@pytest.mark.parametrize("reading", [True, False], ids=["load", "save"])
def test_a_reader_releasing_the_lock_as_another_process_takes_it_refuses_nobody(disk_dir, reading):
    """The last reader to let go takes the lock exclusively for an instant, to learn it is
    the last, and removes the file: a load or a save that opens the file in that instant
    finds it taken, and must not be refused, since nobody holds the checkpoint (as in
    tests/optim/test_fsdp.py, whose two ranks load each other's checkpoints at once)."""
    import subprocess
    import sys

    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    releasing = subprocess.Popen(
        [sys.executable, "-c", RELEASING_READER, path, "0.1"], stdout=subprocess.PIPE, text=True
    )
    assert releasing.stdout.readline() == "exclusive\n"
    with publish.locked(path, reading=reading):
        assert content(path) == "one"
    assert releasing.wait() == 0
    assert not os.path.exists(path + ".lock")


def test_a_load_that_must_settle_a_killed_save_waits_for_no_reader_and_touches_nothing(disk_dir):
    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    publish.stage(path)  # a save killed while it wrote ck.new
    other = another_reader(path)
    try:
        with pytest.raises(CheckpointError, match=r"another process holds .*ck\.lock while it reads .* retry"):
            with publish.locked(path, reading=True):
                publish.recover(path)
        assert leftovers(path) == [path + ".new"]
    finally:
        other.communicate("")
    with publish.locked(path, reading=True):
        assert "discarded" in publish.recover(path)
    assert leftovers(path) == [] and content(path) == "one"


def test_a_load_that_must_settle_waits_out_a_reader_that_is_letting_go(disk_dir):
    """Within ``LOCK_GRACE_S``: the other reader finishes its load 0.1 s into the upgrade."""
    import threading

    path = os.path.join(disk_dir, "ck")
    make(path, "one")
    publish.stage(path)  # a save killed while it wrote ck.new
    other = another_reader(path)
    threading.Timer(0.1, other.communicate, ("",)).start()
    with publish.locked(path, reading=True):
        assert "discarded" in publish.recover(path)
    assert other.wait() == 0
    assert leftovers(path) == [] and content(path) == "one"
