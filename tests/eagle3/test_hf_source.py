"""The transformers backend against the vLLM one (same tiny fp32 target), and the write path of extraction."""

from __future__ import annotations

import threading

import pytest
import torch

from eagle3.capture import vllm_adapter
from eagle3.capture.extract import (
    ExtractConfig,
    HostStager,
    ShardWriterPool,
    _ShardJob,
    extract_store,
)
from eagle3.capture.hf_source import HFSource, load_hf_target
from eagle3.capture.hooks import CaptureError
from eagle3.capture.source import HiddenStateSource, VllmSource, open_source
from eagle3.capture.store import StoreError, StoreReader, StoreWriter
from eagle3.data.conversations import TokenizedSample
from tests.on_device import KV_CACHE_GIB

IDS = [2, 4, 5, 8]  # aux ids of the 8-layer tiny target + the final state (id N)
H = 64


@pytest.fixture(scope="module")
def hf_model(tiny_target):
    return load_hf_target(str(tiny_target), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def engine(tiny_target):
    spec = vllm_adapter.EngineSpec(model_dir=str(tiny_target), dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    yield vllm_adapter.acquire(spec)
    vllm_adapter.release_all()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g)
    return [torch.randint(10, 500, (int(t),), generator=g).tolist() for t in lengths]


def _samples(n: int, seed: int = 0) -> list[TokenizedSample]:
    return [TokenizedSample(f"s{i}", p, [i % 2] * len(p)) for i, p in enumerate(_prompts(n, seed))]


def test_hf_backend_equals_vllm_backend(hf_model, engine):
    base = _prompts(1, seed=3)[0]
    prompts = _prompts(6) + [base, base[:4], base]  # mixed lengths (padding), shared prefixes, a duplicate
    hf = HFSource(hf_model, batch_tokens=10_000)
    vllm = VllmSource(engine, hidden_size=H)
    assert isinstance(hf, HiddenStateSource) and isinstance(vllm, HiddenStateSource)
    try:
        expected = vllm.capture(prompts, IDS)
    finally:
        vllm.close()
    got = hf.capture(prompts, IDS)
    assert hf.forward_passes == 1  # all prompts in one right-padded batch
    for p, a, b in zip(prompts, got, expected):
        assert a.shape == (len(p), len(IDS), H)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_extract_store_gives_the_same_store_with_either_backend(hf_model, engine, tmp_path):
    samples = _samples(7, seed=4)

    def run(backend: str, get_engine) -> StoreReader:  # noqa: ANN001
        config = ExtractConfig(backend=backend, samples_per_shard=2, batch_tokens=120, storage_dtype="float32")
        extract_store(samples, tmp_path / backend, get_engine=get_engine, aux_layer_ids=IDS[:-1], num_layers=8,
                      hidden_size=H, config=config, dtype=torch.float32, writer_threads=2, max_pending_shards=1)
        return StoreReader(tmp_path / backend, dequantize_dtype=torch.float32)

    from_vllm, from_hf = run("vllm", lambda: engine), run("hf", lambda: hf_model)
    from_hf.verify()
    assert [s.sample_id for s in from_hf] == [s.id for s in samples]
    for a, b, s in zip(from_hf, from_vllm, samples):
        assert a.input_ids.tolist() == s.input_ids and a.loss_mask.tolist() == [bool(m) for m in s.loss_mask]
        torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=1e-4, rtol=0)


def test_chunking_by_batch_tokens_keeps_prompt_order_and_values(hf_model):
    prompts = _prompts(9, seed=5)
    whole = HFSource(hf_model, batch_tokens=100_000).capture(prompts, IDS)
    small = HFSource(hf_model, batch_tokens=100)
    chunked = small.capture(prompts, IDS)
    assert small.forward_passes >= 5  # 9 prompts of up to 59 tokens, at most 100 padded tokens a forward
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_bad_inputs_are_named(hf_model):
    source = HFSource(hf_model)
    with pytest.raises(CaptureError, match=r"layer ids \[0, 9\].*1\.\.8"):
        source.capture([[1, 2, 3]], [0, 9])
    with pytest.raises(CaptureError, match=r"prompts \[1\] have no tokens"):
        source.capture([[1, 2], []], IDS)
    with pytest.raises(TypeError, match="extract.backend='hf'"):
        open_source("hf", object(), hidden_size=H, batch_tokens=100)


