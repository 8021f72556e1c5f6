"""Online training data captured by an in-process HF source (eagle3.online.feed.SourceCapture over
eagle3.capture.hf_source.HFSource): the tiny target captures each micro-batch while the trainer trains, and
the losses are the store run's. Also the benchmark that measures it, benchmarks/online_vs_store.py --tiny."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.capture.hf_source import HFSource, load_hf_target
from eagle3.capture.store import StoreReader
from eagle3.online.feed import OnlineData, OnlineSample, SourceCapture, shard_bytes
from eagle3.train.trainer import TrainConfig, train_draft
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, HIDDEN, NUM_LAYERS, TRAIN_KW, one_thread, tiny_world  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def _train(out: Path, online: OnlineData | None = None):
    world = tiny_world()
    config = TrainConfig(steps=STEPS, checkpoint_every=4, data="store" if online is None else "online", **TRAIN_KW)
    return train_draft(config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                       vocab_path=world.vocab_path, out_dir=out, online=online)


def test_the_hf_source_through_the_online_feed_gives_the_store_runs_losses(tmp_path):
    world = tiny_world()
    model = load_hf_target(str(world.target_dir), dtype="float32", device="cpu")
    layer_ids = AUX_LAYER_IDS + [NUM_LAYERS]  # the aux states + the final one (id N), as the store holds them
    capture = SourceCapture(HFSource(model, batch_tokens=TRAIN_KW["batch_tokens"]), layer_ids, torch.device("cpu"))
    samples = [OnlineSample(s.input_ids.tolist(), s.loss_mask.int().tolist()) for s in StoreReader(world.train_store)]
    one_shard = shard_bytes(TRAIN_KW["batch_tokens"], TRAIN_KW["batch_tokens"], len(layer_ids), HIDDEN, torch.float32)
    data = OnlineData(samples=samples, kept=0, kept_store=None, capture=capture, buffer_dir=tmp_path / "buffer",
                      buffer_bytes=2 * one_shard, aux_layer_ids=AUX_LAYER_IDS, hidden_size=HIDDEN,
                      storage_dtype=torch.float32)
    store = _train(tmp_path / "store")
    online = _train(tmp_path / "online", data)
    assert len(online.losses) == len(store.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(online.losses, store.losses, strict=True)) <= 1e-5
    assert capture.tokens == online.online["tokens_captured"] > 0
    assert not (tmp_path / "buffer").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_capture_runs_on_its_own_stream_and_gives_host_states_equal_to_the_default_streams():
    model = load_hf_target(str(tiny_world().target_dir), dtype="float32", device="cuda")
    source = HFSource(model, batch_tokens=TRAIN_KW["batch_tokens"])
    capture = SourceCapture(source, AUX_LAYER_IDS + [NUM_LAYERS], torch.device("cuda"))
    prompts = [s.input_ids.tolist() for s in list(StoreReader(tiny_world().train_store))[:5]]
    got = capture(prompts)
    want = source.capture(prompts, AUX_LAYER_IDS + [NUM_LAYERS])  # on the default stream
    assert capture.stream is not None and all(g.device.type == "cpu" for g in got)
    assert all(torch.equal(g, w.cpu()) for g, w in zip(got, want, strict=True))


def test_the_benchmark_runs_tiny_on_the_cpu_without_prefect_or_vllm(tmp_path):
    """benchmarks/online_vs_store.py --tiny, as the GPU machine (no Prefect, no vLLM) would import it."""
    script = ROOT / "benchmarks" / "online_vs_store.py"
    check = ("import runpy, sys; sys.argv = [sys.argv[1], '--tiny', '--root', sys.argv[2]]; "
             "runpy.run_path(sys.argv[0], run_name='__main__'); "
             "bad = sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'vllm'}); "
             "assert not bad, f'imported {bad}'")
    done = subprocess.run([sys.executable, "-c", check, str(script), str(tmp_path / "bench")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.split()[:1] in (["store"], ["online"],
                                                                                                ["hybrid"])}
    assert set(rows) == {"store", "online", "hybrid"}, done.stdout
    for mode in ("online", "hybrid"):  # fp32 on the CPU: the same losses at every step
        diff = float(rows[mode].split("max|dloss|=")[1].split()[0])
        assert diff <= 1e-5, rows[mode]


def _env() -> dict[str, str]:
    import os

    return os.environ | {"PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
