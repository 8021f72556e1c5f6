"""Training on several machines (train.nnodes), shown on one: 2 nodes x 1 process over 127.0.0.1
(c10d rendezvous, gloo). Node 0 is the train stage's call (train_distributed); node 1 is a separate
process started as `eagle3 train-node` runs it, from the launch spec node 0 wrote."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.train.ddp import NODE_RANK_ENV
from eagle3.train.launch import NODES_SPEC, LaunchSpec, join_training, resolve_num_processes, train_distributed
from eagle3.train.trainer import TrainConfig, TrainError, train_draft
from tests.eagle3.draft_fixtures import TRAIN_KW, one_thread, tiny_world  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
NODE_TIMEOUT = 300  # seconds node 1 may run before the test kills it (a rendezvous that never completes; a guard:
# node 1 imports, meets node 0 and trains in ~30 s alone, and a loaded machine can take several times that)


def _paths(world) -> dict[str, Path]:  # noqa: ANN001
    return {"store_dir": world.train_store, "target_dir": world.target_dir, "head_path": world.head_path,
            "vocab_path": world.vocab_path}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _OtherNode:
    """Node 1: waits for node 0's spec, then runs `eagle3 train-node` (flows.cli) as its own process."""

    def __init__(self, spec: Path) -> None:
        self.spec, self.proc, self.output = spec, None, ""
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + NODE_TIMEOUT
        while not self.spec.exists():
            if self.cancelled.wait(0.05) or time.monotonic() > deadline:
                return
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train-node", "--spec", str(self.spec),
                                      "--node-rank", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        try:
            self.output, _ = self.proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # a rendezvous that never completes
            self.proc.kill()
            self.output, _ = self.proc.communicate()

    def stop(self, grace: float = 30.0) -> int | None:
        """Its exit code once it ends (killed when it still runs `grace` seconds after node 0 returned)."""
        self.cancelled.set()
        self.thread.join(timeout=grace)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.thread.join()
        return None if self.proc is None else self.proc.returncode


def test_two_machines_of_one_process_give_the_one_process_result(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    world = tiny_world()
    config = TrainConfig(steps=8, checkpoint_every=4, grad_accum=2, num_processes=1, nnodes=2,
                         rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_join_timeout=60, **TRAIN_KW)
    out = tmp_path / "nodes"
    node1 = _OtherNode(out / NODES_SPEC)
    try:
        launched = train_distributed(config, resolve_num_processes(config), out_dir=out, **_paths(world))
    finally:
        code = node1.stop()
    assert code == 0, node1.output
    single = train_draft(config.model_copy(update={"nnodes": 1, "rdzv_endpoint": None}), out_dir=tmp_path / "single",
                         **_paths(world))
    assert launched.losses == pytest.approx(single.losses, abs=1e-5)
    assert launched.steps_done == 8 and launched.checkpoint == out / "checkpoints" / "step-000008"
    weights = load_file(str(launched.checkpoint / "model.safetensors"))
    for name, tensor in load_file(str(single.checkpoint / "model.safetensors")).items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5)
    # training rank 0 (node 0) wrote what one process writes; no spec, marker or result is left
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "evals.jsonl", "losses.jsonl"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000008"]