def test_extract_resumes_without_loading_the_target(hf_model, tmp_path):
    samples = _samples(5, seed=6)
    config = ExtractConfig(backend="hf", samples_per_shard=2, batch_tokens=64)
    kwargs = dict(aux_layer_ids=IDS[:-1], num_layers=8, hidden_size=H, config=config, dtype=torch.bfloat16)
    seen: list[tuple[int, int]] = []
    first = extract_store(samples, tmp_path, get_engine=lambda: hf_model, progress=lambda d, t: seen.append((d, t)), **kwargs)
    assert (first.shards_written, first.shards_reused) == (3, 0) and seen[-1] == (3, 3)
    (tmp_path / "shard-00001.safetensors").unlink()

    def must_not_load():  # noqa: ANN202
        raise AssertionError("the target was loaded although only one shard was missing")

    again = extract_store(samples, tmp_path, get_engine=lambda: hf_model, **kwargs)
    assert (again.shards_written, again.shards_reused) == (1, 2)
    done = extract_store(samples, tmp_path, get_engine=must_not_load, **kwargs)
    assert (done.shards_written, done.shards_reused) == (0, 3)
    reader = StoreReader(tmp_path)
    reader.verify()
    states = HFSource(hf_model).capture([s.input_ids for s in samples], IDS)
    for sample, ref in zip(reader, states):
        torch.testing.assert_close(sample.hidden_states, ref.to(torch.bfloat16), atol=1e-5, rtol=2**-7)  # one bf16 step: batches differ in fp32 rounding


# -- the write path (CPU: no pinning, no streams; same code as on the GPU) ---------------------
def _jobs(writer: StoreWriter, n_shards: int, tokens: int, bad_shard: int | None = None) -> list[_ShardJob]:
    stager, jobs = HostStager(), []
    for index in range(n_shards):
        members = [TokenizedSample(sid, list(range(tokens)), [1] * tokens) for sid in writer.expected[index]]
        width = H if index != bad_shard else H + 1  # a capture of the wrong hidden size
        staged = stager.stage([torch.randn(tokens, 2, width) for _ in members], writer.dtype)
        jobs.append(_ShardJob(index, members, staged, 0))
    return jobs


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("eagle3-shard-writer")]


def test_bounded_queue_holds_the_producer_back(tmp_path):
    groups = [[f"s{i}"] for i in range(8)]
    writer = StoreWriter(tmp_path, aux_layer_ids=[2], hidden_size=H, dtype=torch.float32, expected_shards=groups)
    with ShardWriterPool(writer, threads=1, max_pending=1) as pool:
        for job in _jobs(writer, 8, tokens=4096):  # 1 MiB per shard, fsynced: much slower than submitting
            pool.submit(job)
    assert pool.max_in_flight <= 3  # queued (1) + being written (1) + being submitted (1)
    assert sorted(pool.completed()) == list(range(8)) and writer.pending() == []
    assert _writer_threads() == []


def test_a_writer_error_is_raised_in_the_caller_and_the_threads_stop(tmp_path):
    groups = [[f"s{i}"] for i in range(4)]
    writer = StoreWriter(tmp_path, aux_layer_ids=[2], hidden_size=H, dtype=torch.float32, expected_shards=groups)
    with pytest.raises(StoreError, match=r"sample 's1': hidden_states shape \(16, 2, 65\), expected \(16, 2, 64\)"):
        with ShardWriterPool(writer, threads=2, max_pending=2) as pool:
            for job in _jobs(writer, 4, tokens=16, bad_shard=1):
                pool.submit(job)
    assert _writer_threads() == []
    assert 1 in writer.pending()


def test_packing_a_batch_is_a_view_when_its_rows_lie_back_to_back_and_a_copy_otherwise():
    """The stager's pack of one capture batch: rows of equal length are already [sum T, n, H] in memory (no copy on
    the GPU), padded rows are copied; either way the values are the prompts' own rows, in prompt order."""
    from eagle3.capture.extract import pack_states

    batch = torch.randn(3, 5, 2, 4)  # [B, T_max, n_ids, H], as the HF capture returns it
    equal = [batch[row, :5] for row in range(3)]
    packed = pack_states(equal)
    assert packed.data_ptr() == batch.data_ptr() and torch.equal(packed, batch.reshape(15, 2, 4))
    padded = [batch[0, :5], batch[1, :2], batch[2, :4]]
    packed = pack_states(padded)
    assert packed.data_ptr() != batch.data_ptr() and torch.equal(packed, torch.cat(padded))
    apart = [torch.randn(2, 2, 4), torch.randn(3, 2, 4)]  # separate tensors: copied
    assert torch.equal(pack_states(apart), torch.cat(apart))
