"""train.draft.num_layers on a GPU: a two-layer draft trains on CUDA, compiled (the CUDA default) as eager.

Not in `make test` (no GPU in CI): the CPU suite checks the two-layer draft against vLLM's own
(tests/eagle3/test_draft_layers.py); this checks the CUDA-only paths it also takes, on the tiny world of
tests/eagle3/draft_fixtures: packed samples through varlen flash attention in bf16, with one TTT cache per
layer, and torch.compile of the TTT step. It prints each run's first and last loss and the worst relative
difference of the compiled run's losses from the eager run's.

    python benchmarks/draft_layers_cuda.py --layers 1 2 --steps 40   # benchmarks/results/draft-layers-h200-2026-12-04.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3.draft.architecture import DraftSettings  # noqa: E402
from eagle3.train.trainer import TrainConfig, train_draft  # noqa: E402
from eagle3.draft.ttt_attention import use_varlen  # noqa: E402
from tests.eagle3.draft_fixtures import TRAIN_KW, tiny_world  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: the CPU paths are checked by tests/eagle3/test_draft_layers.py")
    world = tiny_world()
    packed = torch.zeros(4, dtype=torch.long, device="cuda")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; varlen attention for packed bf16 batches: "
          f"{use_varlen(packed, torch.bfloat16)}", flush=True)
    for layers in args.layers:
        losses = {}
        for compiled in (False, True):
            start = time.time()
            config = TrainConfig(steps=args.steps, checkpoint_every=args.steps, compile=compiled,
                                 draft=DraftSettings(num_layers=layers), **TRAIN_KW)
            result = train_draft(config, store_dir=world.train_store, target_dir=world.target_dir,
                                 head_path=world.head_path, vocab_path=world.vocab_path,
                                 out_dir=world.root / f"run-{layers}-{compiled}")
            losses[compiled] = result.losses
            print(json.dumps({"layers": layers, "compile": compiled, "first": result.losses[0],
                              "last": result.losses[-1], "s": round(time.time() - start, 1)}), flush=True)
        worst = max(abs(a - b) / abs(a) for a, b in zip(losses[False], losses[True], strict=True))
        print(f"layers {layers}: compiled vs eager, worst relative loss difference over {args.steps} steps "
              f"{worst:.2e}; loss {losses[False][0]:.3f} -> {losses[False][-1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
