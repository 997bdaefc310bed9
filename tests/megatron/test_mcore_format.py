"""The streamed optimizer state in megatron-core's own ``fully_reshardable`` format, on CPU.

What runs for real: megatron-core 0.16.1's GPTModel and its sharded state dict, its
parallel state on gloo ranks, ``dist_checkpointing.save``/``load`` (torch_dist), stock's
DP range math and stock's own ``sharded_param_state_fully_reshardable`` metadata
construction, greenroom's BucketStore on real files. What stands in, and why: stock's
DistributedOptimizer cannot be built without CUDA, so the DDP buffer's layout and the
state stock would gather from it are laid out by ``mcore_support`` (see there), and the
comparison with stock is of the metadata and values it emits, not of its optimizer.
"""

import logging
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

from greenroom.cli.bench.host_memory import PeakAnon  # noqa: E402
from greenroom.errors import CheckpointError  # noqa: E402
from greenroom.io import compression  # noqa: E402
from greenroom.megatron import mcore_format as fmt  # noqa: E402
from greenroom.megatron import staging  # noqa: E402
from greenroom.megatron.save_strategy import StreamedSaveStrategy  # noqa: E402
from greenroom.megatron.staging import LoadViews, SaveViews  # noqa: E402
from greenroom.optim.store.bucket_store import BucketStore, Entry  # noqa: E402
from tests.megatron.mcore_support import (  # noqa: E402
    STATES,
    buffer_layout,
    dp_ranges,
    full_value,
    gpt,
    local_value,
    spawn,
    stock_stub,
    stock_world,
)


@pytest.fixture
def cpu_save():
    """Whether the ranks stub the two CUDA-only calls of megatron-core 0.16.1's torch_dist save
    (``mcore_support.stub_cuda_for_save``, there only when CUDA is absent)."""
    return not torch.cuda.is_available()


# -- pure parts ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 5), (2, 3, 2, 4)])
def test_boxes_cover_any_flat_range_exactly_once(shape):
    n = 1
    for d in shape:
        n *= d
    for start in range(n):
        for stop in range(start, n + 1):
            seen = torch.zeros(shape, dtype=torch.int64)
            flat = 0
            for first, offset, box in fmt.boxes(shape, start, stop):
                assert first == start + flat
                seen[tuple(slice(o, o + b) for o, b in zip(offset, box))] += 1
                flat += int(torch.tensor(box).prod())
            expect = torch.zeros(n, dtype=torch.int64)
            expect[start:stop] = 1
            assert torch.equal(seen.reshape(-1), expect), (start, stop)
            assert flat == stop - start


# -- (i) the keys, shapes, offsets and values stock emits --------------------------------
def _parity(rank, world, tp, dp):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model = gpt(tp, 1)
    msd = model.sharded_state_dict()
    index_map, padded = buffer_layout(model, msd, dp)
    stub = stock_stub(index_map, padded, stock_world(index_map, padded, msd))
    stock = DistributedOptimizer.sharded_param_state_fully_reshardable(stub, msd, False, {})
    stock_tensors: dict[str, list] = {}
    for sh in nested_values(stock):
        stock_tensors.setdefault(sh.key, []).append(sh)
    ours: dict[str, list] = {}
    world = stock_world(index_map, padded, msd)
    params = list(index_map)
    for r in range(dp):  # every DP rank's pieces, built here from stock's ranges for rank r
        slices = fmt.owned_slices(msd, dp_ranges(index_map, padded, dp, r))
        place = {s.param_index: index_map[params[s.param_index]][0] for s in slices}
        state = fmt.param_state(
            slices, lambda s, st: world[st][place[s.param_index] + s.start : place[s.param_index] + s.stop]
        )
        for sh in nested_values(state):
            ours.setdefault(sh.key, []).append(sh)
    assert set(ours) == set(stock_tensors), set(ours) ^ set(stock_tensors)
    for key, stock_list in stock_tensors.items():
        shape = tuple(stock_list[0].global_shape)
        covered = {}
        for name, tensors in (("stock", stock_list), ("ours", ours[key])):
            full, count = torch.zeros(shape), torch.zeros(shape, dtype=torch.int64)
            for sh in tensors:
                assert tuple(sh.global_shape) == shape and sh.dtype == torch.float32
                full[sh.global_slice()] = sh.data
                count[sh.global_slice()] += 1
            covered[name] = full, count
        (stock_full, stock_count), (our_full, our_count) = covered["stock"], covered["ours"]
        assert int(stock_count.max()) == 1 and torch.equal(our_count, stock_count), key
        assert torch.equal(our_full, stock_full), key
        for piece in ours[key]:
            p = stock_list[0].prepend_axis_num
            match = next(sh for sh in stock_list if sh.global_offset[:p] == piece.global_offset[:p])
            assert piece.replica_id == (*match.replica_id[:-1], 0) and piece.prepend_axis_num == 0


