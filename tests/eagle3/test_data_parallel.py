"""Data-parallel extraction without an engine: where each engine runs, which shards it writes, and
several processes writing one store at once (the manifest lists every shard, whoever wrote it).
The engines themselves run in tests/e2e/test_parallel_runs.py."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from eagle3.capture.data_parallel import DataParallelError, engine_environments, share_shards
from eagle3.capture.store import MANIFEST, Sample, StoreReader, StoreWriter, shard_name
from eagle3.data.target import TargetConfig, parallel_problems

H, AUX = 8, [1, 2]
GROUPS = [[f"s{i}a", f"s{i}b"] for i in range(12)]


def test_gpu_engines_get_disjoint_tp_groups_and_cpu_engines_disjoint_cores():
    assert engine_environments(4, 2, gpus=[str(i) for i in range(8)], cpus=[]) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"},
        {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert engine_environments(2, 1, gpus=["3", "5"], cpus=[0]) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert engine_environments(2, 1, gpus=[], cpus=[1, 0]) == [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert engine_environments(2, 2, gpus=[], cpus=range(8)) == [{"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"},
                                                                  {"VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}]
    with pytest.raises(DataParallelError, match=r"target.data_parallel_size=4 x target.tensor_parallel_size=2 needs 8 GPUs, 4"):
        engine_environments(4, 2, gpus=["0", "1", "2", "3"], cpus=[])
    with pytest.raises(DataParallelError, match=r"needs 4 CPU cores"):
        engine_environments(2, 2, gpus=[], cpus=[0, 1])


def test_every_missing_shard_goes_to_exactly_one_engine_in_balanced_shares():
    missing = {"train": [0, 2, 3, 5, 6], "heldout": [1]}
    shares = share_shards(missing, 3)
    assert shares == [{"train": (0, 5), "heldout": ()}, {"train": (2, 6), "heldout": ()}, {"train": (3,), "heldout": (1,)}]
    for split, indices in missing.items():
        assert sorted(i for share in shares for i in share[split]) == indices


def test_settings_that_cannot_place_the_engines_are_refused_naming_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 8}))
    eight = parallel_problems(TargetConfig(tensor_parallel_size=2, data_parallel_size=4), tmp_path, visible_gpus=8)
    assert eight == []
    too_many = parallel_problems(TargetConfig(tensor_parallel_size=2, data_parallel_size=8), tmp_path, visible_gpus=8)
    assert len(too_many) == 1 and "target.data_parallel_size=8" in too_many[0] and "at most 4" in too_many[0]
    cpu = parallel_problems(TargetConfig(data_parallel_size=3), tmp_path, visible_gpus=0, cpu_cores=2)
    assert len(cpu) == 1 and "needs 3 CPU cores" in cpu[0] and "at most 2" in cpu[0]


def _samples(index: int) -> list[Sample]:
    g = torch.Generator().manual_seed(index)
    return [Sample(sid, torch.arange(5), torch.ones(5, dtype=torch.bool), torch.randn(5, len(AUX) + 1, H, generator=g))
            for sid in GROUPS[index]]


def _write_share(root: str, indices: list[int], step) -> None:  # noqa: ANN001 - a multiprocessing Barrier
    writer = StoreWriter(Path(root), aux_layer_ids=AUX, hidden_size=H, dtype=torch.float32, expected_shards=GROUPS)
    for index in indices:
        step.wait()  # in lockstep: each writer writes its next shard while the other writes its own
        writer.write_shard(index, _samples(index))


def test_two_processes_writing_one_store_at_once_leave_a_manifest_listing_every_shard(tmp_path):
    context = multiprocessing.get_context("spawn")
    step = context.Barrier(2)
    procs = [context.Process(target=_write_share, args=(str(tmp_path), list(range(r, len(GROUPS), 2)), step)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["complete"] and [s["file"] for s in manifest["shards"]] == [shard_name(i) for i in range(len(GROUPS))]
    reader = StoreReader(tmp_path)
    for index in range(len(GROUPS)):
        for j, want in enumerate(_samples(index)):
            assert torch.equal(reader[2 * index + j].hidden_states, want.hidden_states)


def test_a_new_writer_keeps_a_live_writers_temporary_file_and_removes_a_dead_ones(tmp_path):
    live = tmp_path / f".{shard_name(0)}.tmp-{os.getppid()}-1"  # the pytest runner's parent is alive
    dead_pid = multiprocessing.get_context("spawn").Process(target=int)
    dead_pid.start()
    dead_pid.join()
    dead = tmp_path / f".{shard_name(1)}.tmp-{dead_pid.pid}-1"
    live.write_bytes(b"in progress")
    dead.write_bytes(b"left by a killed writer")
    StoreWriter(tmp_path, aux_layer_ids=AUX, hidden_size=H, dtype=torch.float32, expected_shards=GROUPS)
    assert live.exists() and not dead.exists()
