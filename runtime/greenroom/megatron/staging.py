"""The streamed state as file-backed fp32 tensors, for ``dist_checkpointing`` to save and load.

``mcore_format`` and ``dp_format`` say which elements of which key each DP rank writes;
this module gives them data without holding the rank's state in host memory.

Save (``SaveViews``): between steps, each bucket file is frozen into a staging dir, by a
hard link where the filesystem takes one (the store never writes a shared inode in
place, ``optim.store.files`` Note [new inodes], so the next step cannot change what the
save is still reading, async save included), else by a copy; and its fp32 segments are
memory-mapped privately (``torch.from_file``, copy-on-write, never written). Each entry's
master and moments are views of those maps at the entry's offset: reading them reads the
file through the page cache, which the kernel reclaims; no anonymous copy exists. The
tensors finally handed to ``dist_checkpointing`` are re-mapped by ``own`` so that each
one's storage is exactly its own bytes (Note [a save's own maps]).
Before a view is handed out its bytes are checked against the bucket's checksums (a
link is read once for it, a copy is checked as it is made), so a flipped bit is refused
in one line and never written into the checkpoint. A bucket whose bytes are not fp32
tensors (16-bit or fp8 moments, compressed frames, masters stored as a remainder) is
decoded through the store, one bucket at a time, into a temporary fp32 file of its own,
which is then mapped the same way: the checkpoint holds the fp32 values the stored bytes
denote, and the host holds one bucket at a time. Those fp32 bytes are written twice (the
file, then megatron's writer), which a save that decodes says in one log line. Unless the
save is ``save_strategy.StreamedSaveStrategy``'s: then such a bucket is frozen by a link
and handed out as a meta tensor, which that strategy decodes and writes into the
checkpoint itself (Note [decode in the save]).

Load (``LoadViews``): one staging file per bucket, ``[master | exp_avg | exp_avg_sq]``
fp32, mapped shared; the template's tensors are views of it, and ``dist_checkpointing.load``
fills them in place (the file, not the heap). ``apply`` then writes the store's buckets
one at a time through ``BucketStore.overwrite`` (encoded to the store's moment dtype,
written with checksums by the engine, synced); nothing of the live state changes before
``apply``, so a load that fails in ``dist_checkpointing`` leaves the run's state as it was.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import numpy
import torch

from greenroom.errors import CheckpointError, IntegrityError, StorageError
from greenroom.io.engine import verify_mapped
from greenroom.log import get_logger
from greenroom.optim.checkpoint.filecopy import FileSums, copy_file
from greenroom.optim.store.bucket_store import BucketStore
from greenroom.optim.store.hardlink import link_new
from greenroom.units import size_text

SEGMENTS = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
F32 = torch.float32.itemsize
SIDECAR_METADATA = "{'distrib_optim_sharding_type': 'greenroom_streamed'}"
DECODE_IN_SAVE = "greenroom_decode_in_save"
"""The metadata key of a save through ``save_strategy.StreamedSaveStrategy``."""

log = get_logger(__name__)

_DEFERRED: weakref.WeakSet[SaveViews] = weakref.WeakSet()
"""The open saves with buckets left to ``StreamedSaveStrategy`` (Note [decode in the save])."""


def deferred_source(key: tuple) -> tuple[SaveViews, int, int, int]:
    """``(views, bucket index, start, numel)`` of the ShardedTensor saved under ``key``,
    ``(key, global offset)``, in an open save's deferred buckets; one line if none has it."""
    for views in list(_DEFERRED):
        got = views.items.get(key)
        if got is not None:
            return (views, *got)
    raise CheckpointError(
        f"{key[0]} at {list(key[1])}: a meta tensor in the save that no open streamed save handed out; "
        "its sharded_state_dict() was released by a step, save, load or close since: call it again and save "
        "what it returns"
    )


def _raw_fp32(store: BucketStore, index: int) -> bool:
    """Whether bucket ``index``'s file holds its master and moments as plain fp32 tensors."""
    bucket = store.buckets[index]
    return (
        store.compression is None
        and bucket.master is not None
        and not bucket.remainder
        and store.avg_codec.identity
        and store.sq_codec.identity
        and store.avg_codec.dtype == torch.float32
        and store.sq_codec.dtype == torch.float32
    )


def _fp32_starts(bucket) -> dict[str, int]:
    """Each state the bucket stores -> its element offset in the bucket's fp32 layout,
    ``[master | exp_avg | exp_avg_sq]``, a state of ``bucket.numel`` elements each."""
    names = [state for state, seg in SEGMENTS.items() if getattr(bucket, seg) is not None]
    return {name: n * bucket.numel for n, name in enumerate(names)}


