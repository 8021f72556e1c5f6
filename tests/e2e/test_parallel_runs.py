"""Several engines, as users run them (issue 15): `eagle3 run --preset tiny` with 2 data-parallel
engines, SIGKILLed mid-extraction; the same run with a TP=2 engine (vLLM's mp executor, 2 worker
processes), SIGKILLed mid-extraction too; then that TP=2 command again, which completes. After
each kill no process of the run is left (engines, TP workers, the flow); the store the three runs
wrote together equals one TP=1 engine's, sample by sample, within 1e-4 (float32 states).

One shard per sample and one sample per prefill call (`extract.samples_per_shard=1`,
`extract.batch_tokens=1`), so extraction takes long enough to be killed in the middle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle3.artifacts import read_complete
from eagle3.capture import vllm_adapter
from eagle3.capture.extract import ExtractConfig, extract_store
from eagle3.capture.store import StoreReader
from eagle3.data.conversations import read_samples
from eagle3.data.target import TargetInfo
from eagle3.gpu.cleanup import OWN_PROCESSES_FILE
from tests.on_device import KV_CACHE_GIB

ROOT = Path(__file__).resolve().parents[2]
# regenerate off: its engine is not what is tested here, and each engine load costs CI tens of seconds. The preset's
# 48 samples, one shard each: with 16, a loaded machine let the TP=2 run write every shard before the kill landed
SETTINGS = ["--set", "extract.samples_per_shard=1", "--set", "extract.batch_tokens=1", "--set", "train.steps=4",
            "--set", "regenerate.enabled=false"]


def _cli(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--run-dir", str(run_dir), *SETTINGS, *extra]


def _listed(run_dir: Path) -> int:
    """Shards listed in the extract stores' manifests (the held-out store's appears with its first shard)."""
    done = 0
    for manifest in run_dir.glob("artifacts/extract/*/*/manifest.json"):
        try:
            shards = json.loads(manifest.read_text())["shards"]
        except (json.JSONDecodeError, KeyError, OSError):
            continue  # being replaced right now
        done += sum(s is not None for s in shards)
    return done


def _session_processes(sid: int) -> list[str]:
    """Processes still in session `sid` (the run was started as a session of its own)."""
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.getsid(int(proc.name)) == sid:
                    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
                    left.append(f"{proc.name} {command}")
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                continue
    return left


def _kill_mid_extraction(run_dir: Path, env: dict[str, str], log: Path, *extra: str) -> tuple[int, int]:
    """Start the run, SIGKILL the flow process (only it: its engines must follow by themselves) once the
    extraction has listed more shards than before; return the shards listed then."""
    before = _listed(run_dir)
    proc = subprocess.Popen(_cli(run_dir, *extra), cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 400
    while time.time() < deadline:
        if _listed(run_dir) > before:
            break
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before extracting:\n{log.read_text()[-3000:]}"
        time.sleep(0.02)
    else:
        proc.kill()
        raise AssertionError(f"no shard written in 400 s:\n{log.read_text()[-3000:]}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 120  # a guard against processes that never go; they follow in seconds
    while _session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert _session_processes(proc.pid) == [], "processes of the killed run are still alive"
    # counted again now that nothing of the run is left: a shard can be listed between the count above and the kill.
    # Against the prepared samples (one shard each), not the manifests' count: the held-out manifest appears only
    # with its first shard, so a kill between the last train shard and it would look like a finished extraction.
    done = _listed(run_dir)
    prepared = next(run_dir.glob("artifacts/prepare_data/*"))
    total = sum(len(read_samples(prepared / f"{split}.jsonl")) for split in ("train", "heldout"))
    assert done < total, f"the extraction finished ({done}/{total}) before the kill: nothing was tested"
    return done, total


def test_data_parallel_then_tp2_killed_then_tp2_completes_with_the_store_of_one_engine(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    dp_done, _ = _kill_mid_extraction(run_dir, cli_env, tmp_path / "dp2.log", "--set", "target.data_parallel_size=2")
    registered = json.loads((run_dir / OWN_PROCESSES_FILE).read_text())["processes"]
    assert len(registered) == 2, registered  # both engines were recorded for gpu_cleanup
    tp_done, _ = _kill_mid_extraction(run_dir, cli_env, tmp_path / "tp2.log", "--set", "target.tensor_parallel_size=2")
    assert 0 < dp_done < tp_done

    done = subprocess.run(_cli(run_dir, "--set", "target.tensor_parallel_size=2"), cwd=ROOT, env=cli_env,
                          capture_output=True, text=True, timeout=900, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = next(run_dir.glob("artifacts/extract/*"))
    stats = read_complete(store).stats  # the completing run redid only what the killed ones left
    reused, written = (stats["train_shards_reused"] + stats["heldout_shards_reused"],
                       stats["train_shards_written"] + stats["heldout_shards_written"])
    assert (reused, written) == (tp_done, stats["train_samples"] + stats["heldout_samples"] - tp_done), stats

    # one TP=1 engine, in this process, over the same prepared samples
    prepared = next(run_dir.glob("artifacts/prepare_data/*"))
    info = TargetInfo.read(next(run_dir.glob("artifacts/stage_target/*")))
    spec = vllm_adapter.EngineSpec(model_dir=info.model_dir, dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    try:
        for split in ("train", "heldout"):
            extract_store(read_samples(prepared / f"{split}.jsonl"), tmp_path / "one" / split,
                          get_engine=lambda: vllm_adapter.acquire(spec), aux_layer_ids=info.aux_layer_ids,
                          num_layers=info.num_layers, hidden_size=info.hidden_size,
                          config=ExtractConfig(samples_per_shard=1, batch_tokens=1), dtype=torch.float32)
            mine, one = StoreReader(store / split), StoreReader(tmp_path / "one" / split)
            assert len(mine) == len(one) > 0
            for a, b in zip(mine, one, strict=True):
                assert a.sample_id == b.sample_id and torch.equal(a.input_ids, b.input_ids), (a.sample_id, b.sample_id)
                assert torch.equal(a.loss_mask, b.loss_mask), a.sample_id
                torch.testing.assert_close(a.hidden_states.float(), b.hidden_states.float(), atol=1e-4, rtol=0)
    finally:
        vllm_adapter.release_all()