@pytest.mark.parametrize("tp,dp", [(1, 2), (1, 3), (2, 2)])
def test_our_pieces_tile_exactly_what_stock_fully_reshardable_emits(tp, dp):
    spawn(_parity, tp, tp, dp)


# -- (ii) resharding through dist_checkpointing, from and into real BucketStores ----------
def _rank_state(tp, pp, hidden=16):
    from megatron.core import parallel_state as ps

    model = gpt(tp, pp, hidden)
    msd = model.sharded_state_dict()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    index_map, padded = buffer_layout(model, msd, dp)
    slices = fmt.owned_slices(msd, dp_ranges(index_map, padded, dp, dp_rank))
    return slices


def _expected(s, state, moment_dtype):
    value = local_value(s.model, state)[s.start : s.stop]
    if state != "param" and moment_dtype == "bf16":
        value = value.bfloat16().float()
    return value


def _zstd():
    return {"compression": compression.resolve("zstd", cuda=False, chunk_bytes=4 << 20).codec, "chunk_bytes": 4 << 20}


def _store(slices, directory, moment_dtype, bucket_numel, compressed=False):
    entries = [Entry(name=s.model.key, shape=(s.numel,)) for s in slices]
    os.makedirs(directory)
    codec = _zstd() if compressed else {"chunk_bytes": 1 << 20}
    return BucketStore(entries, directory, bucket_numel=bucket_numel, moment_dtype=moment_dtype, **codec)


def _template(slices, views, moment_dtype):
    where = {s.param_index: i for i, s in enumerate(slices)}
    common = fmt.common_state([{"lr": 1e-3, "params": [0]}], 7, moment_dtype=moment_dtype)
    state = fmt.sharded_optimizer_state(
        common, fmt.param_state(slices, lambda s, st: views.entry(where[s.param_index], st))
    )
    if isinstance(views, SaveViews):
        views.own_maps(state)  # as dist_ckpt.sharded_state_dict hands its save over
        views.note_deferred(state)
    return state


def _save(rank, world, tp, pp, ckpt, work, moment_dtype, bucket_numel, decode_in_save=False):
    slices = _rank_state(tp, pp)
    store = _store(slices, os.path.join(work, f"save{rank}"), moment_dtype, bucket_numel, compressed=decode_in_save)
    states = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

    def fill(state):
        for name, attr in states.items():
            for k, view in zip(state.bucket.entries, state.views(getattr(state, attr))):
                view.copy_(_expected(slices[k], name, moment_dtype))

    store.overwrite(fill)
    stage = os.path.join(work, f"stage{rank}")
    views = SaveViews(store, stage, defer=decode_in_save)
    way = "defer" if decode_in_save else "decode" if moment_dtype != "fp32" else "link"
    assert views.ways[way] == len(store.buckets)
    strategy = StreamedSaveStrategy() if decode_in_save else None
    dist_checkpointing.save({"optimizer": _template(slices, views, moment_dtype)}, ckpt, sharded_strategy=strategy)
    if decode_in_save:  # written once: no fp32 file beside the frozen links, the items in greenroom's files
        assert all(name.endswith(".frozen") for name in os.listdir(stage)), os.listdir(stage)
        assert any(name.startswith(f"__{rank}_greenroom") for name in os.listdir(ckpt)), os.listdir(ckpt)
    views.close()
    store.close()


