"""A training process killed with SIGKILL resumes and ends exactly where an uninterrupted run ends.

The child holds still after step KILL_AFTER (in its progress callback, outside the math) until the parent's
SIGKILL: the kill lands mid-run however slowly the parent reacts on a loaded machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.train.trainer import TrainConfig, train_draft
from tests.eagle3.draft_fixtures import TRAIN_KW, one_thread, tiny_world  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILL_AFTER = 16, 4, 10

# The child trains the same run as the parent would, announcing each step; from step argv[7] on it holds
# still (outside the math) until the parent kills it, so the kill lands mid-run rather than after the end.
CHILD = """
import sys, time, torch
from pathlib import Path
torch.set_num_threads(1)
from eagle3.train.trainer import TrainConfig, train_draft
store, target, head, vocab, out = map(Path, sys.argv[1:6])
config = TrainConfig.model_validate_json(sys.argv[6])
hold_at = int(sys.argv[7])
def progress(step, total, loss):
    print(step, flush=True)
    if step >= hold_at:
        time.sleep(600)  # until the parent's SIGKILL
train_draft(config, store_dir=store, target_dir=target, head_path=head, vocab_path=vocab, out_dir=out,
            progress=progress)
"""


def _config() -> TrainConfig:
    return TrainConfig(steps=STEPS, checkpoint_every=EVERY, **TRAIN_KW)


def _run(out: Path):
    world = tiny_world()
    return train_draft(_config(), store_dir=world.train_store, target_dir=world.target_dir,
                       head_path=world.head_path, vocab_path=world.vocab_path, out_dir=out)


def test_sigkill_midway_then_resume_gives_the_uninterrupted_parameters(tmp_path):
    world = tiny_world()
    out = tmp_path / "killed"
    args = [str(p) for p in (world.train_store, world.target_dir, world.head_path, world.vocab_path, out)]
    child = subprocess.Popen([sys.executable, "-c", CHILD, *args, _config().model_dump_json(), str(KILL_AFTER)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    seen = 0
    try:
        for line in child.stdout:
            seen = int(line)
            if seen >= KILL_AFTER:
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL and KILL_AFTER <= seen < STEPS
    logged = len((out / "losses.jsonl").read_text().splitlines())
    assert logged >= KILL_AFTER  # the killed run got past its last checkpoint before dying

    resumed = _run(out)
    straight = _run(tmp_path / "straight")
    assert resumed.resumed_from_step is not None and 8 <= resumed.resumed_from_step < STEPS
    assert resumed.steps_done == STEPS and resumed.tokens_seen == straight.tokens_seen
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    final_resumed = load_file(str(resumed.checkpoint / "model.safetensors"))
    final_straight = load_file(str(straight.checkpoint / "model.safetensors"))
    assert final_resumed.keys() == final_straight.keys()
    for name, tensor in final_straight.items():
        torch.testing.assert_close(final_resumed[name], tensor, rtol=0, atol=1e-6)
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no half-written folder left
