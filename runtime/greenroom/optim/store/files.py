"""The bucket files of a ``BucketStore``: their names, their inodes, and the rule for writing them.

``BucketFiles`` is the part of ``BucketStore`` that knows the files as files: where each
bucket's live file is (``path``), its open ``StateFile`` (``files``), the files of a
checkpoint's copy (``open_copy``, ``open_existing``), the disk bytes moved, and the
rule below; ``remove_created`` unlinks what a failed opening made.

Note [new inodes]: a bucket is written in place only while its file's inode has one
name (``fstat``'s ``st_nlink``, checked on the open fd: a checkpoint's link and a user's
``cp -l`` backup count alike; ``statefile`` Note [shared inodes]). A bucket whose file is
shared is written to a new file beside it (``bucket-NNNNN.bin.new``, preallocated: all
of a step's new files are made before its first write, so running out of space fails
before any bucket changed), which is renamed over the live name once written; the
other names keep the old inode, untouched. A step that writes a checkpoint by links
(``optim.checkpoint.instep``) hands each bucket a new file in the checkpoint's staging dir
instead: once written, the live name becomes a link to it (``.new`` then rename), so the
checkpoint holds the step's result at the price of no extra byte, and the next step
writes those buckets to new inodes again. Either way a live name always names a whole
bucket (the old one or the new one, each with its own table), and a kill leaves every
other name as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from greenroom.faults import kill_point
from greenroom.io.engine import StateFile
from greenroom.optim.store.hardlink import NEW_SUFFIX, link_over
from greenroom.optim.store.layout import FILE_PATTERN, Bucket


@dataclass(eq=False, slots=True)
class Replacement:
    """A new file that bucket ``index`` is being written to, to take its live name once
    written: ``linked`` when the file lives elsewhere (a checkpoint's staging dir) and
    the live name gets a link to it, else it is a temporary name beside the live one."""

    index: int
    file: StateFile
    linked: bool


class BucketFiles:
    """The bucket files of a ``BucketStore``, which owns one: each bucket's live file
    (``files``, opened by the store through ``open_file``), its name, and the moves that
    give a name a new inode (Note [new inodes]).

    ``buckets`` is the store's own list: the buckets the store adds are this object's too."""

    def __init__(self, buckets: list[Bucket], directory: str, compression) -> None:
        self.buckets = buckets
        self.directory = directory
        self.compression = compression
        self.files: list[StateFile] = []
        self._retired_bytes_read = 0  # disk bytes of the files that new inodes replaced
        self._retired_bytes_written = 0

    def open_file(self, bucket: Bucket) -> StateFile:
        """The live file of ``bucket``, preallocated (created where it is missing)."""
        return StateFile(
            self.path(bucket.index),
            bucket.data_bytes,
            checksums="file",
            compression=self.compression,
            label=f"bucket {bucket.index} of the optimizer state",
        )

    def open_copy(self, index: int, path: str) -> StateFile:
        """A preallocated file at ``path`` of bucket ``index``'s layout, to mirror its
        writes into (``stream(mirror=...)``) or write a cached bucket to."""
        bucket = self.buckets[index]
        return StateFile(
            path,
            bucket.data_bytes,
            checksums="file",
            compression=self.compression,
            label=f"bucket {bucket.index} of a checkpoint of the optimizer state",
        )

    def open_existing(self, index: int, path: str) -> StateFile:
        """Bucket ``index``'s layout over an existing file at ``path`` (a checkpoint's copy),
        its length checked, to read its table or verify it."""
        bucket = self.buckets[index]
        return StateFile(
            path,
            bucket.data_bytes,
            create=False,
            checksums="file",
            compression=self.compression,
            label=f"bucket {bucket.index} of a checkpoint of the optimizer state",
        )

    def disk_bytes(self, way: str) -> int:
        """Bytes ``read`` from or ``written`` to the bucket files since they were opened:
        the state's bytes, less what compression saved."""
        retired = self._retired_bytes_read if way == "read" else self._retired_bytes_written
        return retired + sum(getattr(f, f"disk_bytes_{way}") for f in self.files)

    def path(self, index: int) -> str:
        return os.path.join(self.directory, FILE_PATTERN.format(index))

    def shared(self, index: int) -> bool:
        """Whether bucket ``index``'s live file has another name (a checkpoint, a backup)."""
        return os.fstat(self.files[index].fd).st_nlink > 1

    def new_files(self, indices: Sequence[int]) -> dict[int, StateFile]:
        """A preallocated new file beside the live one for each of the buckets ``indices``
        whose live file is shared: all made before any is written."""
        made: dict[int, StateFile] = {}
        try:
            for index in indices:
                if index not in made and self.shared(index):
                    made[index] = self._open_at(index, self.path(index) + NEW_SUFFIX)
        except BaseException:
            for index, f in made.items():
                self.drop(Replacement(index, f, False))
            raise
        return made

    def _open_at(self, index: int, path: str) -> StateFile:
        bucket = self.buckets[index]
        if os.path.lexists(path):
            os.unlink(path)  # a .new of ours left by a write that failed
        return StateFile(
            path,
            bucket.data_bytes,
            checksums="file",
            compression=self.compression,
            label=f"bucket {bucket.index} of the optimizer state",
        )

    def install(self, replacing: Replacement) -> None:
        """Give a fully written new file bucket ``replacing.index``'s live name (atomic:
        the name names the old bucket or the new one, never a part of either)."""
        index, live = replacing.index, self.path(replacing.index)
        old = self.files[index]
        if replacing.linked:
            link_over(replacing.file.path, live)
            self._retired_bytes_written += replacing.file.disk_bytes_written
            new = self._reopen(index)
        else:
            os.rename(replacing.file.path, live)
            replacing.file.path = live
            new = replacing.file
        self.files[index] = new
        self._retire(old)
        kill_point("bucket-replaced")

    def _reopen(self, index: int) -> StateFile:
        """The live file of bucket ``index`` opened again (after its name got a new inode)."""
        bucket = self.buckets[index]
        return StateFile(
            self.path(index),
            bucket.data_bytes,
            create=False,
            checksums="file",
            compression=self.compression,
            label=f"bucket {bucket.index} of the optimizer state",
        )

    def replace_file(self, index: int, path: str) -> None:
        """Make the live name of bucket ``index`` name the file at ``path`` (a new inode
        written around the engine, a checkpoint's copy or clone) and open it."""
        os.rename(path, self.path(index))
        old = self.files[index]
        self.files[index] = self._reopen(index)
        self._retire(old)

    def link_file(self, index: int, source: str) -> None:
        """Make the live name of bucket ``index`` a link to ``source`` (a checkpoint's file,
        loaded without a byte moved; the next write gives the bucket a new inode)."""
        link_over(source, self.path(index))
        old = self.files[index]
        self.files[index] = self._reopen(index)
        self._retire(old)

    def _retire(self, old: StateFile) -> None:
        self._retired_bytes_read += old.disk_bytes_read
        self._retired_bytes_written += old.disk_bytes_written
        old.close()

    def drop(self, replacing: Replacement) -> None:
        """Forget a new file that will not be installed: closed, and removed if it is ours."""
        replacing.file.close()
        if not replacing.linked and os.path.lexists(replacing.file.path):
            os.unlink(replacing.file.path)


def remove_created(files: list[StateFile]) -> None:
    """Unlink the files of ``files`` that their opening created: a failed setup or
    extension leaves no file it made."""
    for f in files:
        if f.created and os.path.exists(f.path):
            os.unlink(f.path)