def _map(path: str, numel: int, *, shared: bool) -> torch.Tensor:
    return torch.from_file(path, shared=shared, size=numel, dtype=torch.float32)


def _place(directory: str) -> str:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return directory


def _missing(src: str) -> CheckpointError:
    return CheckpointError(f"{src}: bucket file missing: it was deleted since the step wrote it; nothing was saved")


def _fresh(path: str) -> str:
    if os.path.lexists(path):
        os.unlink(path)  # our own name, left by a save or load that was killed
    return path


class _Views:
    """Per bucket: a flat fp32 map and each state's element offset in it."""

    def __init__(self, store: BucketStore, directory: str) -> None:
        self.store = store
        self.directory = _place(directory)
        self.made: list[str] = []
        self.maps: dict[int, torch.Tensor] = {}
        self.starts: dict[int, dict[str, int]] = {}
        self.where = {i: (b.index, k) for b in store.buckets for k, i in enumerate(b.entries)}

    def entry(self, i: int, state: str) -> torch.Tensor:
        """Store entry ``i``'s ``state`` (``param``, ``exp_avg``, ``exp_avg_sq``) as a flat fp32 view."""
        index, k = self.where[i]
        start = self.starts[index].get(state)
        if start is None:
            raise CheckpointError(f"{self.store.path(index)}: bucket {index} stores no {SEGMENTS[state]}")
        bucket = self.store.buckets[index]
        first = start + bucket.offsets[k]
        return self.maps[index][first : first + self.store.entries[i].numel]

    def close(self) -> None:
        """Drop the maps and remove the files this object made (the dir stays)."""
        self.maps.clear()
        for path in self.made:
            if os.path.lexists(path):
                os.unlink(path)
        self.made.clear()


