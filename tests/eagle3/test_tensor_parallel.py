"""Tensor parallelism on the CPU: only TP rank 0 copies rows; the rank comes from vLLM / torch.distributed.

That a TP=2 engine (vLLM's mp executor, real worker processes) captures what the TP=1 engine does is checked in
`make test` on the tiny Kimi-K2.5 with its vision tower (MLA, MoE, the vision wrapper; images and a text-only
conversation), and that it leaves no worker or shared-memory file once stopped: tests/eagle3/test_capture_images.py's
TP 2 test. The tiny Llama's TP 2 run is the CLI's, in tests/e2e/test_parallel_runs.py. TP_SCRIPT below is the
compatibility set's TP 2 check (tests/eagle3/test_vllm_compat.py, `make test-vllm`)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from eagle3.capture import vllm_adapter
from eagle3.capture.hooks import HiddenStateCapture, tensor_parallel_rank
from eagle3.capture.layers import resolve_decoder_stack
from tests.on_device import KV_CACHE_GIB

IDS, H = [2, 8], 64
PROMPTS = [[10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]


@pytest.fixture(scope="module")
def engine(tiny_target):
    spec = vllm_adapter.EngineSpec(model_dir=str(tiny_target), dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    yield vllm_adapter.acquire(spec)
    vllm_adapter.release_all()


def _capture(llm, rank):  # noqa: ANN001, ANN202
    cap = HiddenStateCapture(resolve_decoder_stack(vllm_adapter.torch_module(llm)), IDS, rank=rank)
    cap.install()
    try:
        with cap.collecting(PROMPTS, hidden_size=H) as states:
            vllm_adapter.prefill(llm, PROMPTS)
    finally:
        cap.remove()
    return states, cap


def test_rank_0_copies_rows_and_other_ranks_copy_nothing_without_error(engine):
    on_rank0, cap0 = _capture(engine, lambda: 0)
    on_rank1, cap1 = _capture(engine, lambda: 1)
    assert [s.shape for s in on_rank0] == [(4, 2, H), (7, 2, H)] and all(s.abs().sum() > 0 for s in on_rank0)
    assert cap0.rows_seen == 11 and cap0.forward_passes >= 1
    assert on_rank1 == [] and cap1.rows_seen == 0 and cap1.forward_passes == 0  # the forward ran untouched
    again, _ = _capture(engine, lambda: 0)  # the engine is unharmed: rank 0 captures the same states again
    for a, b in zip(again, on_rank0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_the_in_process_engine_is_tp_rank_0_by_vllms_own_parallel_state(engine):
    from vllm.distributed import parallel_state

    assert parallel_state.model_parallel_is_initialized()  # so the rank came from vLLM, not the fallback
    assert tensor_parallel_rank() == 0


TP_SCRIPT = """
import multiprocessing, os, sys, torch
from eagle3.capture import vllm_adapter
from eagle3.capture.source import open_source
from eagle3.capture.tp_capture import TensorParallelVllmSource
from tests.on_device import KV_CACHE_GIB

def states(tp, prompts):
    spec = vllm_adapter.EngineSpec(model_dir=sys.argv[1], dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=tp, trust_remote_code=False, seed=0)
    llm = vllm_adapter.acquire(spec)
    source = open_source("vllm", llm, hidden_size=%(H)d, batch_tokens=4096)
    assert isinstance(source, TensorParallelVllmSource) == (tp > 1), type(source)
    try:
        return [source.capture(p, %(IDS)r) for p in prompts]
    finally:
        source.close()
        vllm_adapter.release_all()

if __name__ == "__main__":  # vLLM's workers are spawned: they import this file again
    prompts = [%(PROMPTS)r, %(PROMPTS)r[::-1]]  # two batches through the same installed capture
    one, two = states(1, prompts), states(2, prompts)
    diff = max(float((a - b).abs().max()) for x, y in zip(one, two) for a, b in zip(x, y, strict=True))
    print("workers left", [p.pid for p in multiprocessing.active_children()], flush=True)
    from eagle3.capture.tp_capture import SHM_PREFIX, shm_dir
    print("shared files left", sorted(str(f) for f in shm_dir().glob(f"{SHM_PREFIX}{os.getpid()}-*")), flush=True)
    print("shapes", [tuple(s.shape) for s in two[0]], "max_abs_diff", diff, flush=True)
"""


def _report_rank(rank: int, world: int, port: int, out: dict) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = tensor_parallel_rank()
    finally:
        torch.distributed.destroy_process_group()


def test_without_vllm_the_rank_is_torch_distributeds():
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_report_rank, args=(2, port, out), nprocs=2, join=True)
        assert dict(out) == {0: 0, 1: 1}
