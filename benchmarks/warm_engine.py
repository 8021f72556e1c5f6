"""The rerun after a failed extract, with and without a warm engine (issue 25), on the demo target (SmolLM2).

    .venv/bin/python benchmarks/warm_engine.py --out benchmarks/results/warm-engine-2026-12-02.txt

Both arms share one artifact root whose regenerate and prepare_data artifacts a first (untimed) run leaves;
each arm then starts with no artifact from extract on (extract, vocab, train, export, evaluate removed):

    failing run   eagle3 run --preset demo ... with extract failing after half its shards (a fake full disk,
                  tests/reliability/fail_extract.py), target.keep_warm_s = 600 (warm) or 0 (cold: in-process)
    rerun         the same command without the fault: timed (wall seconds of the whole command)

The rerun's summary.json says whether it loaded (seconds) or attached (seconds saved). To keep the figure about
the target, the draft side is short (train.steps 10, warmup 2, eval.served false): both arms train and evaluate the same.
The machine is shared: the load average is noted before each timed rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import start_prefect_server  # noqa: E402 - the one Prefect server start of the benchmarks
COMMON = ["--set", "train.steps=10", "--set", "train.warmup_steps=2", "--set", "train.checkpoint_every=10",
          "--set", "eval.served=false"]
DOWNSTREAM = ("extract", "vocab", "train", "export", "evaluate")
SHARDS_BEFORE_FAILURE = 5  # of the demo's 10 (288 + 32 samples, 32 a shard)


def _eagle3(args: list[str], env: dict[str, str], fail_after: int | None = None) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "flows.cli", *args] if fail_after is None else \
        [sys.executable, "-m", "tests.reliability.fail_extract", str(fail_after), *args]
    started = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    return done.returncode, time.time() - started, done.stdout + done.stderr


def _arm(name: str, keep_warm_s: int, work: Path, env: dict[str, str], lines: list[str]) -> dict:
    for stage in DOWNSTREAM:  # each arm extracts (and trains, exports, evaluates) afresh
        shutil.rmtree(work / "artifacts" / stage, ignore_errors=True)
    shutil.rmtree(work / name, ignore_errors=True)
    run = ["run", "--preset", "demo", "--run-dir", str(work / name), "--set", f"artifact_root={work / 'artifacts'}",
           "--set", f"target.keep_warm_s={keep_warm_s}", *COMMON]
    rc, seconds, output = _eagle3(run, env, fail_after=SHARDS_BEFORE_FAILURE)
    if not (work / name / "summary.json").is_file():
        raise RuntimeError(f"{name}: the failing run left no summary.json: {output[-2000:]}")
    failed = json.loads((work / name / "summary.json").read_text())
    lines.append(f"[{name}] failing run: rc {rc}, {seconds:.1f} s; {output.strip().splitlines()[-1]}")
    lines.append(f"[{name}]   its target_loads: {json.dumps(failed['target_loads'])}")
    load = os.getloadavg()
    rc, seconds, output = _eagle3(run, env)
    summary = json.loads((work / name / "summary.json").read_text())
    stages = {row["name"]: row["seconds"] for row in summary["stages"] if row["name"] != "gpu_cleanup"}
    lines.append(f"[{name}] rerun: rc {rc}, {seconds:.1f} s wall; load average before it {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    lines.append(f"[{name}]   stage seconds: {json.dumps(stages)}")
    lines.append(f"[{name}]   its target_loads: {json.dumps(summary['target_loads'])}")
    return {"wall": seconds, "rc": rc, "loads": summary["target_loads"], "extract": stages.get("extract")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-warm-engine")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)  # a previous run's regenerate and prepare_data are reused (Cached)
    shutil.rmtree(args.work / "prefect-home", ignore_errors=True)
    (args.work / "prefect-home").mkdir()
    server, url = start_prefect_server(args.work / "prefect-home")
    env = os.environ | {"PREFECT_API_URL": url, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    lines = [f"warm engine benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
             f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"command: {' '.join(sys.argv)}", ""]
    try:
        prep = ["run", "--preset", "demo", "--run-dir", str(args.work / "prep"), "--set",
                f"artifact_root={args.work / 'artifacts'}", *COMMON]
        rc, seconds, _ = _eagle3(prep, env, fail_after=0)  # regenerate + prepare_data, then extract fails at once
        lines.append(f"[prep] regenerate + prepare_data for both arms (extract fails at once): rc {rc}, {seconds:.1f} s")
        cold = _arm("cold", 0, args.work, env, lines)
        warm = _arm("warm", 600, args.work, env, lines)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
    loaded = next((e for e in cold["loads"] if e.get("event", "loaded") == "loaded"), {})
    attached = next((e for e in warm["loads"] if e.get("event") == "attached"), {})
    lines += ["", f"rerun wall time: cold (loads the target again) {cold['wall']:.1f} s, warm (attaches) {warm['wall']:.1f} s, "
              f"saved {cold['wall'] - warm['wall']:.1f} s",
              f"target load in the cold rerun: {loaded.get('seconds')} s (in-process); the warm rerun's record says "
              f"seconds_saved {attached.get('seconds_saved')} (the engine process's own load, pid {attached.get('engine_pid')})"]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if cold["rc"] == 0 and warm["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
