"""A checkpoint written by the step's own streaming pass: no extra read, no extra pass.

``opt.checkpoint_next_step(path)`` stages ``path`` (``greenroom.io.publish.stage``: the
previous checkpoint stays until this one is complete) and preallocates one new file per
bucket in ``path.new``, so running out of space is refused before the step changes
anything. The next ``opt.step()`` streams as always, and each bucket, once updated,
reaches its checkpoint file one of two ways:

- by a link (where the state dir and the checkpoint share a filesystem that takes hard
  links: ext4, XFS, btrfs): the step writes the bucket in place as any step does (its
  live inode has no other name), and once written, the checkpoint's name is made a link
  to the live file (``link_live``). Where the live inode is shared (the previous
  checkpoint was one step ago, or a user's ``cp -l`` backup), the step writes the
  bucket to the checkpoint's new file instead and the live name is made a link to it
  (``optim.store.files`` Note [new inodes]). The checkpoint costs no byte read or
  written; the next step writes those buckets to new inodes, never into the checkpoint's.
- by a second write (links refused: another filesystem, EXDEV; a filesystem or policy
  that forbids them, EPERM): from the engine's staging buffer, on its way to the live
  file, the same bytes and checksum table go to the checkpoint file too
  (``TransferEngine.write(mirror=...)``), overlapped with the step's own I/O. Said once
  in the log.

After the step's pass: a bucket the step did not stream (no grads) is linked from its
live file where links work, else copied (the only reads, counted in
``extra_bytes_read``); a bucket in the host cache is written from host memory; then
``resident.pt``, the manifest and the publish, as ``save_checkpoint`` ends
(``manifest.finish_checkpoint``). The manifest records each bucket file's size and
the CRC-32 of its checksum table; a load verifies the table against that and every
byte against the table, before it reads a byte of state.

A kill at any point leaves the previous checkpoint at ``path`` as it was: its files are
never written (a live name that shares one of its inodes gets a new inode before any
write), the staged dir has no generation record until the publish writes it, and the
next save or load discards it. The live files are those of any step killed midway: a
bucket given a new inode is whole (the step's or the one before), one caught mid-write
in place may be torn and is refused by its checksums if read (the live dir belongs to
the killed process and is wiped by the next run, ``greenroom.dirs.rankdir``). An error during
the step discards the staged dir and raises as the step would.
"""

from __future__ import annotations

import os
import time

from greenroom.errors import ConfigError
from greenroom.faults import kill_point
from greenroom.io import publish
from greenroom.io.engine import StateFile, verify_default
from greenroom.log import get_logger
from greenroom.optim.checkpoint.checks import table_crc32
from greenroom.optim.checkpoint.filecopy import copy_file
from greenroom.optim.checkpoint.manifest import finish_checkpoint
from greenroom.optim.store.hardlink import link_over, links_work

log = get_logger(__name__)
_said_copies: set[tuple[int, int]] = set()  # (state dir's st_dev, checkpoint dir's st_dev) already logged


