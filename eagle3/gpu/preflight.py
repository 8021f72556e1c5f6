"""Preflight before a target is loaded: do the GPUs have the memory it needs?

A 1T-parameter target takes about half an hour to load; finding out at the end of it that a
stranger's job holds 40 GiB of one GPU wastes that half hour. Before vLLM (or transformers,
for the HF backend) loads a target, `target_preflight` estimates what each GPU must hold:

    weight bytes (the checkpoint's *.safetensors / *.bin files) / tensor_parallel_size
    + the KV-cache budget (target.kv_cache_gib)

and checks it against NVML's free memory on the GPUs the engine will use (the first
tensor_parallel_size of CUDA_VISIBLE_DEVICES when that names GPUs by index, else 0..TP-1).
Short: InsufficientGpuMemoryError with the numbers per GPU. No NVIDIA driver (the CPU build
of vLLM, CI): nothing to check; the returned report says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle3.gpu.nvml import (
    GIB,
    MIB,
    InsufficientGpuMemoryError,
    NvmlLike,
    NvmlUnavailableError,
    open_nvml,
    preflight,
    required_bytes_per_gpu,
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's weight files (top level of the folder, where HF checkpoints keep them)."""
    return sum(p.stat().st_size for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def engine_devices(tensor_parallel_size: int) -> list[int]:
    """NVML indices of the GPUs an engine of this TP size takes."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if names and all(n.isdigit() for n in names):
        return [int(n) for n in names[:tensor_parallel_size]]
    return list(range(tensor_parallel_size))


def target_preflight(model_dir: Path, tensor_parallel_size: int, kv_cache_gib: float,
                     nvml: NvmlLike | None = None, kv_setting: str = "target.kv_cache_gib") -> dict[str, object]:
    """Check free GPU memory for loading the target at `model_dir`; returns a JSON-able report.
    `kv_setting`: the setting `kv_cache_gib` comes from, named in the refusal (the served engines': eval.served_kv_cache_gib).

    Raises InsufficientGpuMemoryError (from eagle3.gpu.nvml.preflight) naming each GPU that is short.
    """
    need = required_bytes_per_gpu(weight_bytes(model_dir), tensor_parallel_size, int(kv_cache_gib * GIB))
    report: dict[str, object] = {"need_mib": -(-need // MIB), "tensor_parallel_size": tensor_parallel_size,
                                 "kv_cache_gib": kv_cache_gib}
    opened = None
    if nvml is None:
        try:
            nvml = opened = open_nvml()
        except (NvmlUnavailableError, ImportError) as err:
            return report | {"checked": False, "reason": str(err)}
    try:
        devices = engine_devices(tensor_parallel_size)
        try:
            checked = preflight(need, nvml, devices)
        except (InsufficientGpuMemoryError, ValueError) as err:
            raise InsufficientGpuMemoryError(
                f"{err} Target {model_dir}: {report['need_mib']} MiB per GPU = weights / target.tensor_parallel_size="
                f"{tensor_parallel_size} + {kv_setting}={kv_cache_gib:g}; GPUs checked: {devices}."
            ) from err
        return report | {"checked": True, "gpus": [{"index": g.index, "free_mib": g.free_mib, "total_mib": g.total_mib}
                                                   for g in checked]}
    finally:
        if opened is not None:
            opened.close()
