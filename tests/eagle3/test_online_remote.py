"""online.producer 'remote' on one host: the capture worker is a real process of its own (`python -m
eagle3.online.capture_worker`, the tiny target in transformers, fp32), the trainer runs here and only reads the shards
the worker writes into the buffer folder. The losses are the local producer's, the buffer stays within its bound,
and a worker killed mid-epoch and started again completes the run with the same losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3.capture.hf_source import HFSource, load_hf_target
from eagle3.capture.store import StoreReader
from eagle3.draft.checkpoint import latest_valid_checkpoint
from eagle3.online.feed import OnlineData, OnlineDataError, OnlineSample, SourceCapture, shard_bytes
from eagle3.online.remote import buffer_bytes_on_disk
from eagle3.train.trainer import TrainConfig, train_draft
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, HIDDEN, NUM_LAYERS, TRAIN_KW, one_thread, tiny_world  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
ONE_SHARD = shard_bytes(TRAIN_KW["batch_tokens"], TRAIN_KW["batch_tokens"], len(AUX_LAYER_IDS) + 1, HIDDEN, torch.float32)


def _data(buffer: Path, producer: str, capture=None, wait_s: float = 120.0) -> OnlineData:
    samples = [OnlineSample(s.input_ids.tolist(), s.loss_mask.int().tolist()) for s in StoreReader(tiny_world().train_store)]
    return OnlineData(samples=samples, kept=0, kept_store=None, capture=capture, buffer_dir=buffer,
                      buffer_bytes=2 * ONE_SHARD, aux_layer_ids=AUX_LAYER_IDS, hidden_size=HIDDEN,
                      storage_dtype=torch.float32, producer=producer, remote_wait_s=wait_s)


def _train(out: Path, data: OnlineData, progress=None):
    world = tiny_world()
    config = TrainConfig(steps=STEPS, checkpoint_every=4, data="online", **TRAIN_KW)
    return train_draft(config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                       vocab_path=world.vocab_path, out_dir=out, online=data, progress=progress)


def _worker(buffer: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "eagle3.online.capture_worker", "--buffer", str(buffer), "--model",
               str(tiny_world().target_dir), "--backend", "hf", "--dtype", "float32", "--wait-s", "120"]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory) -> list[float]:
    """The local producer (a thread of the trainer's process) over the same target in transformers."""
    tmp = tmp_path_factory.mktemp("local")
    model = load_hf_target(str(tiny_world().target_dir), dtype="float32", device="cpu")
    capture = SourceCapture(HFSource(model, batch_tokens=TRAIN_KW["batch_tokens"]), AUX_LAYER_IDS + [NUM_LAYERS],
                            torch.device("cpu"))
    return _train(tmp / "out", _data(tmp / "buffer", "local", capture)).losses


class _Poll:
    """The most bytes of shards in the buffer folder at once, looked at every 2 ms."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak, self.done = folder, 0, threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            if self.folder.is_dir():
                self.peak = max(self.peak, buffer_bytes_on_disk(self.folder))
            time.sleep(0.002)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def test_a_worker_process_gives_the_local_producers_losses_within_the_buffer_bound(local_losses, tmp_path):
    buffer = tmp_path / "buffer"
    worker = _worker(buffer)
    poll = _Poll(buffer)
    try:
        result = _train(tmp_path / "out", _data(buffer, "remote"))
    finally:
        peak = poll.stop()
        out, _ = worker.communicate(timeout=60)  # the trainer removed feed.json: the worker stops by itself
    assert worker.returncode == 0, out[-3000:]
    assert len(result.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(result.losses, local_losses, strict=True)) <= 1e-5
    assert 0 < peak <= 2 * ONE_SHARD + ONE_SHARD
    assert result.online["tokens_captured"] > 0
    assert not buffer.exists()  # nothing of the feed outlives the run


def test_a_worker_killed_mid_epoch_and_started_again_completes_the_run_with_the_same_losses(local_losses, tmp_path):
    buffer = tmp_path / "buffer"
    workers = [_worker(buffer)]
    killed_at: list[int] = []

    captured: list[int] = []

    def progress(step: int, _total: int, _loss: float, tokens: int) -> None:
        captured.append(tokens)  # what the train stage's progress shows beside the steps
        if step == 3 and not killed_at:  # inside the first epoch (5 micro-batches of 8 samples)
            workers[0].send_signal(signal.SIGKILL)
            workers[0].wait()
            killed_at.append(step)
            workers.append(_worker(buffer))  # resumes at the trainer's cursor (cursor.json)

    try:
        result = _train(tmp_path / "out", _data(buffer, "remote"), progress)
    finally:
        out, _ = workers[-1].communicate(timeout=60)
    assert killed_at == [3] and workers[0].returncode == -signal.SIGKILL
    assert workers[-1].returncode == 0, out[-3000:]
    assert int(out.split("online-capture: done, ")[1].split()[0]) > 0  # the second worker captured the rest
    # the workers' tokens, not 0, growing; the run's total can end above the last step's figure: a loader thread
    # reads the next micro-batch's shard (already captured) while the last step trains
    assert 0 < captured[0] and captured == sorted(captured)
    assert captured[-1] <= result.online["tokens_captured"]
    assert max(abs(a - b) for a, b in zip(result.losses, local_losses, strict=True)) <= 1e-5
    assert not buffer.exists()


TRAINER = """
import os, signal, sys, torch
from pathlib import Path
from eagle3.capture.store import StoreReader
from eagle3.online.feed import OnlineData, OnlineSample
from eagle3.train.trainer import TrainConfig, train_draft
store, target, head, vocab, out, buffer, one_shard = sys.argv[1:8]
kill_at = int(sys.argv[8]) if len(sys.argv) > 8 else None

def progress(step, steps, loss, *captured):  # SIGKILL of this process once step `kill_at` is logged: a kill mid-run
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
torch.set_num_threads(1)
samples = [OnlineSample(s.input_ids.tolist(), s.loss_mask.int().tolist()) for s in StoreReader(Path(store))]
data = OnlineData(samples=samples, kept=0, kept_store=None, capture=None, buffer_dir=Path(buffer),
                  buffer_bytes=2 * int(one_shard), aux_layer_ids=%r, hidden_size=%d, storage_dtype=torch.float32,
                  producer="remote", remote_wait_s=120)
config = TrainConfig(steps=%d, checkpoint_every=4, data="online", **%r)
result = train_draft(config, store_dir=Path(store), target_dir=Path(target), head_path=Path(head),
                     vocab_path=Path(vocab), out_dir=Path(out), online=data, progress=progress)
print("resumed from step", result.resumed_from_step)
""" % (AUX_LAYER_IDS, HIDDEN, STEPS, TRAIN_KW)


def test_a_trainer_killed_mid_run_resumes_from_its_checkpoint_with_the_same_worker_and_losses(local_losses, tmp_path):
    """The trainer is a process too: SIGKILL after step 6 (checkpoints every 4 steps), the same command again: it resumes
    from the newest checkpoint the killed process left (step 4), and the worker that kept running serves the new stream
    from the trainer's recorded cursor. The trainer kills itself once step 6 is logged: a kill sent from here after
    polling losses.jsonl could land after the last step on a loaded machine (a tiny step takes 20-50 ms)."""
    world, buffer, out = tiny_world(), tmp_path / "buffer", tmp_path / "out"
    command = [sys.executable, "-c", TRAINER, str(world.train_store), str(world.target_dir), str(world.head_path),
               str(world.vocab_path), str(out), str(buffer), str(ONE_SHARD)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    worker = _worker(buffer)
    try:
        killed = subprocess.run([*command, "6"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
        losses = out / "losses.jsonl"
        assert [json.loads(line)["step"] for line in losses.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
        assert (buffer / "cursor.json").is_file() and worker.poll() is None  # the worker waits for the next stream
        left = latest_valid_checkpoint(out / "checkpoints")
        assert left is not None and left.step == 4, left  # killed mid-run, after a checkpoint
        again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert f"resumed from step {left.step}\n" in again.stdout  # that checkpoint, not a fresh start
    finally:
        printed, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, printed[-3000:]
    resumed = [json.loads(line)["loss"] for line in losses.read_text().splitlines()]
    assert len(resumed) == STEPS
    assert max(abs(a - b) for a, b in zip(resumed, local_losses, strict=True)) <= 1e-5
    assert not buffer.exists()


def test_no_worker_is_one_clear_error_naming_the_setting(tmp_path):
    with pytest.raises(OnlineDataError, match=r"within online.remote_wait_s=1 s .*eagle3 online-capture --buffer"):
        _train(tmp_path / "out", _data(tmp_path / "buffer", "remote", wait_s=1.0))
    assert not (tmp_path / "buffer").exists()


def test_a_cursor_half_written_by_a_killed_trainer_does_not_outlive_the_next_run(tmp_path):
    """SIGKILL can land inside the fsync of the trainer's cursor write, leaving `.cursor.json.tmp-<pid>-<thread>`; the
    next run over the same buffer removes it, and nothing of the feed is left when that run ends (CI saw the folder
    left behind by exactly this)."""
    buffer = tmp_path / "buffer"
    buffer.mkdir()
    (buffer / ".cursor.json.tmp-4242-1").write_text('{"stream": "dead')
    with pytest.raises(OnlineDataError, match=r"within online.remote_wait_s=1 s"):
        _train(tmp_path / "out", _data(buffer, "remote", wait_s=1.0))
    assert not buffer.exists()


def test_a_remote_producer_without_a_folder_the_worker_can_see_is_refused_when_the_config_is_read():
    from eagle3.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"online.producer='remote' needs a buffer folder .* set online.buffer_dir"):
        build_config("tiny", overrides=["train.data=online", "online.producer=remote", "artifact_root=s3://bucket/x"])
    config = build_config("tiny", overrides=["train.data=online", "online.producer=remote", "artifact_root=s3://bucket/x",
                                             "online.buffer_dir=/shared/buffer"])
    assert config.online.producer == "remote"


def test_a_dflash_draft_stopped_online_resumes_at_its_cursor_with_the_losses_of_one_never_stopped(tmp_path):
    """train.draft.method dflash from the local producer (the tiny target in transformers, a thread of the trainer):
    stopped after step 6 (checkpoint at 4) and called again, the feed starts at the checkpoint's (epoch, cursor), and
    the losses are those of a run never stopped; each call leaves no buffer behind."""
    from eagle3.train.dflash_trainer import train_dflash

    world = tiny_world()
    model = load_hf_target(str(world.target_dir), dtype="float32", device="cpu")
    capture = SourceCapture(HFSource(model, batch_tokens=TRAIN_KW["batch_tokens"]), AUX_LAYER_IDS + [NUM_LAYERS],
                            torch.device("cpu"))
    draft = {"method": "dflash", "mask_token_id": 1, "block_size": 4, "anchors_per_sample": 4}
    config = TrainConfig(steps=STEPS, checkpoint_every=4, data="online", draft=draft, **TRAIN_KW)
    paths = {"store_dir": world.train_store, "target_dir": world.target_dir, "head_path": world.head_path}

    def run(out: Path, buffer: Path, stop_after: int | None = None):
        result = train_dflash(config, out_dir=out, online=_data(buffer, "local", capture), stop_after=stop_after,
                              **paths)
        assert not buffer.exists()
        return result

    straight = run(tmp_path / "straight", tmp_path / "b1")
    assert straight.online["tokens_captured"] > 0
    stopped = run(tmp_path / "stopped", tmp_path / "b2", stop_after=6)
    assert len(stopped.losses) == 6
    resumed = run(tmp_path / "stopped", tmp_path / "b2")
    assert resumed.resumed_from_step == 4 and len(resumed.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(resumed.losses, straight.losses, strict=True)) <= 1e-5


def test_the_bound_measure_of_a_buffer_removed_while_listed_is_zero_not_an_error(tmp_path):
    """The capture worker measures the buffer every 20 ms while the trainer may close the feed and remove the folder:
    removed between the listing's is_dir and its scandir, the folder measured 0 bytes instead of raising
    FileNotFoundError out of the worker's loop (247 of 20,000 measures raised before the fix)."""
    folder, stop = tmp_path / "buffer", threading.Event()

    def churn() -> None:  # a feed's lifetime, over and over: the folder, a shard, consumed, the folder removed
        while not stop.is_set():
            folder.mkdir(exist_ok=True)
            (folder / "batch-a-00000000.safetensors").write_bytes(b"x" * 10)
            (folder / "batch-a-00000000.safetensors").unlink()
            folder.rmdir()

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        measured = [buffer_bytes_on_disk(folder) for _ in range(20_000)]
    finally:
        stop.set()
        churner.join()
    assert set(measured) <= {0, 10}
