"""Hard links between the live bucket files and a checkpoint's: a checkpoint or a load that moves no data.

A hard link is a second name of the same inode: making one reads and writes no byte,
and works on every filesystem that keeps the two names (ext4 included, unlike extent
clones, ``optim.checkpoint.reflink``). What it cannot do is copy on write: a write in place through
either name changes both. So the store never writes in place into an inode with more
than one name (``optim.store.files`` Note [new inodes]), and where links are refused, between
filesystems (EXDEV) or by policy (EPERM), the callers write the bytes instead.
"""

from __future__ import annotations

import errno
import os

NEW_SUFFIX = ".new"
"""A bucket's new file beside its live one, until renamed over it; also the temporary
name a link gets before it is renamed over the live name."""

REFUSED = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EACCES)
"""The errnos with which ``link(2)`` says "not here" rather than "something broke"."""

PROBE = ".link-probe"


def links_work(source: str, directory: str) -> bool:
    """Whether ``directory`` takes a hard link to the file ``source``: tried with a link
    of our own (``directory/.link-probe``), removed at once; False where the kernel
    refuses (``REFUSED``), any other error raised."""
    probe = os.path.join(directory, PROBE)
    if os.path.lexists(probe):
        os.unlink(probe)  # ours, left by a process killed between the two calls below
    if not link_new(source, probe):
        return False
    os.unlink(probe)
    return True


def link_new(source: str, target: str) -> bool:
    """Make the new name ``target`` a link to ``source``; False where the kernel refuses
    (``REFUSED``: EMLINK, a policy), any other error raised."""
    try:
        os.link(source, target)
    except OSError as e:
        if e.errno in REFUSED:
            return False
        raise
    return True


def link_over(source: str, target: str) -> None:
    """Make ``target`` a name of ``source``'s inode, atomically replacing what ``target``
    named (a link at ``target.new``, renamed over it)."""
    tmp = target + NEW_SUFFIX
    if os.path.lexists(tmp):
        os.unlink(tmp)  # ours, from a replacement that did not finish
    os.link(source, tmp)
    os.rename(tmp, target)
    if os.path.lexists(tmp):
        # ``target`` already named that inode (a load right after the checkpoint it
        # loads): rename(2) between two names of one inode does nothing and succeeds.
        os.unlink(tmp)