class InStepCheckpoint:
    """The checkpoint the next step of ``opt`` writes at ``path`` (see the module docstring)."""

    def __init__(self, opt, path: str) -> None:
        if not verify_default():
            raise ConfigError(
                "an in-step checkpoint records the bucket files' checksum tables, which "
                "GREENROOM_VERIFY=0 leaves empty: checkpoint with verification on"
            )
        self.opt = opt
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        self.tmp, said = publish.stage(self.path)
        if said:
            log.warning(f"{self.path}: {said}")
        self.files: list[StateFile] = []
        self.mirrored: set[int] = set()
        self._tables: dict[int, str] = {}  # a linked live file's table CRC-32 (``link_live``)
        self.extra_bytes_read = 0
        self._written = 0
        self.publish_seconds = 0.0
        store = opt.store
        try:
            self.links = bool(store.buckets) and links_work(store.path(0), self.tmp)
            if store.buckets and not self.links:
                self._say_copies()
            for bucket in store.buckets:
                self.files.append(store.open_copy(bucket.index, self._file_path(bucket.index)))
        except BaseException:
            self.abandon()
            raise

    @property
    def mode(self) -> str:
        """``link`` or ``write`` (twice): how the step's buckets reach the checkpoint."""
        return "link" if self.links else "write"

    def _say_copies(self) -> None:
        key = (os.stat(self.opt.store.directory).st_dev, os.stat(self.tmp).st_dev)
        if key not in _said_copies:
            _said_copies.add(key)
            log.warning(
                f"{self.path}: the checkpoint dir cannot hold hard links to the bucket files in "
                f"{self.opt.store.directory} (another filesystem, or links refused), so a step that "
                "checkpoints writes every bucket twice; put the checkpoint on the state dir's "
                "filesystem to checkpoint by links, at no extra I/O"
            )

    def _file_path(self, index: int) -> str:
        return os.path.join(self.tmp, os.path.basename(self.opt.store.path(index)))

    def bucket_file(self, index: int) -> StateFile | None:
        """The checkpoint's file of bucket ``index`` for ``BucketStore.stream`` (None for a
        cached bucket: it goes to its host memory, and is written from there at the end)."""
        if index in self.opt.store.host_cache:
            return None
        self.mirrored.add(index)
        kill_point("instep-bucket")
        return self.files[index]

    def link_live(self, index: int) -> None:
        """Bucket ``index``'s live file holds the step's result, written in place: the
        checkpoint's name becomes a link to it, replacing the file preallocated for it."""
        store = self.opt.store
        self.files[index].close()
        link_over(store.path(index), self.files[index].path)
        self._tables[index] = store.files[index].table_crc32
        kill_point("bucket-linked")

    @property
    def extra_bytes_written(self) -> int:
        """Bytes written to the checkpoint's bucket files (after compression) beyond what
        the step writes anyway: a linked bucket's file is the step's own write."""
        return self._written + sum(
            f.disk_bytes_written for i, f in enumerate(self.files) if not (self.links and i in self.mirrored)
        )

    def publish(self) -> None:
        """After the step that wrote it: the rest of the checkpoint and its publish, or,
        if that fails, nothing of it left (the previous checkpoint stays)."""
        try:
            self._finish()
        except BaseException:
            self.abandon()
            raise

    def _finish(self) -> None:
        store = self.opt.store
        store.engine.drain()
        kill_point("instep-streamed")
        start = time.perf_counter()
        pending = []
        for bucket in store.buckets:
            if bucket.index in self.mirrored:
                continue
            if bucket.index in store.host_cache:
                pending.append(store.write_cached(bucket.index, self.files[bucket.index]))
        for transfer in pending:
            transfer.wait()
        files = {}
        written = self.extra_bytes_written
        for bucket, f in zip(store.buckets, self.files):
            name = os.path.basename(f.path)
            f.close()
            if bucket.index in self.mirrored or bucket.index in store.host_cache:
                files[name] = {
                    "bytes": bucket.file_bytes,
                    "table_crc32": self._tables.get(bucket.index) or f.table_crc32,
                }
            elif self.links:  # not streamed this step: its live file is the state, linked
                os.unlink(f.path)
                os.link(store.path(bucket.index), f.path)
                files[name] = {"bytes": bucket.file_bytes, "table_crc32": table_crc32(store, bucket.index, f.path)}
                self.extra_bytes_read += bucket.file_bytes - bucket.data_bytes  # the table only
            else:  # not streamed, no links: copied (the only read)
                files[name] = {
                    "bytes": bucket.file_bytes,
                    "crc32": copy_file(store.path(bucket.index), f.path, bucket.file_bytes),
                }
                self.extra_bytes_read += bucket.file_bytes
                written += bucket.file_bytes
        self._written = written
        self.files = []
        finish_checkpoint(self.opt, self.path, self.tmp, files)
        self.publish_seconds = time.perf_counter() - start

    def abandon(self) -> None:
        """Close the files and discard the staged dir: the previous checkpoint stays."""
        for f in self.files:
            f.close()
        self.files = []
        if os.path.isdir(self.tmp):
            publish.discard(self.tmp)
