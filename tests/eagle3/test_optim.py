"""The draft's Muon: batched Newton-Schulz gives torch.optim.Muon's update, and keeps its state layout."""

from __future__ import annotations

import pytest
import torch

from eagle3.train.optim import BatchedMuon

# mixed shapes: two of one shape, one tall and one wide of the same sides (batched together, one transposed),
# a square one and a lone odd one
SHAPES = [(64, 192), (64, 192), (96, 32), (32, 96), (48, 48), (7, 130)]
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.05) for shape in SHAPES]


def _steps(optimizer_class: type, params: list[torch.nn.Parameter], steps: int, seed: int) -> torch.optim.Optimizer:
    optimizer = optimizer_class(params, **SETTINGS)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("ns", ["bfloat16", "float32"])
def test_batched_muon_updates_as_torchs_muon_within_bf16_rounding(ns, monkeypatch):
    """Three steps over matrices of mixed shapes: every weight's change equals torch's to bf16 precision. With the
    orthogonalization in bf16 (as torch's; a GPU or a bf16 CPU) the two compute the same; in float32 (CPUs without
    bf16 hardware: ns_dtype) ours is the more precise, and the difference is torch's own bf16 rounding."""
    from eagle3.train import optim

    monkeypatch.setattr(optim, "ns_dtype", lambda device: getattr(torch, ns))
    start = _params(0)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in start]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in start]
    ours_opt = _steps(BatchedMuon, ours, 3, seed=1)
    theirs_opt = _steps(torch.optim.Muon, theirs, 3, seed=1)
    bound = 1e-2 if ns == "bfloat16" else 3e-2  # bf16 keeps 8 bits (4e-3 per rounding), over 5 iterations and 3 steps
    for shape, p0, a, b in zip(SHAPES, start, ours, theirs, strict=True):
        moved_a, moved_b = a.detach() - p0.detach(), b.detach() - p0.detach()
        error = (moved_a - moved_b).norm() / moved_b.norm()
        assert error < bound, (shape, float(error))
        assert moved_b.norm() > 0.1 * p0.norm()  # the step is not negligible against the weights
    for a, b in zip(ours, theirs, strict=True):  # the momentum buffers are plain fp32 sums: identical
        torch.testing.assert_close(ours_opt.state[a]["momentum_buffer"], theirs_opt.state[b]["momentum_buffer"],
                                   rtol=0, atol=0)


def test_a_state_written_by_torchs_muon_loads_and_continues_as_in_one_run():
    """A checkpoint's optimizer state from torch.optim.Muon (the code before) loads into BatchedMuon, and stopping
    and resuming BatchedMuon is bit for bit an uninterrupted run."""
    theirs = _params(0)
    written = _steps(torch.optim.Muon, theirs, 2, seed=1).state_dict()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    loaded = BatchedMuon(ours, **SETTINGS)
    loaded.load_state_dict(written)
    assert loaded.state_dict().keys() == written.keys()
    for key, value in written["state"].items():
        assert loaded.state_dict()["state"][key].keys() == value.keys() == {"momentum_buffer"}
        torch.testing.assert_close(loaded.state_dict()["state"][key]["momentum_buffer"], value["momentum_buffer"],
                                   rtol=0, atol=0)

    straight = _params(0)
    _steps(BatchedMuon, straight, 4, seed=1)
    first = _params(0)
    saved = _steps(BatchedMuon, first, 2, seed=1).state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    optimizer = BatchedMuon(resumed, **SETTINGS)
    optimizer.load_state_dict(saved)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # the gradients of steps 0 and 1, already taken
        for p in resumed:
            torch.randn(p.shape, generator=gen)
    for _ in range(2):
        for p in resumed:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    for a, b in zip(resumed, straight, strict=True):
        assert torch.equal(a, b)


def test_newton_schulz_runs_in_bf16_where_the_hardware_has_it_and_float32_on_other_cpus():
    """torch emulates bf16 matmuls on CPUs without AVX-512 BF16 or AMX (60x slower than float32 there), so the
    orthogonalization runs in float32 on those; a GPU and a bf16 CPU keep torch.optim.Muon's bf16."""
    from eagle3.capture.cpu_kernels import native_bf16, read_cpu_flags
    from eagle3.train.optim import newton_schulz, ns_dtype

    expected = torch.bfloat16 if native_bf16(read_cpu_flags()) else torch.float32
    assert ns_dtype(torch.device("cpu")) == expected
    assert ns_dtype(torch.device("cuda", 0)) == torch.bfloat16
    out = newton_schulz(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)))
    assert out.dtype == expected and out.shape == (2, 8, 16)
    singular = torch.linalg.svdvals(out.float())  # orthogonalized: singular values pushed towards 1
    assert float(singular.max()) < 1.5 and float(singular.min()) > 0.3, singular