def test_node_0_alone_fails_with_the_command_for_the_other_machines(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    world = tiny_world()
    endpoint = f"127.0.0.1:{_free_port()}"
    config = TrainConfig(steps=4, grad_accum=2, num_processes=1, nnodes=2, rdzv_endpoint=endpoint,
                         rdzv_join_timeout=2, warmup_steps=1)
    spec = tmp_path / "alone" / NODES_SPEC
    with pytest.raises(TrainError) as caught:
        train_distributed(config, 1, out_dir=tmp_path / "alone", **_paths(world))
    message = str(caught.value)
    assert "train.nnodes=2" in message and f"train.rdzv_endpoint={endpoint}" in message
    assert "within train.rdzv_join_timeout=2 s" in message
    assert f"eagle3 train-node --spec {spec} --node-rank 1" in message
    assert f"eagle3 train-node --spec {spec} --node-rank 1" in capfd.readouterr().err  # printed at launch
    assert not spec.exists()


_CONTEXT = """
import json
from eagle3.train import ddp
try:
    print(json.dumps({"rank": ddp.context_from_env().rank}))
except ddp.DistError as err:
    print(json.dumps({"error": str(err)}))
finally:
    ddp.leave()  # as launch.main: without it gloo can abort this process at exit, losing what it printed
"""


def _contexts(node_ranks: list[int]) -> list[dict]:
    """ddp.context_from_env in one process per machine (1 rank each), torchrun's RANK i given node rank node_ranks[i]."""
    port, procs = _free_port(), []
    for rank, node in enumerate(node_ranks):
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(len(node_ranks)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               NODE_RANK_ENV: str(node), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", _CONTEXT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        contexts = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"exit {proc.returncode}: {err}"  # a rank that aborts at exit fails its torchrun
            contexts.append(json.loads(out))
        return contexts
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_training_rank_0_is_node_0_whatever_torchrun_numbers_the_machines():
    """c10d numbers the machines by host name and pid, not by --node-rank: here node 1 got torchrun's RANK 0."""
    assert _contexts([1, 0]) == [{"rank": 1}, {"rank": 0}]
    twice = _contexts([1, 1])  # two machines started with the same --node-rank
    assert all("each `eagle3 train-node` needs its own --node-rank" in c.get("error", "") for c in twice), twice


def test_several_machines_are_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match=r"train.rdzv_endpoint is not set, but train.nnodes=2"):
        TrainConfig(nnodes=2, grad_accum=2)
    with pytest.raises(ValueError, match=r"train.rdzv_endpoint is 'node0'; expected 'host:port'"):
        TrainConfig(nnodes=2, grad_accum=2, rdzv_endpoint="node0")
    with pytest.raises(ValueError, match=r"train.rdzv_endpoint is 'node0:70000'"):
        TrainConfig(nnodes=2, grad_accum=2, rdzv_endpoint="node0:70000")
    with pytest.raises(ValueError, match=r"train.grad_accum \(2\) does not split over train.num_processes \(2\) "
                                         r"x train.nnodes \(2\) = 4 ranks"):
        TrainConfig(nnodes=2, num_processes=2, grad_accum=2, rdzv_endpoint="node0:29400")
    with pytest.raises(ValueError, match=r"train.grad_accum \(3\) does not split over train.nnodes \(2\)"):
        TrainConfig(nnodes=2, grad_accum=3, rdzv_endpoint="node0:29400")  # num_processes 'auto'
    assert TrainConfig(nnodes=2, grad_accum=2, rdzv_endpoint="[fd00::1]:29400").nnodes == 2


def test_machines_do_not_change_the_train_fingerprint():
    from eagle3.artifacts import StageRecord
    from eagle3.draft_stages import fingerprint_train

    ups = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab", "stage_target")]
    base = fingerprint_train(TrainConfig(steps=10, warmup_steps=1, grad_accum=2), *ups)
    several = TrainConfig(steps=10, warmup_steps=1, grad_accum=2, nnodes=2, rdzv_endpoint="node0:29400",
                          rdzv_join_timeout=30)
    assert fingerprint_train(several, *ups) == base


def test_a_node_refuses_a_spec_it_cannot_join(tmp_path):
    world = tiny_world()
    config = TrainConfig(steps=4, warmup_steps=1, grad_accum=2, num_processes=1, nnodes=2, rdzv_endpoint="node0:29400")
    out = tmp_path / "out"
    out.mkdir()
    LaunchSpec(config, out, 1, _paths(world)).write(out / NODES_SPEC)
    with pytest.raises(TrainError, match=r"--node-rank is 2; expected 1 .. 1 for train.nnodes=2"):
        join_training(out / NODES_SPEC, 2)
    with pytest.raises(TrainError, match="cannot read the launch spec"):
        join_training(tmp_path / "missing.json", 1)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / NODES_SPEC).write_text((out / NODES_SPEC).read_text())  # the shared folder mounted at another path
    with pytest.raises(TrainError, match="mount the shared folder at the same path"):
        join_training(moved / NODES_SPEC, 1)
    gone = LaunchSpec(config, out, 1, {**_paths(world), "store_dir": tmp_path / "not-shared"})
    gone.write(out / NODES_SPEC)
    with pytest.raises(TrainError, match="store_dir .*not-shared .*is not on this machine"):
        join_training(out / NODES_SPEC, 1)