def _load(rank, world, tp, pp, ckpt, work, moment_dtype, bucket_numel):
    slices = _rank_state(tp, pp)
    store = _store(slices, os.path.join(work, f"load{rank}"), moment_dtype, bucket_numel)
    views = LoadViews(store, os.path.join(work, f"lstage{rank}"))
    template = _template(slices, views, moment_dtype)
    saved_common = dist_checkpointing.load_common_state_dict(ckpt)["optimizer"]
    fmt.check_saved(template, dist_checkpointing.load_tensors_metadata(ckpt), saved_common, ckpt)
    loaded = dist_checkpointing.load({"optimizer": template}, ckpt)["optimizer"]
    assert loaded["optimizer"]["param_groups"][0]["step"] == 7
    assert loaded["greenroom"]["moment_dtype"] == moment_dtype
    views.apply()
    for state in store.stream():
        for k, m, a, s in zip(
            state.bucket.entries,
            state.views(state.master),
            state.views(state.exp_avg),
            state.views(state.exp_avg_sq),
        ):
            for name, got in (("param", m), ("exp_avg", a), ("exp_avg_sq", s)):
                assert torch.equal(got.reshape(-1), _expected(slices[k], name, moment_dtype)), (slices[k], name)
    store.close()


def _stock_load(rank, world, tp, pp, ckpt):
    """Stock's own full-tensor template (its metadata construction, is_loading) reads the pieces."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model = gpt(tp, pp)
    msd = model.sharded_state_dict()
    index_map, padded = buffer_layout(model, msd, ps.get_data_parallel_world_size())
    world_tensors = {s: torch.zeros(padded) for s in STATES}
    stub = stock_stub(index_map, padded, world_tensors)
    template = DistributedOptimizer.sharded_param_state_fully_reshardable(stub, msd, True, {})
    loaded = dist_checkpointing.load({"optimizer": {"param_state": template}}, ckpt)["optimizer"]["param_state"]
    assert set(loaded) == set(template)
    for idx, states in loaded.items():
        for name, tensor in states.items():
            sh = template[idx][name]
            model_key = sh.key[len(f"optimizer.state.{name}.") :]
            want = full_value(model_key, name, tuple(sh.global_shape))[sh.global_slice()].reshape(-1)
            assert torch.equal(tensor.reshape(-1), want), sh.key


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_saved_at_tp1_dp2_resumes_at_other_layouts_bit_exact(disk_dir, cpu_save, moment_dtype):
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save, 2, 1, 1, ckpt, work, moment_dtype, 300, cpu_save=cpu_save)
    layouts = [(1, 1, 1), (4, 1, 1), (2, 2, 1), (4, 2, 2)] if moment_dtype == "fp32" else [(1, 1, 1), (2, 2, 1)]
    for world, tp, pp in layouts:
        spawn(
            _load, world, tp, pp, ckpt, os.path.join(work, f"w{world}t{tp}p{pp}"), moment_dtype, 300, cpu_save=cpu_save
        )
    if moment_dtype == "fp32":
        spawn(_stock_load, 2, 2, 1, ckpt, cpu_save=cpu_save)


def test_compressed_buckets_saved_through_the_streamed_strategy_resume_under_both_at_another_layout(disk_dir, cpu_save):
    """staging Note [decode in the save]: zstd-compressed bucket files saved at TP 1 x DP 2
    through StreamedSaveStrategy, written once, resume bit-exact under streaming at DP 1
    and under stock's own template at TP 2."""
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save, 2, 1, 1, ckpt, work, "fp32", 300, True, cpu_save=cpu_save)
    spawn(_load, 1, 1, 1, ckpt, os.path.join(work, "w1t1p1"), "fp32", 300, cpu_save=cpu_save)
    spawn(_stock_load, 2, 2, 1, ckpt, cpu_save=cpu_save)


