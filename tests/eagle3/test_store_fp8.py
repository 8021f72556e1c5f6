"""fp8 (e4m3) storage with per-row scales: error on realistic states, round trip, format, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.capture.store import (
    FP8,
    FP8_MAX,
    MANIFEST,
    SCALES,
    Sample,
    StoreError,
    StoreReader,
    StoreWriter,
    dequantize_fp8,
    encode_states,
    quantize_fp8,
)

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most half a step, 2^-4 of it.
# Values pushed into the subnormal range by the row's scale move by at most 2^-10 * scale =
# amax / 458752 each, so a row's relative error is <= 2^-4 + sqrt(H) / 458752 (< 2^-4 + 1e-4 at H=1024).
ROW_BOUND = 2**-4 + 1e-4
# Mean over rows: rounding error uniform over half a step, mantissas spread over [1, 2): about
# 2.7% (the 8B-shaped benchmark measured 2.65%); 3% leaves room for the sample, not for a bug.
MEAN_BOUND = 0.03


def realistic_states(tokens: int = 256, hidden: int = 1024, seed: int = 0) -> torch.Tensor:
    """[T, 4, H] with the statistics that make quantizing LLM hidden states hard.

    - the residual stream grows with depth: rows at the 4 stored layers differ 64x in scale;
    - channels are heavy-tailed: per-channel scales log-normal (a few channels ~10x the rest);
    - "massive activations": the first token and one delimiter carry two channels at ~1e3-1e4x
      a typical element (Sun et al. 2024), the rows a per-tensor scale would be set by.
    """
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(hidden, generator=g))  # [H]
    depth = torch.tensor([1.0, 4.0, 16.0, 64.0])  # [4]
    x = torch.randn(tokens, 4, hidden, generator=g) * channel * depth[:, None]  # [T, 4, H]
    for t in (0, 17):
        x[t, 1:, 7] = 2000.0 * depth[1:]
        x[t, 1:, 400] = -900.0 * depth[1:]
    return x


def _row_error(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.float() - ref).norm(dim=-1) / ref.norm(dim=-1)  # [T, rows]


def test_per_row_fp8_error_is_bounded_and_nothing_is_clipped():
    x = realistic_states()
    values, scales = quantize_fp8(x)
    assert values.dtype == FP8 and values.shape == x.shape and scales.shape == x.shape[:2]
    got = dequantize_fp8(values, scales, torch.float32)
    err = _row_error(got, x)
    assert float(err.max()) <= ROW_BOUND and float(err.mean()) <= MEAN_BOUND
    # the massive activations (up to 128,000, far beyond e4m3's 448) come back, not clipped
    torch.testing.assert_close(got[0, 3, 7], x[0, 3, 7], rtol=2**-4, atol=0)
    # one scale for the whole tensor is set by those rows and pushes the ordinary shallow rows
    # toward e4m3's subnormals: 2x the error here, 12x when the massive activations are 10x larger
    scale = x.abs().max() / FP8_MAX
    per_tensor = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    ordinary = slice(1, 17), 0  # tokens 1..16 at the shallowest stored layer
    assert float(_row_error(per_tensor, x)[ordinary].mean()) > 1.5 * float(err[ordinary].mean())


def test_zero_rows_stay_zero_and_finite():
    x = torch.zeros(3, 2, 16)
    x[1, 1, 4] = 1e-3
    values, scales = quantize_fp8(x)
    got = dequantize_fp8(values, scales, torch.float32)
    assert torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(2, 16))
    assert float(got[1, 1, 4]) == pytest.approx(1e-3, rel=2**-4)


def _store(root: Path, dtype: torch.dtype, samples: list[Sample]) -> StoreWriter:
    writer = StoreWriter(root, aux_layer_ids=[2, 4, 5], hidden_size=1024, dtype=dtype, expected_shards=[[s.sample_id] for s in samples])
    for i, s in enumerate(samples):
        writer.write_shard(i, [s])
    return writer


def _samples(n: int) -> list[Sample]:
    out = []
    for k in range(n):
        x = realistic_states(tokens=64, seed=k)
        out.append(Sample(f"s{k}", torch.arange(64) + k, torch.arange(64) % 3 == 0, x))
    return out


def test_fp8_store_round_trip_halves_the_bytes(tmp_path):
    samples = _samples(3)
    _store(tmp_path / "bf16", torch.bfloat16, samples)
    pre = samples[2]
    values, scales = encode_states(pre.hidden_states, FP8)  # what extraction hands over: already encoded
    _store(tmp_path / "fp8", FP8, samples[:2] + [Sample(pre.sample_id, pre.input_ids, pre.loss_mask, values, scales)])
    manifest = json.loads((tmp_path / "fp8" / MANIFEST).read_text())
    assert (manifest["dtype"], manifest["hidden_scales"]) == ("float8_e4m3fn", SCALES)

    reader = StoreReader(tmp_path / "fp8")
    reader.verify()
    for sample, ref in zip(reader, samples):
        assert sample.hidden_states.dtype == torch.bfloat16  # dequantized on read
        assert torch.equal(sample.input_ids, ref.input_ids) and torch.equal(sample.loss_mask, ref.loss_mask)
        err = _row_error(sample.hidden_states, ref.hidden_states)
        assert float(err.max()) <= ROW_BOUND + 2**-8 and float(err.mean()) <= MEAN_BOUND  # + bf16's own rounding
    as_fp32 = StoreReader(tmp_path / "fp8", dequantize_dtype=torch.float32)[0].hidden_states
    assert as_fp32.dtype == torch.float32 and float(_row_error(as_fp32, samples[0].hidden_states).max()) <= ROW_BOUND

    raw = load_file(str(tmp_path / "fp8" / "shard-00000.safetensors"))  # plain safetensors reads our files
    assert raw["0.hidden_states"].dtype == FP8 and raw["0.hidden_scales"].shape == (64, 4)
    size = {d: sum(e["size"] for e in json.loads((tmp_path / d / MANIFEST).read_text())["shards"]) for d in ("fp8", "bf16")}
    assert size["fp8"] / size["bf16"] < 0.52  # 1 byte + 4/H bytes of scale per element instead of 2


def test_a_store_of_another_dtype_is_not_resumed(tmp_path):
    samples = _samples(2)
    _store(tmp_path, torch.bfloat16, samples)
    again = StoreWriter(tmp_path, aux_layer_ids=[2, 4, 5], hidden_size=1024, dtype=FP8, expected_shards=[["s0"], ["s1"]])
    assert again.pending() == [0, 1]


def test_scales_and_dtypes_that_do_not_fit_are_errors(tmp_path):
    s = _samples(1)[0]
    values, scales = encode_states(s.hidden_states, FP8)
    fp8 = StoreWriter(tmp_path / "a", aux_layer_ids=[2, 4, 5], hidden_size=1024, dtype=FP8, expected_shards=[["s0"]])
    with pytest.raises(StoreError, match="without hidden_scales"):
        fp8.write_shard(0, [Sample("s0", s.input_ids, s.loss_mask, values)])
    bf16 = StoreWriter(tmp_path / "b", aux_layer_ids=[2, 4, 5], hidden_size=1024, dtype=torch.bfloat16, expected_shards=[["s0"]])
    with pytest.raises(StoreError, match="hidden_scales"):
        bf16.write_shard(0, [Sample("s0", s.input_ids, s.loss_mask, values, scales)])
    assert not list((tmp_path / "a").glob("shard-*")) and not list((tmp_path / "b").glob("shard-*"))
