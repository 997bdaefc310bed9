"""``python -m greenroom.cli.bench.megatron``'s flags: its run needs CUDA (the GPU machine,
docs/benchmarks.md), so here only what it refuses before it starts: a bad ``--checkpoint``
is the usage and exit 2, naming the flag and the sharding types it takes."""

import pytest

from greenroom.cli.bench import megatron as bench


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--mode", "stream", "--checkpoint", "fully_reshardable,bogus"], "expected some of fully_reshardable"),
        (["--mode", "stream", "--checkpoint", ","], "expected some of fully_reshardable"),
        (["--mode", "stock", "--checkpoint", "greenroom_streamed"], "the sidecar format is the streaming"),
    ],
)
def test_a_bad_checkpoint_flag_is_refused_with_exit_2(tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--checkpoint" in err and says in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_kinds_are_parsed_in_order():
    assert bench._kinds("dp_reshardable,fully_reshardable") == ("dp_reshardable", "fully_reshardable")
