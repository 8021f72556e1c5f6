"""Bad input to extraction is a clear error before the target is loaded (the engine getter is never called)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from eagle3.capture.extract import ExtractConfig, ExtractInputError, extract_store
from eagle3.capture.layers import DecoderStackNotFound
from eagle3.capture.store import StoreReader
from eagle3.data.conversations import TokenizedSample

AUX, N, H = [2, 4, 5], 8, 64


def _never():  # noqa: ANN202
    raise AssertionError("the engine was asked for although the input is bad")


def _samples(*lengths: int) -> list[TokenizedSample]:
    return [TokenizedSample(f"s{i}", list(range(10, 10 + n)), [1] * n) for i, n in enumerate(lengths)]


def _extract(samples, store, *, aux=AUX, get_engine=_never, too_long="reject", max_model_len=None, backend="hf"):  # noqa: ANN001, ANN202
    config = ExtractConfig(backend=backend, samples_per_shard=2, storage_dtype="float32", too_long=too_long)
    return extract_store(samples, store, get_engine=get_engine, aux_layer_ids=aux, num_layers=N, hidden_size=H,
                         config=config, dtype=torch.float32, max_model_len=max_model_len)


@pytest.mark.parametrize(
    ("aux", "message"),
    [
        ([2, 4, 8], r"target\.aux_layer_ids=\[2, 4, 8\]: ids \[8\] are out of range .* 8 layers \(expected 1\.\.7"),
        ([0, 4, 5], r"ids \[0\] are out of range"),
        ([2, 4, 4], r"target\.aux_layer_ids=\[2, 4, 4\] has duplicates"),
        ([], r"target\.aux_layer_ids is empty"),
    ],
)
def test_bad_layer_ids_are_refused_before_the_engine(aux, message, tmp_path):
    with pytest.raises(ExtractInputError, match=message):
        _extract(_samples(5, 6), tmp_path, aux=aux)
    assert not (tmp_path / "manifest.json").exists()  # nothing written either


def test_an_empty_sample_is_refused_by_id(tmp_path):
    with pytest.raises(ExtractInputError, match=r"samples \['s1'\] have no tokens"):
        _extract(_samples(5, 0, 7), tmp_path)


def test_duplicate_sample_ids_are_refused(tmp_path):
    samples = _samples(5, 6) + [TokenizedSample("s0", [1, 2], [0, 1])]
    with pytest.raises(ExtractInputError, match=r"duplicate sample ids \['s0'\]"):
        _extract(samples, tmp_path)


def test_a_sample_too_long_is_rejected_naming_it_and_the_setting(tmp_path):
    # max_model_len 16: a prefill samples one token, so prompts may have 15
    with pytest.raises(ExtractInputError, match=r"samples \['s1', 's2'\] are longer than 15 tokens.*extract\.too_long='truncate'"):
        _extract(_samples(15, 16, 40), tmp_path, max_model_len=16)


def test_a_sample_too_long_is_truncated_with_a_warning_when_asked(tiny_target, tmp_path, caplog):
    from eagle3.capture.hf_source import load_hf_target

    model = load_hf_target(str(tiny_target), dtype="float32", device="cpu")
    samples = _samples(15, 40, 3)
    with caplog.at_level(logging.WARNING, logger="eagle3.capture.extract"):
        stats = _extract(samples, tmp_path, get_engine=lambda: model, too_long="truncate", max_model_len=16)
    assert "samples ['s1'] are longer than 15 tokens" in caplog.text and "truncated" in caplog.text
    assert stats.tokens == 15 + 15 + 3
    stored = list(StoreReader(tmp_path, dequantize_dtype=torch.float32))
    assert [len(s.input_ids) for s in stored] == [15, 15, 3]
    assert stored[1].input_ids.tolist() == samples[1].input_ids[:15] and stored[1].hidden_states.shape == (15, 4, H)


def test_no_length_check_without_max_model_len(tmp_path):
    with pytest.raises(AssertionError, match="engine was asked for"):  # got past the input checks
        _extract(_samples(400), tmp_path)


def test_a_model_without_a_decoder_stack_reaches_the_caller_naming_the_paths(tmp_path):
    with pytest.raises(DecoderStackNotFound, match=r"cannot find the decoder layers of Sequential.*tried: model\.layers"):
        _extract(_samples(5), tmp_path, get_engine=lambda: nn.Sequential(nn.Linear(4, 4)))


def test_the_extract_stage_checks_lengths_against_the_targets_max_model_len(tiny_target, builtin_cache, tmp_path):
    from eagle3.artifacts import StageRecord
    from eagle3.data import conversations
    from eagle3.data.target import TargetConfig
    from eagle3.stages import run_extract, run_stage_target

    target_config = TargetConfig(model="builtin:tiny", dtype="float32", max_model_len=16)
    target = run_stage_target(target_config, builtin_cache, tmp_path / "artifacts", "t")
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    conversations.write_samples(prepared / "train.jsonl", _samples(5, 20))
    conversations.write_samples(prepared / "heldout.jsonl", _samples(4))
    record = StageRecord(stage="prepare_data", uri=str(prepared), fingerprint="p")
    with pytest.raises(ExtractInputError, match=r"samples \['s1'\] are longer than 15 tokens \(target\.max_model_len=16"):
        run_extract(ExtractConfig(), target_config, record, target, tmp_path / "artifacts", "x", tmp_path / "loads.jsonl")
    assert not (tmp_path / "loads.jsonl").exists()  # refused before the target was loaded
