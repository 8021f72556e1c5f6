"""The capture worker of online.producer 'remote': `eagle3 online-capture --buffer DIR --model DIR` (or
`python -m eagle3.online.capture_worker ...`), run on the machine that holds the target.

It loads the target once, in this process (`--backend vllm`, the pipeline's engine, or `--backend hf`, transformers),
then captures for the trainer whose feed is in DIR until that trainer finishes (eagle3.online.remote: the
files, the bound, the handshake). It reads what to capture from the folder, so it needs only the target.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from eagle3.online.feed import Capture, SourceCapture
from eagle3.online.remote import FEED_FILE, run_capture_worker


def open_capture(backend: str, model_dir: str, dtype: str, max_model_len: int, aux_layer_ids: list[int],
                 hidden_size: int, batch_tokens: int, kv_cache_gib: float = 1.0) -> Capture:
    """A Capture over the target loaded here: per prompt the states of the aux ids and the final id N."""
    from eagle3.capture.source import open_source
    from eagle3.draft.target_head import read_target_config

    layer_ids = [*aux_layer_ids, read_target_config(Path(model_dir)).num_hidden_layers]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "hf":
        from eagle3.capture.hf_source import load_hf_target

        model = load_hf_target(model_dir, dtype=dtype, device=str(device))
        return SourceCapture(open_source("hf", model, hidden_size=hidden_size, batch_tokens=batch_tokens), layer_ids,
                             device)
    if backend != "vllm":
        raise ValueError(f"--backend {backend!r}; expected 'vllm' or 'hf'")
    from eagle3.capture import vllm_adapter

    spec = vllm_adapter.EngineSpec(model_dir=model_dir, dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    source = open_source("vllm", vllm_adapter.acquire(spec), hidden_size=hidden_size, batch_tokens=1)
    return SourceCapture(source, layer_ids, torch.device("cpu"))  # the engine hands back host tensors


def _wait_feed(folder: Path, wait_s: float) -> dict:
    deadline = time.monotonic() + wait_s
    while not (folder / FEED_FILE).is_file():
        if time.monotonic() > deadline:
            raise SystemExit(f"online-capture: no trainer's feed ({FEED_FILE}) in {folder} after {wait_s:g} s; start "
                             "the train stage with online.producer='remote' and online.buffer_dir set to this folder")
        time.sleep(0.1)
    return json.loads((folder / FEED_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3 online-capture", description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffer", required=True, help="the trainer's online.buffer_dir (a folder both machines see)")
    parser.add_argument("--model", required=True, help="the target's folder (HF safetensors), as stage_target resolved it")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--dtype", default="auto", help="the target's dtype, as target.dtype")
    parser.add_argument("--max-model-len", type=int, default=4096, help="as target.max_model_len (vllm)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="as target.kv_cache_gib (vllm)")
    parser.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for the trainer's feed")
    args = parser.parse_args(argv)
    folder = Path(args.buffer)
    feed = _wait_feed(folder, args.wait_s)
    capture = open_capture(args.backend, args.model, args.dtype, args.max_model_len, list(feed["aux_layer_ids"]),
                           int(feed["hidden_size"]), int(feed["batch_tokens"]), args.kv_cache_gib)
    print(f"online-capture: target {args.model} loaded ({args.backend}); capturing into {folder}", flush=True)
    written = run_capture_worker(folder, capture, args.wait_s, say=lambda text: print(text, flush=True))
    print(f"online-capture: done, {written} shards", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
