"""An extraction process killed with SIGKILL resumes and ends with the store an uninterrupted run writes.

The child holds still once KILL_AFTER shards are written (in its progress callback, outside the capture)
until the parent's SIGKILL: the kill lands mid-run however slowly the parent reacts on a loaded machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.capture import vllm_adapter
from eagle3.capture.extract import ExtractConfig, extract_store
from eagle3.capture.store import MANIFEST, StoreReader
from eagle3.data.conversations import TokenizedSample
from tests.on_device import KV_CACHE_GIB

ROOT = Path(__file__).resolve().parents[2]
AUX, N, H = [2, 4, 5], 8, 64  # the 8-layer tiny target
SHARDS, KILL_AFTER = 8, 3
# batch_tokens=1: every prefill call holds exactly one shard, so a resumed run batches each shard as
# the uninterrupted run does and the fp32 tiny target gives bit-identical states.
CONFIG = ExtractConfig(samples_per_shard=2, batch_tokens=1, storage_dtype="float32")

# The child runs the same extraction as the parent, with vLLM in-process, announcing each finished
# shard; once argv[3] (> 0) shards are written it holds still (outside the capture) until the parent
# kills it mid-run. One writer and one pending shard keep the capture at most two shards ahead of the
# writes: with more, on a loaded machine the captures ran ahead of slow writes and the count jumped from
# 2 to all 8 at the end (seen once), leaving nothing to kill. The write settings never change what is
# stored.
CHILD = """
import sys, time, torch
from pathlib import Path
from eagle3.capture import vllm_adapter
from eagle3.capture.extract import ExtractConfig, extract_store
from tests.eagle3.test_extract_kill import AUX, H, N, samples, spec
target, store, hold_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
config = ExtractConfig.model_validate_json(sys.argv[4])
def progress(done, total):
    print("done", done, flush=True)
    if 0 < hold_at <= done:
        time.sleep(600)  # until the parent's SIGKILL
stats = extract_store(samples(), store, get_engine=lambda: vllm_adapter.acquire(spec(target)), aux_layer_ids=AUX,
                      num_layers=N, hidden_size=H, config=config, dtype=torch.float32, progress=progress,
                      writer_threads=1, max_pending_shards=1)
print("stats", stats.shards_written, stats.shards_reused, flush=True)
"""


def spec(target: str) -> vllm_adapter.EngineSpec:
    return vllm_adapter.EngineSpec(model_dir=str(target), dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)


def samples() -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 40, (2 * SHARDS,), generator=g)
    return [TokenizedSample(f"s{i}", torch.randint(10, 500, (int(t),), generator=g).tolist(), [i % 2] * int(t))
            for i, t in enumerate(lengths)]


def _child(target: Path, store: Path, hold_at: int) -> subprocess.Popen:
    """The extraction in a child process; with `hold_at` > 0 it holds still once that many shards are written."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(target), str(store), str(hold_at), CONFIG.model_dump_json()],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)


def _listed(store: Path) -> int:
    shards = json.loads((store / MANIFEST).read_text())["shards"]
    return sum(entry is not None for entry in shards)


@pytest.fixture(scope="module")
def uninterrupted(tiny_target, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("straight")
    extract_store(samples(), store, get_engine=lambda: vllm_adapter.acquire(spec(tiny_target)), aux_layer_ids=AUX,
                  num_layers=N, hidden_size=H, config=CONFIG, dtype=torch.float32)
    yield store
    vllm_adapter.release_all()


def test_sigkill_midway_then_resume_gives_the_uninterrupted_store(tiny_target, uninterrupted, tmp_path):
    store = tmp_path / "killed"
    child = _child(tiny_target, store, hold_at=KILL_AFTER)
    seen = 0
    try:
        for line in child.stdout:  # vLLM logs to stdout too: only "done <n>" lines are ours
            if line.startswith("done "):
                seen = int(line.split()[1])
            if seen >= KILL_AFTER:
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL and KILL_AFTER <= seen < SHARDS
    assert KILL_AFTER <= _listed(store) < SHARDS  # the kill left a partial store behind
    assert not json.loads((store / MANIFEST).read_text())["complete"]

    resumed = _child(tiny_target, store, hold_at=0)
    out, _ = resumed.communicate(timeout=600)  # a guard against a hang: it loads a fresh engine and writes the rest
    assert resumed.returncode == 0, out
    written, reused = map(int, [line for line in out.splitlines() if line.startswith("stats ")][-1].split()[1:])
    assert reused >= KILL_AFTER and written + reused == SHARDS  # the finished shards were not redone

    got, want = StoreReader(store, dequantize_dtype=torch.float32), StoreReader(uninterrupted, dequantize_dtype=torch.float32)
    got.verify()
    assert [e.sample_ids for e in got.shards] == [e.sample_ids for e in want.shards]
    for entry_got, entry_want in zip(got.shards, want.shards):
        a, b = load_file(str(store / entry_got.file)), load_file(str(uninterrupted / entry_want.file))
        assert a.keys() == b.keys()
        for name, tensor in b.items():
            assert torch.equal(a[name], tensor), f"{entry_got.file}: {name} differs from the uninterrupted run"
    assert not [p.name for p in store.iterdir() if p.name.startswith(".")]  # no temporary file left behind
