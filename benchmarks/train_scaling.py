"""Multi-GPU training the way the train stage launches it: 1 process (train_draft) against N
(eagle3.train.launch.train_distributed: torchrun over eagle3.train.ddp), side by side in one call.

Same random 8B-shaped target and store as benchmarks/train_throughput.py (written once), same
TrainConfig (grad_accum = N x --accum-per-gpu micro-batches of one 2048-token sample per step,
so each GPU does the same work per step in both runs). Tokens/s come from the steps as they land
in the trainer's losses.jsonl, between the first step after --warm and the last (compile and
allocator warm-up excluded). Prints both figures and the ratio to N x one GPU.

    python benchmarks/train_scaling.py [--gpus 2] [--steps 160] [--warm 40] [--accum-per-gpu 4]
    python benchmarks/train_scaling.py --tiny --gpus 2          # CPU smoke check (gloo)
    python benchmarks/train_scaling.py --gpus 1                 # one GPU: in-process vs torchrun with 1 process
                                                                # (the launcher's own cost, NCCL with one rank)
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.train.launch import train_distributed  # noqa: E402
from eagle3.train.trainer import TrainConfig, train_draft  # noqa: E402

_spec = importlib.util.spec_from_file_location("train_rig", ROOT / "benchmarks" / "train_rig.py")
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)


def tokens_per_second(marks: list[tuple[float, int]], warm: int, tokens_per_step: int) -> float:
    """From (wall time, step) marks: tokens/s between the first mark past `warm` and the last."""
    after = [(t, s) for t, s in marks if s > warm]
    (t0, s0), (t1, s1) = after[0], after[-1]
    return (s1 - s0) * tokens_per_step / max(t1 - t0, 1e-9)


def run(processes: int, config: TrainConfig, paths: dict, out: Path, warm: int, tokens_per_step: int,
        torchrun: bool = False) -> float:
    shutil.rmtree(out, ignore_errors=True)
    marks: list[tuple[float, int]] = []
    progress = lambda step, total, loss: marks.append((time.perf_counter(), step))  # noqa: E731
    if processes == 1 and not torchrun:
        train_draft(config, out_dir=out, progress=progress, **paths)
    else:
        train_distributed(config, processes, out_dir=out, progress=progress, **paths)
    return tokens_per_second(marks, warm, tokens_per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--accum-per-gpu", type=int, default=4)
    parser.add_argument("--root", default="/tmp/train-scaling")
    args = parser.parse_args()
    shape = tt.SHAPE_TINY if args.tiny else tt.SHAPE_8B
    device = torch.device("cpu" if args.tiny else "cuda")
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    target, head_file, vocab = tt.write_target(root, shape, device)
    samples = args.gpus * args.accum_per_gpu * 4
    store, _ = tt.write_store(root, shape, samples, device)
    paths = {"store_dir": store, "target_dir": target, "head_path": head_file, "vocab_path": vocab}
    accum = args.gpus * args.accum_per_gpu
    config = TrainConfig(steps=args.steps, warmup_steps=5, checkpoint_every=args.steps, batch_tokens=shape["seq"],
                         grad_accum=accum, ttt_steps=3, loader_threads=4)
    tokens_per_step = accum * shape["seq"]
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"device {name} x{torch.cuda.device_count() if device.type == 'cuda' else 1}; torch {torch.__version__}; "
          f"shape {'tiny' if args.tiny else '8B'}; grad_accum {accum} x {shape['seq']} tokens; steps {args.steps}, "
          f"timed after step {args.warm}", flush=True)
    one = run(1, config, paths, root / "one", args.warm, tokens_per_step)
    print(f"1 process (train_draft, as the stage runs num_processes=1): {one:,.0f} tokens/s", flush=True)
    many = run(args.gpus, config.model_copy(update={"num_processes": args.gpus}), paths, root / "many", args.warm,
               tokens_per_step, torchrun=True)
    print(f"{args.gpus} processes (torchrun via eagle3.train.launch, as the stage runs num_processes={args.gpus}): "
          f"{many:,.0f} tokens/s", flush=True)
    print(f"ratio to {args.gpus} x one: {many / (args.gpus * one):.3f}", flush=True)


if __name__ == "__main__":
    main()
