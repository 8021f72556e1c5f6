"""The shared rig of the training benchmarks: the draft shapes (8B-shaped and tiny), a random target and store
written to disk, the compute-only step and the real trainer timed from its progress callbacks.

train_throughput.py, train_compare.py, speculators_throughput.py, train_varlen.py and train_scaling.py all build on
it; it imports none of them (so no two benchmarks import each other in a circle).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.capture.store import FP8, Sample, StoreWriter, quantize_fp8  # noqa: E402
from eagle3.draft.batches import MicroBatch, pack  # noqa: E402
from eagle3.train.loss import batch_loss, fused_kl_loss  # noqa: E402
from eagle3.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3.draft.target_head import TargetHead, read_target_config  # noqa: E402
from eagle3.train.trainer import TrainConfig, train_draft  # noqa: E402
from eagle3.train.config import effective_grad_accum  # noqa: E402
from eagle3.draft.ttt_attention import TTTCache  # noqa: E402
from eagle3.draft.vocab import VocabMapping, save_mapping  # noqa: E402

SHAPE_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256, draft_vocab=32000,
                seq=2048, layers=32)
SHAPE_TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=32, mlp=128, vocab=512, draft_vocab=256, seq=128, layers=8)
PEAK_790 = 790e12
FIELD_NOTES_NAIVE = 69_700  # tokens/s of FIELD-NOTES' naive eager draft step (data on the GPU, no TTT attention growth)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def flops_per_token(s: dict, ttt: int) -> float:
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], 2 * s["kv_heads"] * s["head_dim"]
    step = 2 * (2 * h * (q + kv) + q * h + 3 * h * s["mlp"] + h * s["draft_vocab"])
    step += 4 * s["heads"] * s["head_dim"] * (s["seq"] / 2)
    draft = 2 * 3 * h * h + ttt * step
    return 3 * draft + 2 * h * s["draft_vocab"]


def matmul_rate(device: torch.device) -> float:
    """bf16 FLOP/s of an 8192^3 product on random data (mean of 10 after 3 warm-ups)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync()
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def write_target(root: Path, s: dict, device: torch.device) -> tuple[Path, Path, Path]:
    """config.json of the target shape, its head tensors (random) and a random vocab mapping."""
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
              "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
              "head_dim": s["head_dim"], "intermediate_size": s["mlp"], "vocab_size": s["vocab"], "rms_norm_eps": 1e-5,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False}
    (target / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    gen = torch.Generator(device).manual_seed(0)
    embed = (torch.randn(s["vocab"], s["hidden"], device=device, generator=gen) * 0.02).to(torch.bfloat16).cpu()
    lm_head = (torch.randn(s["vocab"], s["hidden"], device=device, generator=gen) * 0.02).to(torch.bfloat16).cpu()
    head = root / "target_head.safetensors"
    save_file({"embed_tokens.weight": embed, "norm.weight": torch.ones(s["hidden"], dtype=torch.bfloat16),
               "lm_head.weight": lm_head}, str(head))
    ids = torch.sort(torch.randperm(s["vocab"], generator=torch.Generator().manual_seed(1))[: s["draft_vocab"]]).values
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[ids] = True
    vocab = root / "vocab.safetensors"
    save_mapping(VocabMapping(d2t=ids - torch.arange(s["draft_vocab"]), t2d=t2d), vocab)
    return target, head, vocab


def write_store(root: Path, s: dict, num_samples: int, device: torch.device, fp8: bool = False) -> tuple[Path, float]:
    """A bf16 (or fp8) extraction store of `num_samples` random samples of s['seq'] tokens; (path, seconds)."""
    per_shard = 4
    ids = [f"s{i}" for i in range(num_samples)]
    groups = [ids[i : i + per_shard] for i in range(0, num_samples, per_shard)]
    aux_ids = [2, s["layers"] // 2, s["layers"] - 3]
    writer = StoreWriter(root, aux_layer_ids=aux_ids, hidden_size=s["hidden"], dtype=FP8 if fp8 else torch.bfloat16,
                         expected_shards=groups)
    gen = torch.Generator(device).manual_seed(2)
    started = time.perf_counter()
    for index, group in enumerate(groups):
        samples = []
        for sid in group:
            states = torch.randn(s["seq"], 4, s["hidden"], device=device, generator=gen, dtype=torch.bfloat16)
            tokens = torch.randint(0, s["vocab"], (s["seq"],), device=device, generator=gen)
            mask = torch.ones(s["seq"], dtype=torch.bool)
            mask[: s["seq"] // 8] = False  # a prompt
            if fp8:  # encoded on the device; the writer takes pre-encoded values and scales
                values, scales = quantize_fp8(states)
                samples.append(Sample(sid, tokens.cpu(), mask, values.cpu(), scales.cpu()))
            else:
                samples.append(Sample(sid, tokens.cpu(), mask, states.cpu()))
        writer.write_shard(index, samples)
    return root, time.perf_counter() - started


def disk_read_bandwidth(store: Path, threads: int) -> float:
    """Bytes/s of `threads` threads reading the store's shard files (after the page cache was dropped)."""
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(store.glob("shard-*.safetensors"))
    buffer_size = 64 << 20

    def read(path: Path) -> int:
        buffer, total = bytearray(buffer_size), 0
        with open(path, "rb", buffering=0) as handle:
            while got := handle.readinto(buffer):
                total += got
        return total

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    return total / (time.perf_counter() - started)


def drop_page_cache() -> str:
    """Ask the kernel to drop its page cache (root only); says what happened."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped"
    except OSError as err:
        return f"not dropped ({err.strerror})"


def _model_and_batch(s: dict, target: Path, head_file: Path, store: Path, device: torch.device, ttt: int):
    from eagle3.capture.store import StoreReader
    from eagle3.draft.target_head import load_target_head

    config = DraftConfig.from_target(read_target_config(target), num_aux_hidden_states=3,
                                     draft_vocab_size=s["draft_vocab"])
    model = Eagle3Draft(config).to(device)
    full = load_target_head(head_file, read_target_config(target))
    head = TargetHead(full.embed, full.norm_weight, full.norm_eps, full.lm_head[: s["draft_vocab"]]).to(
        torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    batch = pack([StoreReader(store)[0]], ttt, s["seq"]).map(lambda t: t.to(device))
    return model, head, batch


def naive_loss(model: Eagle3Draft, batch: MicroBatch, head: TargetHead) -> torch.Tensor:
    """batch_loss without TTT attention growth: every step attends causally to its own keys only."""
    from eagle3.draft.target_head import target_logits

    aux, final = batch.split_states(head.embed.dtype)
    with torch.no_grad():
        target_logp = F.log_softmax(target_logits(head, final).float(), dim=-1)
        probs = target_logp.exp()
        neg_entropy = (probs * target_logp).sum(-1)
    hidden, losses = model.fuse(aux), []
    for step in range(batch.step_tokens.shape[0]):
        embeds = F.embedding(batch.step_tokens[step], head.embed).to(hidden.dtype)
        hidden = model.step(embeds, hidden, batch.positions + step, [TTTCache(mask=None)])
        rows = batch.num_tokens - 1 - step
        losses.append(fused_kl_loss(model.logits(hidden)[:rows], probs[1 + step :], neg_entropy[1 + step :],
                                    batch.weights[step, :rows]))
    return torch.stack(losses).mean()


def time_compute(model, head, batch, device, naive: bool, steps: int) -> float:
    """Tokens/s of forward + backward + fused AdamW on a resident micro-batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    bf16 = device.type == "cuda"
    times = []
    for i in range(steps + 3):
        _sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = naive_loss(model, batch, head) if naive else batch_loss(model, batch, head, True)[0]
        loss.backward()
        optimizer.step()
        loss.item()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return batch.num_tokens / statistics.median(times)


def time_trainer(store: Path, target: Path, head_file: Path, vocab: Path, out: Path, s: dict, ttt: int, steps: int,
                 accum: int, threads: int, compile: bool | None = None, param_dtype: str = "auto",
                 batch_tokens: int | None = None, optimizer: str = "adamw",
                 tokens_per_step: int | str | None = None) -> tuple[float, object]:
    """Tokens/s of eagle3.train.trainer.train_draft, from its per-step progress callbacks (first steps excluded:
    allocator warm-up, and torch.compile's compilation when `compile`). `tokens_per_step` None: exactly `accum`
    micro-batches a step (train.tokens_per_step = batch_tokens when accum is 1), else train.tokens_per_step."""
    stamps: list[float] = []
    batch_tokens = batch_tokens or s["seq"]
    if tokens_per_step is None:
        tokens_per_step = batch_tokens if accum == 1 else "auto"
    config = TrainConfig(steps=steps + 1, warmup_steps=1, batch_tokens=batch_tokens, ttt_steps=ttt, grad_accum=accum,
                         checkpoint_every=10**6, loader_threads=threads, learning_rate=1e-5, compile=compile,
                         param_dtype=param_dtype, optimizer=optimizer, tokens_per_step=tokens_per_step)
    accum = effective_grad_accum(config, torch.cuda.is_available())  # what train_draft trains with here
    result = train_draft(config, store_dir=store, target_dir=target, head_path=head_file, vocab_path=vocab,
                         out_dir=out, stop_after=steps, progress=lambda *_: stamps.append(time.perf_counter()))
    skip = min(5 if accum == 1 else 2, len(stamps) - 2)
    per_step = (stamps[-1] - stamps[skip]) / (len(stamps) - 1 - skip)
    return accum * batch_tokens / per_step, result