def test_saved_at_tp2_dp2_resumes_at_tp1(disk_dir, cpu_save):
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save, 4, 2, 1, ckpt, work, "fp32", 500, cpu_save=cpu_save)
    spawn(_load, 2, 1, 1, ckpt, os.path.join(work, "w2"), "fp32", 500, cpu_save=cpu_save)


# -- (iii) bad input, and the host memory a save and a load take -------------------------
def _filled_store(directory, n=5000, moment_dtype="fp32", compression=None, chunk_bytes=1 << 20):
    os.makedirs(directory)
    store = BucketStore(
        [Entry(name=f"w{i}", shape=(n,)) for i in range(3)],
        directory,
        bucket_numel=2 * n,
        moment_dtype=moment_dtype,
        compression=compression,
        chunk_bytes=chunk_bytes,
    )
    store.overwrite(lambda state: [t.fill_(1.5) for t in (state.master, state.exp_avg, state.exp_avg_sq)])
    return store


def _flipped(rank, world, disk_dir):
    store = _filled_store(os.path.join(disk_dir, "s"))
    fd = os.open(store.path(0), os.O_WRONLY)
    os.pwrite(fd, b"\x7f", 4100)
    os.close(fd)
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        SaveViews(store, os.path.join(disk_dir, "stage"))
    assert "\n" not in str(e.value)
    assert os.listdir(os.path.join(disk_dir, "stage")) == []  # nothing left behind
    store.close()


def _missing(rank, world, disk_dir):
    store = _filled_store(os.path.join(disk_dir, "s"))
    os.unlink(store.path(1))
    with pytest.raises(CheckpointError, match=r"bucket-00001.bin: bucket file missing") as e:
        SaveViews(store, os.path.join(disk_dir, "stage"))
    assert "\n" not in str(e.value)
    store.close(write_back=False)


def _own(rank, world, disk_dir):
    store = _filled_store(os.path.join(disk_dir, "s"))
    store.overwrite(lambda state: state.master.copy_(torch.arange(state.master.numel(), dtype=torch.float32)))
    views = SaveViews(store, os.path.join(disk_dir, "stage"))
    flat = views.entry(1, "param")
    own = views.own(flat[7:107].view(10, 10))
    assert torch.equal(own, flat[7:107].view(10, 10))
    assert own.untyped_storage().nbytes() == own.nbytes == 400
    other = torch.ones(3)
    assert views.own(other) is other  # not of this save's maps: as it is
    with pytest.raises(CheckpointError, match=r"bucket-00000.bin.frozen: a save asked for a non-contiguous view") as e:
        views.own(flat[0:10:2])
    assert "\n" not in str(e.value)
    views.close()
    store.close()


def _said(rank, world, disk_dir):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("greenroom.megatron.staging")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for name, kwargs in (("fp32", {}), ("bf16", {"moment_dtype": "bf16"}), ("zstd", _zstd())):
        store = _filled_store(os.path.join(disk_dir, name), **kwargs)
        views = SaveViews(store, os.path.join(disk_dir, f"stage-{name}"))
        said = [r.getMessage() for r in records]
        records.clear()
        if name == "fp32":
            assert views.ways == {"link": 2, "copy": 0, "decode": 0, "defer": 0} and said == []
        else:
            held = "bf16 moments" if name == "bf16" else "zstd frames"
            # 2 buckets of [master | exp_avg | exp_avg_sq] fp32: 10000 + 5000 elements each
            assert said == [
                f"{os.path.join(disk_dir, f'stage-{name}')}: 2 of 2 bucket files hold {held}, so this save "
                "decoded them into 180.0 KB of fp32 files that megatron's writer then writes again into the "
                "checkpoint; saved with sharded_strategy=greenroom.megatron.StreamedSaveStrategy() and metadata "
                "{'greenroom_decode_in_save': True} they are written once, and the sidecar format "
                "(metadata {'distrib_optim_sharding_type': 'greenroom_streamed'}) saves the bucket files as they are"
            ], said
        views.close()
        store.close()
    # Asked to defer where the filesystem refuses the link: decoded, and said why not deferred.
    staging.link_new = lambda src, dst: False
    store = _filled_store(os.path.join(disk_dir, "nolink"), **_zstd())
    views = SaveViews(store, os.path.join(disk_dir, "stage-nolink"), defer=True)
    assert views.ways["decode"] == 2 and views.ways["defer"] == 0
    assert [r.getMessage() for r in records] == [
        f"{os.path.join(disk_dir, 'stage-nolink')}: 2 of 2 bucket files hold zstd frames, so this save decoded "
        "them into 180.0 KB of fp32 files that megatron's writer then writes again into the checkpoint, since "
        "they could not be left to StreamedSaveStrategy (a master stored as a remainder, or a bucket file that "
        "takes no hard link here)"
    ]
    views.close()
    store.close()


