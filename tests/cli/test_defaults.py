"""One source of defaults: the seed flags' defaults of the CLI (``add_arguments``), the
Helm chart's values.yaml and the Slurm job YAML are ``OffloadFlags``' own."""

import argparse
import os

import yaml

from greenroom.config import FLAG_FIELDS, OffloadFlags, add_arguments
from greenroom.slurm.config import TrainArgs
from tests.conftest import REPO

DEFAULTS = OffloadFlags()


def test_cli_defaults_are_offload_flags(monkeypatch):
    monkeypatch.delenv("GREENROOM_ARGS", raising=False)
    ns = add_arguments(argparse.ArgumentParser()).parse_args([])
    assert OffloadFlags.from_args(ns) == DEFAULTS
    assert ns.offload_train_target is None  # not given: resolves to cpu, and is checked as not given


def test_slurm_yaml_defaults_are_offload_flags():
    train = TrainArgs()
    for name in FLAG_FIELDS:
        if hasattr(train, name):
            expected = None if name == "offload_train_target" else getattr(DEFAULTS, name)
            assert getattr(train, name) == expected, name
    assert train.offload_flags() == DEFAULTS


def test_chart_values_defaults_are_offload_flags():
    with open(os.path.join(REPO, "deploy", "helm", "greenroom", "values.yaml"), encoding="utf-8") as f:
        v = yaml.safe_load(f)
    chart = OffloadFlags(
        offload_train=v["offload"]["train"],
        offload_train_target=v["offload"]["target"],
        offload_train_disk_chunk_mb=v["offload"]["diskChunkMb"],
        offload_train_disk_compression=v["offload"]["diskCompression"],
        stream_optimizer_state_to_disk=v["streamOptimizerState"]["toDisk"],
        stream_optimizer_state_moment_dtype=v["streamOptimizerState"]["momentDtype"],
        stream_optimizer_state_master_layout=v["streamOptimizerState"]["masterLayout"],
        stream_optimizer_state_host_cache_gb=v["streamOptimizerState"]["hostCacheGb"],
        no_load_optim=v["noLoadOptim"],
    )
    assert chart == DEFAULTS
