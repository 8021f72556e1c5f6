"""Issue 47's side by side: one target with an EAGLE-3 draft and a DFlash draft trained on the same data, each
served by vLLM at the concurrencies asked for, then one table of what each draft gives.

Two runs of the pipeline in one run folder (the CLI, as a user runs it): the EAGLE-3 run first, then the same
command with `train.draft.method=dflash`, which finds every stage up to vocab Cached (the same target, answers,
states and held-out prompts) and trains, exports and evaluates the DFlash draft. Both evaluate stages run the
served sweep (eval.served_concurrency): tokens/s with and without the draft on the same prompts in waves of c
requests. The table gives per draft its training time, the estimate the train stage picks checkpoints by (the
walk), vLLM's served acceptance, and the speedup at each concurrency; then DFlash's speedup over EAGLE-3's at
each concurrency (issue 47's goal: >= 1.5 at concurrency 1).

    python benchmarks/dflash_vs_eagle3.py --run-dir /tmp/sbs --concurrency 1 8 32          # GPU, the demo preset
    .venv/bin/python benchmarks/dflash_vs_eagle3.py --preset tiny --mask-token 1 --run-dir /tmp/sbs-tiny \\
        --concurrency 1 4                                                                    # CPU smoke check

SmolLM2's mask token (the demo's target) is 16, `<empty_output>`; the tiny preset's random target takes 1. The
EAGLE-3 draft is swept at k = block - 1 (the DFlash draft's one k) unless --eagle3-k names others; the best k per
concurrency is the one compared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from flows.cli import main; sys.exit(main())"


def run_pipeline(preset: str, run_dir: Path, settings: list[str]) -> float:
    """One `eagle3 run` through the CLI; its wall seconds. Exits with its code if it fails."""
    args = [sys.executable, "-c", CLI, "run", "--preset", preset, "--run-dir", str(run_dir)]
    for setting in settings:
        args += ["--set", setting]
    print("$ eagle3 " + " ".join(args[3:]), flush=True)
    started = time.monotonic()
    done = subprocess.run(args, cwd=ROOT, check=False)
    if done.returncode != 0:
        sys.exit(f"error: the run above failed (exit {done.returncode}); its log is in {run_dir}/logs")
    return time.monotonic() - started


def stage_record(run_dir: Path, stage: str) -> tuple[Path, dict]:
    """The artifact folder of `stage` in the run's summary.json and its record's stats."""
    summary = json.loads((run_dir / "summary.json").read_text())
    folder = Path(next(row["artifact"] for row in summary["stages"] if row["name"] == stage))
    return folder, json.loads((folder / ".eagle3-complete.json").read_text())["record"]["stats"]


def figures(run_dir: Path) -> dict:
    """What the last run in `run_dir` gave: train seconds, the walk, served acceptance, best speedup per concurrency."""
    _, train = stage_record(run_dir, "train")
    evaluate, _ = stage_record(run_dir, "evaluate")
    payload = json.loads((evaluate / "acceptance.json").read_text())
    simulated, served = payload["simulated"], payload["served"] or {}
    best: dict[int, dict] = {}
    for row in payload.get("served_sweep", {}).get("rows", []):
        c = row["concurrency"]
        if c not in best or row["speedup"] > best[c]["speedup"]:
            best[c] = row
    return {"train_s": train.get("seconds"), "steps": train.get("steps"),
            "walk": simulated.get("walk", simulated.get("served_acceptance_length")),
            "served": served.get("acceptance_length"), "identical": f"{served.get('identical')}/{served.get('num_prompts')}",
            "best": best, "evaluate": str(evaluate)}


def table(rows: dict[str, dict], concurrencies: list[int]) -> str:
    head = "| draft | train s | walk | served acceptance | greedy identical | " + " | ".join(
        f"speedup at c={c} (k, acceptance)" for c in concurrencies) + " |"
    lines = [head, "|" + "---|" * (5 + len(concurrencies))]
    for name, f in rows.items():
        cells = []
        for c in concurrencies:
            row = f["best"].get(c)
            cells.append("n/a" if row is None else
                         f"{row['speedup']:.2f}x (k {row['k']}, {row['acceptance_length']:.3f})")
        lines.append(f"| {name} | {f['train_s']} | {f['walk']:.3f} | {f['served']:.3f} | {f['identical']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--block", type=int, default=4, help="DFlash block size (it drafts block - 1 tokens)")
    parser.add_argument("--mask-token", type=int, default=16, help="train.draft.mask_token_id (SmolLM2: 16)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--eagle3-k", type=int, nargs="+", default=None, help="k the EAGLE-3 sweep tries")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="a setting for both runs")
    args = parser.parse_args()
    ks = args.eagle3_k or [args.block - 1]
    both = [f"eval.served_concurrency={json.dumps(args.concurrency)}", "eval.served=true", *args.extra]
    eagle3_wall = run_pipeline(args.preset, args.run_dir, [*both, f"eval.served_k={json.dumps(ks)}"])
    eagle3 = figures(args.run_dir)
    dflash_wall = run_pipeline(args.preset, args.run_dir, [
        *both, "train.draft.method=dflash", f"train.draft.mask_token_id={args.mask_token}",
        f"train.draft.block_size={args.block}"])
    dflash = figures(args.run_dir)
    print(f"\n# {args.preset} preset, run folder {args.run_dir}; EAGLE-3 run {eagle3_wall:.0f} s, DFlash run "
          f"{dflash_wall:.0f} s (stages up to vocab Cached); DFlash block {args.block} (k = {args.block - 1}), "
          f"EAGLE-3 k {ks}")
    print(table({"EAGLE-3": eagle3, f"DFlash (block {args.block})": dflash}, args.concurrency))
    print()
    for c in args.concurrency:
        ours, theirs = dflash["best"].get(c), eagle3["best"].get(c)
        if ours and theirs and theirs["speedup"] > 0:
            goal = " (issue 47's goal: >= 1.5)" if c == 1 else ""
            print(f"concurrency {c}: DFlash {ours['speedup']:.2f}x / EAGLE-3 {theirs['speedup']:.2f}x = "
                  f"{ours['speedup'] / theirs['speedup']:.2f}{goal}")
    print(f"evaluate artifacts: EAGLE-3 {eagle3['evaluate']}, DFlash {dflash['evaluate']}")


if __name__ == "__main__":
    main()