def _deferred_save(rank, world, disk_dir, case):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    store = _filled_store(os.path.join(disk_dir, "s"), **_zstd())
    views = SaveViews(store, os.path.join(disk_dir, "stage"), defer=True)
    state = {
        f"w{i}": ShardedTensor.from_rank_offsets(f"opt.w{i}", views.entry(i, "param"), replica_id=0)
        for i in range(len(store.entries))
    }
    views.note_deferred(state)
    ckpt = os.path.join(disk_dir, "ckpt")
    os.makedirs(ckpt)
    if case == "stepped":  # the store writes a new inode while the frozen name holds the old one
        store.overwrite(lambda s: s.master.add_(1.0))
        with pytest.raises(CheckpointError, match=r"bucket-00000.bin: bucket 0 changed since sharded_state_dict\(\)"):
            dist_checkpointing.save(state, ckpt, sharded_strategy=StreamedSaveStrategy())
    elif case == "released":
        views.close()
        with pytest.raises(CheckpointError, match=r"opt.w0 at \[0\]: a meta tensor in the save that no open"):
            dist_checkpointing.save(state, ckpt, sharded_strategy=StreamedSaveStrategy())
    else:  # stock's strategy cannot copy what it was not given: it fails, and writes no tensor file
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
            dist_checkpointing.save(state, ckpt)
    assert not [name for name in os.listdir(ckpt) if name.endswith(".distcp")], os.listdir(ckpt)
    views.close()
    store.close()


@pytest.mark.parametrize("case", ["stepped", "released", "stock"])
def test_a_deferred_save_is_refused_after_a_step_after_a_release_and_by_stock(disk_dir, cpu_save, case):
    """A deferred bucket is decoded from the live file at the save: a step between
    sharded_state_dict() and the save, or a release of it, is refused in one line; stock's
    strategy, handed the meta tensors, fails rather than write what it could not read."""
    spawn(_deferred_save, 1, disk_dir, case, cpu_save=cpu_save)


# In a rank of their own, as every test here: no store of theirs lives in the pytest process.
def test_a_flipped_bit_in_a_bucket_file_is_refused_at_the_save_in_one_line(disk_dir):
    spawn(_flipped, 1, disk_dir)


def test_a_missing_bucket_file_is_refused_at_the_save_in_one_line(disk_dir):
    spawn(_missing, 1, disk_dir)


def test_a_save_that_decodes_says_what_it_writes_twice_and_the_format_that_does_not(disk_dir):
    """A save of bucket files that are not fp32 tensors (narrow moments, compressed frames)
    writes the state's fp32 values twice; it says so in one line, with the two ways to
    write them once, or, asked to defer where links are refused, why it could not. A save
    of fp32 files links them and says nothing."""
    spawn(_said, 1, disk_dir)


def test_a_saved_tensor_maps_only_its_own_bytes_and_a_strided_one_is_refused(disk_dir):
    """staging Note [a save's own maps]: the same values, a storage of exactly the tensor's
    bytes; a strided view, which no format cuts, in one line."""
    spawn(_own, 1, disk_dir)


