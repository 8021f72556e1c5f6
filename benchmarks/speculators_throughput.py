"""speculators 0.9.0's own trainer at train_throughput.py's shape: tokens/s of its training steps.

Runs `speculators.train.cli.main` (its CLI entry point) in a child process on synthetic inputs of the
same shape as benchmarks/train_throughput.py's (the 8B-shaped target's config and random head, random
2048-token samples with random hidden states [T, 4, H]), AdamW, TTT 3, its fused Triton loss on CUDA, and the
same plain EAGLE-3 layer as ours (--no-norm-before-fc --no-norm-output). Step times come from a step callback
wrapped around its Trainer.train_epoch (a device synchronize, then the clock); the first steps are left out.

Patches, in the child only:
- CUDA, torch 2.11: its fused loss fails to compile ("ListVariable ... is already tracked for mutation"):
  loss_forward_kernel and loss_backward_kernel share one triton.autotune decorator, so one config list; the
  backward kernel gets its own autotuner over fresh copies of the configs (the same search space).
- CPU (--tiny): its Trainer moves to device 0 and synchronizes the accelerator; "cpu" and a no-op instead
  (FIELD-NOTES), with --loss-implementation eager and --draft-attn-impl sdpa.

    python benchmarks/speculators_throughput.py            # GPU, 8B shape (needs datasets + speculators)
    python benchmarks/speculators_throughput.py --tiny     # CPU smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_rig import SHAPE_8B, SHAPE_TINY, write_target  # noqa: E402

from eagle3.draft.vocab import load_mapping  # noqa: E402

_CHILD = r"""
import json, sys, time, torch
import speculators.train.trainer as trainer_module
if torch.cuda.is_available():
    import triton
    import speculators.losses.fused as fused
    fused.loss_backward_kernel = triton.autotune(configs=fused._tile_configs(), key=["n_cols", "OP"],
        prune_configs_by={"early_config_prune": fused._prune_oversized_tiles})(fused.loss_backward_kernel.fn)
else:
    trainer_module.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None
stamps = []
original = trainer_module.Trainer.train_epoch
def timed(self, epoch, *, step_callback=None):
    def stamp():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        if step_callback is not None:
            step_callback()
    return original(self, epoch, step_callback=stamp)
trainer_module.Trainer.train_epoch = timed
from speculators.train.cli import main
from speculators.train.config import TrainConfig
try:
    main(TrainConfig.resolve(sys.argv[2:]))
finally:
    open(sys.argv[1], "w").write(json.dumps(stamps))
"""


def write_dataset(out: Path, s: dict, num_samples: int) -> Path:
    """Random samples in speculators' format: an Arrow dataset (input_ids, loss_mask, seq_len) and
    hidden_states/hs_<i>.safetensors ({"hidden_states": [T, 4, H] bf16, "token_ids": [T]})."""
    from datasets import Dataset
    from safetensors.torch import save_file

    (out / "hidden_states").mkdir(parents=True)
    gen = torch.Generator().manual_seed(2)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(num_samples):
        tokens = torch.randint(0, s["vocab"], (s["seq"],), generator=gen)
        mask = torch.ones(s["seq"], dtype=torch.int64)
        mask[: s["seq"] // 8] = 0  # a prompt, as train_throughput's store has
        rows["input_ids"].append(tokens.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(s["seq"])
        states = torch.randn(s["seq"], 4, s["hidden"], generator=gen).to(torch.bfloat16)
        save_file({"hidden_states": states, "token_ids": tokens}, str(out / "hidden_states" / f"hs_{i}.safetensors"))
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out))
    return out


def run(args: argparse.Namespace) -> float:
    cuda = torch.cuda.is_available() and not args.tiny
    s = SHAPE_TINY if args.tiny else SHAPE_8B
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    target, head, vocab = write_target(root, s, torch.device("cuda" if cuda else "cpu"))
    shutil.copy(head, target / "model.safetensors")  # embed_tokens, norm, lm_head: what its verifier loader reads
    mapping = load_mapping(vocab)
    import numpy as np

    np.save(root / "d2t.npy", mapping.d2t.numpy())
    np.save(root / "t2d.npy", mapping.t2d.numpy())
    data = write_dataset(root / "data", s, args.samples)
    aux = [2, s["layers"] // 2, s["layers"] - 3]
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(target), "--data-path", str(data),
            "--save-path", str(root / "out"), "--d2t-path", str(root / "d2t.npy"), "--t2d-path", str(root / "t2d.npy"),
            "--draft-vocab-size", str(s["draft_vocab"]), "--target-layer-ids", *map(str, aux),
            "--total-seq-len", str(s["seq"]), "--hidden-states-dtype", "bfloat16" if cuda else "float32",
            "--ttt-steps", "3", "--lr", "1e-5", "--optimizer", "adamw", "--epochs", "1", "--max-steps", str(args.steps),
            "--train-data-ratio", "0.95", "--on-missing", "raise", "--no-resume-from-checkpoint",
            "--num-workers", str(args.workers), "--no-norm-before-fc", "--no-norm-output",
            "--mask-token-id", "0"]  # no tokenizer in the target folder to look one up in
    if not cuda:
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    stamps_path = root / "stamps.json"
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    with open(root / "speculators.log", "w") as log:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(stamps_path), *argv], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    stamps = json.loads(stamps_path.read_text()) if stamps_path.is_file() else []
    if done.returncode != 0 or len(stamps) < 4:
        tail = (root / "speculators.log").read_text()[-3000:]
        raise RuntimeError(f"speculators' trainer exited {done.returncode} after {len(stamps)} steps:\n{tail}")
    skip = min(5, len(stamps) - 3)
    step = statistics.median(b - a for a, b in zip(stamps[skip:], stamps[skip + 1 :], strict=False))
    return s["seq"] / step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke check)")
    parser.add_argument("--root", default="/tmp/speculators-throughput", help="scratch folder on the local disk")
    parser.add_argument("--samples", type=int, default=48, help="samples in the dataset (one batch each)")
    parser.add_argument("--steps", type=int, default=40, help="its optimizer steps (--max-steps)")
    parser.add_argument("--workers", type=int, default=4, help="its dataloader workers (--num-workers)")
    args = parser.parse_args()
    tps = run(args)
    print(f"speculators 0.9.0 trainer (its CLI, AdamW, fused loss on CUDA), {args.steps} steps of "
          f"{(SHAPE_TINY if args.tiny else SHAPE_8B)['seq']} tokens: {tps:,.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
