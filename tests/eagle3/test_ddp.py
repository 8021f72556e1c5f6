"""Data parallel training: 2 processes under torchrun (gloo, CPU) follow the 1-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.draft.ddp import DistContext, DistError, check_grad_accum
from eagle3.draft.train import TrainConfig, train_draft
from tests.eagle3.draft_fixtures import TRAIN_KW, one_thread, tiny_world  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import sys, torch
from pathlib import Path
torch.set_num_threads(1)
from eagle3.draft.train import TrainConfig, train_draft
store, target, head, vocab, out = map(Path, sys.argv[1:6])
train_draft(TrainConfig.model_validate_json(sys.argv[6]), store_dir=store, target_dir=target, head_path=head,
            vocab_path=vocab, out_dir=out)
from eagle3.draft.ddp import context_from_env
import torch.distributed as dist
ctx = context_from_env()
print(f"rank {ctx.rank} of {ctx.world_size} backend {dist.get_backend()}", flush=True)
"""


def test_two_processes_give_the_one_process_result_for_the_same_global_batch(tmp_path):
    world = tiny_world()
    config = TrainConfig(steps=8, checkpoint_every=4, grad_accum=2, **TRAIN_KW)  # 2 micro-batches per step
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    args = [str(p) for p in (world.train_store, world.target_dir, world.head_path, world.vocab_path, tmp_path / "ddp")]
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args,
         config.model_dump_json()],
        cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "rank 0 of 2 backend gloo" in launched.stdout and "rank 1 of 2 backend gloo" in launched.stdout
    single = train_draft(config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                         vocab_path=world.vocab_path, out_dir=tmp_path / "single")
    logged = [line for line in (tmp_path / "ddp" / "losses.jsonl").read_text().splitlines() if line]
    ddp_losses = [json.loads(line)["loss"] for line in logged]
    assert ddp_losses == pytest.approx(single.losses, abs=1e-6)
    assert single.losses[-1] < single.losses[0]  # it trained
    ddp_weights = load_file(str(tmp_path / "ddp" / "checkpoints" / "step-000008" / "model.safetensors"))
    for name, tensor in load_file(str(single.checkpoint / "model.safetensors")).items():
        torch.testing.assert_close(ddp_weights[name], tensor, rtol=0, atol=1e-5)


def test_grad_accum_must_split_over_the_processes():
    check_grad_accum(4, DistContext(rank=1, world_size=2))
    with pytest.raises(DistError, match="train.grad_accum"):
        check_grad_accum(3, DistContext(rank=0, world_size=2))
    assert [DistContext(rank=1, world_size=2).owns(i) for i in range(4)] == [False, True, False, True]