class SaveViews(_Views):
    """The store's state, frozen and mapped for one save (see the module docstring).
    Keep it open until the save (an async one: its writer) is over, then ``close``."""

    def __init__(self, store: BucketStore, directory: str, *, verify: bool = True, defer: bool = False) -> None:
        super().__init__(store, directory)
        self.ways: dict[str, int] = {"link": 0, "copy": 0, "decode": 0, "defer": 0}
        self.paths: dict[int, str] = {}  # each bucket's mapped file
        self.deferred: dict[int, str] = {}  # bucket index -> its frozen link, decoded by the save itself
        self.items: dict[tuple, tuple[int, int, int]] = {}  # (key, global offset) -> (bucket, start, numel)
        store.flush()  # the cached buckets' files are stale until written out (Note [host cache])
        try:
            for bucket in store.buckets:
                if _raw_fp32(store, bucket.index):
                    self._freeze(bucket, verify)
                elif not (defer and self._defer(bucket)):
                    self._decode(bucket)
        except BaseException:
            self.close()
            raise
        self._files = {
            m.untyped_storage().data_ptr(): self.paths[i] for i, m in self.maps.items() if i not in self.deferred
        }
        if self.ways["decode"]:
            self._say_decoded(defer)

    def _frozen_name(self, src: str) -> str:
        return _fresh(os.path.join(self.directory, os.path.basename(src) + ".frozen"))

    def _freeze(self, bucket, verify: bool) -> None:
        store, index = self.store, bucket.index
        src = store.path(index)
        dst = self._frozen_name(src)
        try:
            linked = link_new(src, dst)
            if linked:
                self.made.append(dst)
            else:
                self.made.append(dst)
                sums = FileSums(store.files[index], expect=True) if verify and store.engine.verify else None
                copy_file(src, dst, bucket.file_bytes, check=sums.add if sums else None)
                if sums is not None:
                    sums.verify()
        except FileNotFoundError:
            raise _missing(src) from None
        except (IntegrityError, StorageError) as e:
            raise CheckpointError(f"{e}") from None
        mapped = _map(dst, bucket.data_bytes // F32, shared=False)
        if linked and verify and store.engine.verify:
            try:  # the link shares the live inode: read it once against the checksums the step recorded
                verify_mapped(store.files[index], mapped.view(torch.uint8))
            except IntegrityError as e:
                raise CheckpointError(f"{e}") from None
        self.ways["link" if linked else "copy"] += 1
        self.maps[index], self.paths[index] = mapped, dst
        self.starts[index] = {
            state: getattr(bucket, seg).offset // F32
            for state, seg in SEGMENTS.items()
            if getattr(bucket, seg) is not None
        }

    # Note [decode in the save]
    # A bucket file that is not fp32 tensors (compressed frames, narrow moments) has no
    # bytes a save could map. Decoded into an fp32 file first, its state is written twice:
    # that file, then megatron's writer copies it into the checkpoint. With
    # StreamedSaveStrategy (save_strategy.py) the save writes it once: here the bucket is
    # only frozen, by a link (the step after it writes a new inode, Note [new inodes]), and
    # each state is a meta tensor of its fp32 layout, which carries the shape and dtype
    # megatron plans with and no data. The strategy finds each planned item of a meta
    # tensor by its key and global offset (``note_deferred``), decodes one bucket at a
    # time through the store, checksums verified, and writes its items into a file of the
    # checkpoint with megatron's own item writer. A bucket is decoded from the live file,
    # so the strategy first checks that it is still the frozen inode: a step in between is
    # refused in one line. Any other save strategy meets the meta tensors when it copies
    # them to the host, and fails there (torch: "Cannot copy out of meta tensor") rather
    # than writing what it could not read.
    def _defer(self, bucket) -> bool:
        """Freeze ``bucket`` by a link and map its fp32 layout as a meta tensor (Note
        [decode in the save]); False where it must be decoded now instead: a master stored
        as a remainder, or a file that takes no link."""
        store, index = self.store, bucket.index
        if bucket.remainder or bucket.master is None:
            return False
        src = store.path(index)
        dst = self._frozen_name(src)
        try:
            if not link_new(src, dst):
                return False
        except FileNotFoundError:
            raise _missing(src) from None
        self.made.append(dst)
        self.starts[index] = _fp32_starts(bucket)
        self.maps[index] = torch.empty(len(self.starts[index]) * bucket.numel, dtype=torch.float32, device="meta")
        self.paths[index] = self.deferred[index] = dst
        self.ways["defer"] += 1
        return True

    def note_deferred(self, sharded_state_dict) -> None:
        """Note which deferred bucket elements each ShardedTensor of ``sharded_state_dict``
        on a deferred bucket reads, by its key and global offset, for the save strategy;
        call it on what goes to ``dist_checkpointing.save``."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        bases = {id(m): i for i, m in self.maps.items() if i in self.deferred}
        for sh in nested_values(sharded_state_dict):
            if not isinstance(sh, ShardedTensor) or sh.data.device.type != "meta":
                continue
            index = bases.get(id(sh.data if sh.data._base is None else sh.data._base))
            if index is None or not sh.data.is_contiguous():
                raise CheckpointError(f"{sh.key}: a meta tensor that is not a contiguous view of a deferred bucket")
            self.items[(sh.key, tuple(sh.global_offset))] = (index, sh.data.storage_offset(), sh.data.numel())
        if self.items:
            _DEFERRED.add(self)

    @contextlib.contextmanager
    def decoded(self, index: int):
        """Deferred bucket ``index`` decoded through the store while the block runs; it
        yields ``get(start, numel)``, which copies elements ``[start, start + numel)`` of
        the bucket's fp32 layout into a host tensor of their own."""
        store, frozen, live = self.store, self.deferred[index], self.store.path(index)
        try:
            same = os.stat(frozen).st_ino == os.stat(live).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise CheckpointError(
                f"{live}: bucket {index} changed since sharded_state_dict() (a step ran before the save); "
                "call sharded_state_dict() again and save what it returns"
            )
        numel, starts = store.buckets[index].numel, self.starts[index]
        states = store.stream([index])
        try:
            state = next(states)
            parts = {"param": state.master, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq}

            def get(start: int, count: int) -> torch.Tensor:
                name, first = max(((n, f) for n, f in starts.items() if f <= start), key=lambda nf: nf[1])
                assert start + count <= first + numel, (index, start, count)  # one state of one entry
                return parts[name][start - first : start - first + count].detach().to("cpu", torch.float32, copy=True)

            yield get
        except (IntegrityError, StorageError) as e:
            raise CheckpointError(f"{e}") from None
        finally:
            states.close()  # nothing changed: closing before the write-back skips it

    def _say_decoded(self, deferring: bool) -> None:
        """One line per save that decoded: the second write it costs and the ways without it."""
        store = self.store
        held = [f"{store.compression.name} frames"] if store.compression is not None else []
        if store.moment_dtype != "fp32":
            held.append(f"{store.moment_dtype} moments")
        if any(b.remainder for b in store.buckets):
            held.append("masters as remainders")
        held = held or ["bytes other than fp32 tensors"]
        decoded = sum(
            self.maps[b.index].numel() * F32
            for b in store.buckets
            if not _raw_fp32(store, b.index) and b.index not in self.deferred
        )
        said = (
            f"{self.directory}: {self.ways['decode']} of {len(store.buckets)} bucket files hold "
            f"{' and '.join(held)}, so this save decoded them into {size_text(decoded)} of fp32 files "
            "that megatron's writer then writes again into the checkpoint"
        )
        if deferring:  # asked to leave them to StreamedSaveStrategy, which these could not be
            log.info(
                f"{said}, since they could not be left to StreamedSaveStrategy (a master stored as a "
                "remainder, or a bucket file that takes no hard link here)"
            )
            return
        log.info(
            f"{said}; saved with "
            "sharded_strategy=greenroom.megatron.StreamedSaveStrategy() and metadata "
            f"{{'{DECODE_IN_SAVE}': True}} they are written once, and the sidecar format "
            f"(metadata {SIDECAR_METADATA}) saves the bucket files as they are"
        )

    def _decode(self, bucket) -> None:
        store, index = self.store, bucket.index
        path = _fresh(os.path.join(self.directory, os.path.basename(store.path(index)) + ".f32"))
        self.made.append(path)
        states = store.stream([index])
        try:
            state = next(states)
            parts = {"param": state.master, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq}
            starts, cursor = {}, 0
            with open(path, "wb") as f:
                for name, tensor in parts.items():
                    if tensor is None:
                        continue
                    host = tensor[: bucket.numel].detach().to("cpu", torch.float32).contiguous()
                    f.write(memoryview(host.numpy()))
                    starts[name], cursor = cursor, cursor + bucket.numel
        except (IntegrityError, StorageError) as e:
            raise CheckpointError(f"{e}") from None
        finally:
            states.close()  # nothing changed: closing before the write-back skips it
        self.ways["decode"] += 1
        self.maps[index], self.paths[index] = _map(path, cursor, shared=False), path
        self.starts[index] = starts

    # Note [a save's own maps]
    # megatron-core's torch_dist writer (FileSystemWriterAsync.prepare_write_data) clones
    # every CPU tensor whose storage is larger than the tensor, before any byte is written,
    # because torch.save writes a tensor's whole storage. A view of a bucket's map is such
    # a tensor: handed over as it is, the save would copy the rank's whole state into
    # anonymous memory at once. So each tensor the save gets is a map of its own: the same
    # file bytes, mapped copy-on-write at the tensor's offset, its storage exactly its
    # bytes. The writer then neither clones it nor writes more than it.
    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, a contiguous view of one of this save's maps, as a map of only its
        own bytes of the same file; any other tensor as it is."""
        path = self._files.get(tensor.untyped_storage().data_ptr())
        if path is None or tensor.numel() == 0:
            return tensor
        if not tensor.is_contiguous():
            raise CheckpointError(f"{path}: a save asked for a non-contiguous view of the bucket map")
        flat = numpy.memmap(
            path,
            dtype=numpy.float32,
            mode="c",
            offset=tensor.storage_offset() * F32,
            shape=(tensor.numel(),),
        )
        return torch.from_numpy(flat).view(tensor.shape)

    def close(self) -> None:
        _DEFERRED.discard(self)
        self.items.clear()
        self.deferred.clear()
        self._files = {}
        super().close()

    def own_maps(self, sharded_state_dict) -> None:
        """Every ShardedTensor of ``sharded_state_dict`` whose data views this save's maps
        re-backed by ``own``: call it on what goes to ``dist_checkpointing.save``."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                sh.data = self.own(sh.data)


class LoadViews(_Views):
    """Staging for one load: ``entry`` gives the tensors the template hands
    ``dist_checkpointing.load``; ``apply`` writes what it filled into the store."""

    def __init__(self, store: BucketStore, directory: str) -> None:
        super().__init__(store, directory)
        try:
            for bucket in store.buckets:
                starts = _fp32_starts(bucket)
                path = _fresh(os.path.join(self.directory, f"load-{bucket.index:05d}.f32"))
                self.made.append(path)
                with open(path, "wb") as f:
                    f.truncate(len(starts) * bucket.numel * F32)  # sparse: pages only where the load writes
                self.maps[bucket.index] = _map(path, len(starts) * bucket.numel, shared=True)
                self.starts[bucket.index] = starts
        except BaseException:
            self.close()
            raise

    def apply(self) -> None:
        """Write the loaded state into the store, bucket by bucket, then drop the staging."""
        store = self.store
        for bucket in store.buckets:
            index = bucket.index

            def fill(state, index=index) -> None:
                flat = self.maps[index]
                for name, target in (
                    ("param", state.master),
                    ("exp_avg", state.exp_avg),
                    ("exp_avg_sq", state.exp_avg_sq),
                ):
                    if target is not None:
                        start = self.starts[index][name]
                        target[: state.bucket.numel].copy_(flat[start : start + state.bucket.numel])

            store.overwrite(fill, [index])
            del self.maps[index]
        self.close()