def _other_model(rank, world, ckpt, work):
    slices = _rank_state(1, 1, hidden=32)
    store = _store(slices, os.path.join(work, "other"), "fp32", 300)
    views = LoadViews(store, os.path.join(work, "ostage"))
    template = _template(slices, views, "fp32")
    try:
        fmt.check_saved(
            template,
            dist_checkpointing.load_tensors_metadata(ckpt),
            dist_checkpointing.load_common_state_dict(ckpt)["optimizer"],
            ckpt,
        )
    except CheckpointError as e:
        assert "\n" not in str(e) and "a checkpoint of another model" in str(e), e
    else:
        raise AssertionError("a checkpoint of another model was not refused")
    views.close()
    store.close()


def test_a_checkpoint_of_another_model_is_refused_before_the_load(disk_dir, cpu_save):
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save, 1, 1, 1, ckpt, work, "fp32", 300, cpu_save=cpu_save)
    spawn(_other_model, 1, ckpt, os.path.join(work, "o"), cpu_save=cpu_save)


def _memory(rank, world, ckpt, work, out):
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    slices = _rank_state(1, 1, hidden=256)
    store = _store(slices, os.path.join(work, "mem"), "fp32", 50_000)
    store.overwrite(lambda state: [t.fill_(0.25) for t in (state.master, state.exp_avg, state.exp_avg_sq)])
    strategy = get_default_save_sharded_strategy("torch_dist")
    strategy.thread_count = 1  # the write in this process, so that its memory is measured here
    with PeakAnon() as saved:
        views = SaveViews(store, os.path.join(work, "stage"))
        template = _template(slices, views, "fp32")
        for sh in nested_values(template):  # nothing megatron's writer would clone (staging Note [a save's own maps])
            if isinstance(sh, ShardedTensor):
                assert sh.data.untyped_storage().nbytes() == sh.data.nbytes, sh.key
        dist_checkpointing.save({"optimizer": template}, ckpt, sharded_strategy=strategy)
    views.close()
    load = _store(slices, os.path.join(work, "mem2"), "fp32", 50_000)
    with PeakAnon() as loaded:
        lviews = LoadViews(load, os.path.join(work, "lstage"))
        dist_checkpointing.load({"optimizer": _template(slices, lviews, "fp32")}, ckpt)
        lviews.apply()
    saved, loaded = saved.peak, loaded.peak
    with open(out, "w") as f:
        f.write(f"{store.state_bytes} {max(b.file_bytes for b in store.buckets)} {saved} {loaded}")


def _measure(disk_dir, cpu_save):
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    out = os.path.join(disk_dir, "mem.txt")
    spawn(_memory, 1, ckpt, work, out, cpu_save=cpu_save)
    state, bucket, saved, loaded = map(int, open(out).read().split())
    print(f"state {state} B, bucket {bucket} B, peak anon growth: save {saved} B, load {loaded} B")
    return state, bucket, saved, loaded


def test_save_and_load_hold_about_a_bucket_of_anonymous_memory(disk_dir, cpu_save):
    """Every tensor dist_checkpointing reads or fills is a file-backed map (page cache,
    which the kernel reclaims), and no saved tensor is one megatron's writer clones
    (staging Note [a save's own maps]); what remains anonymous is the store's own: on
    this CPU run its device buffers are host memory (a bucket each as it is used) and the
    engine's 1 MiB staging chunk. Bound on the peak while each runs: two of the largest
    bucket files plus 2 MiB, which is under half this rank's 19.5 MB state (measured
    peaks: save 1.2 MB, load 5.4 MB, bucket 3.1 MB; a save of views of the bucket maps
    peaked at 15.8 MB, the writer's clones of them)."""
    state, bucket, saved, loaded = _measure(disk_dir, cpu_save)
    bound = 2 * bucket + (2 << 20)
    assert bound < state / 2
    assert saved < bound and loaded < bound
