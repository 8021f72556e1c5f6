"""Online training against store-then-train, the same samples, seed, steps and epochs (HF backend, one device).

Issue 26's benchmark. A random-weight Llama target (8B shape by default, bf16, on the GPU; `--tiny`: the
tiny shape in fp32 on the CPU) and N synthetic samples (random tokens, lengths in (seq/2, seq], the first
eighth of each masked as a prompt). Then, each mode timed on its own:
- store:  eagle3.capture.extract.extract_store into a store (backend "hf"), then train_draft over it with
          the target moved off the GPU (the pipeline frees the GPU before training);
- online: train_draft with train.data online: a producer thread captures each micro-batch through the
          same target (eagle3.online.feed.SourceCapture over eagle3.capture.hf_source.HFSource, on a
          CUDA stream of its own) into a bounded buffer of shards the trainer reads and deletes;
- hybrid: the first samples whose states fit half the store are stored, the rest captured every epoch.
Per mode: wall seconds (extract + train for store and hybrid), peak GPU memory (max_memory_allocated, reset
before each phase), bytes of states written to disk (the store's files; for the buffer, the tensors of every
shard written, tokens captured x bytes a token: the producer captures ahead of the trainer, so a few shards
past the last step count too), the most bytes of the buffer on disk at once (polled every 2 ms), and the
largest loss difference from the store run at any step. Every capture forward holds one prompt in every mode
(lengths > seq/2, a capture batch of seq tokens), so all modes train on the same states; fp32 on the CPU
gives equal losses.

    python benchmarks/online_vs_store.py            # GPU, 8B shape (estimated 5 minutes on an H200; not yet run)
    python benchmarks/online_vs_store.py --tiny     # CPU smoke check (seconds)

Imports only torch, transformers, safetensors, pydantic, numpy (and what transformers needs): no Prefect, no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extract_throughput import SHAPE_8B, SHAPE_TINY, build_model  # noqa: E402

from eagle3.capture.extract import ExtractConfig, extract_store, storage_dtype  # noqa: E402
from eagle3.capture.hf_source import HFSource  # noqa: E402
from eagle3.data.conversations import TokenizedSample  # noqa: E402
from eagle3.data.target import default_aux_layer_ids  # noqa: E402
from eagle3.draft.batches import next_batch_indices  # noqa: E402
from eagle3.online.feed import GIB, OnlineData, OnlineSample, SourceCapture, kept_samples, row_bytes, shard_bytes  # noqa: E402
from eagle3.train.trainer import TrainConfig, train_draft  # noqa: E402
from eagle3.train.config import effective_grad_accum  # noqa: E402
from eagle3.draft.vocab import build_mapping, count_tokens, save_mapping  # noqa: E402


@dataclass
class Row:
    """One mode's figures."""

    mode: str
    extract_s: float = 0.0
    train_s: float = 0.0
    peak_extract: int = 0  # bytes of GPU memory
    peak_train: int = 0
    written: int = 0  # bytes of states written to disk: the store's files + the buffer's shards' tensors
    disk_peak: int = 0  # most bytes of the buffer on disk at once (online, hybrid; polled)
    captured: int = 0  # tokens captured while training
    losses: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)  # seconds from the train call's start to each step's end


class World:
    """The target, its files for the trainer (config.json, head, vocab) and the samples, under `root`."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device, self.root = args, device, Path(args.root)
        started = time.perf_counter()
        shape = dict(SHAPE_TINY if args.tiny else SHAPE_8B, max_position_embeddings=8192)
        dtype = torch.float32 if args.tiny else torch.bfloat16
        self.model = build_model(shape, dtype, device)  # the inner model (decoder stack + final norm), random weights
        _sync(device)
        config = self.model.config
        self.n, self.hidden = config.num_hidden_layers, config.hidden_size
        self.aux = default_aux_layer_ids(self.n)
        self.layer_ids = self.aux + [self.n]  # stored last: the final state (id N)
        self.dtype = storage_dtype(ExtractConfig(), "float32" if args.tiny else "bfloat16")
        self.samples = _samples(args, config.vocab_size)
        self.lengths = [len(s.input_ids) for s in self.samples]
        self.target_dir, self.head, self.vocab = self._write_target(args.draft_vocab)
        print(f"target built on {device} in {time.perf_counter() - started:.1f} s: hidden {self.hidden}, {self.n} layers, "
              f"states {self.dtype}; {len(self.samples)} samples, {sum(self.lengths):,} tokens", flush=True)

    def _write_target(self, draft_vocab: int) -> tuple[Path, Path, Path]:
        """config.json, the head (the model's embedding and norm, a random lm_head) and a vocab mapping."""
        from safetensors.torch import save_file

        c = self.model.config
        target = self.root / "target"
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(json.loads(c.to_json_string()) | {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False}))
        gen = torch.Generator(self.device).manual_seed(self.args.seed)
        # std 4/sqrt(H): the normed final state's logits have a std of about 4, a peaked target distribution
        lm_head = torch.randn(c.vocab_size, c.hidden_size, device=self.device, generator=gen) * (4 / c.hidden_size**0.5)
        head = self.root / "target_head.safetensors"
        save_file({"embed_tokens.weight": self.model.embed_tokens.weight.detach().cpu().contiguous(),
                   "norm.weight": self.model.norm.weight.detach().cpu().contiguous(),
                   "lm_head.weight": lm_head.to(self.model.embed_tokens.weight.dtype).cpu()}, str(head))
        del lm_head
        counts = count_tokens(((torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool))
                               for s in self.samples), c.vocab_size)
        vocab = self.root / "vocab.safetensors"
        save_mapping(build_mapping(counts, draft_vocab), vocab)
        return target, head, vocab

    def extract(self, samples: list[TokenizedSample], store: Path) -> tuple[float, int, int]:
        """extract_store into `store`: (seconds, peak GPU bytes, bytes on disk)."""
        _reset_peak(self.device)
        started = time.perf_counter()
        config = ExtractConfig(backend="hf", samples_per_shard=self.args.samples_per_shard,
                               batch_tokens=self.args.seq, storage_dtype="auto")
        extract_store(samples, store, get_engine=lambda: self.model, aux_layer_ids=self.aux, num_layers=self.n,
                      hidden_size=self.hidden, config=config, dtype=self.dtype)
        _sync(self.device)
        return time.perf_counter() - started, _peak(self.device), _folder_bytes(store)

    def train(self, mode: str, out: Path, store: Path, online: OnlineData | None,
              stop_after: int | None = None) -> tuple[float, int, object]:
        """train_draft: (seconds, peak GPU bytes, its result)."""
        _reset_peak(self.device)
        started = time.perf_counter()
        self.step_ends = []
        result = train_draft(self.train_config(mode), store_dir=store, target_dir=self.target_dir, head_path=self.head,
                             vocab_path=self.vocab, out_dir=out, online=online, stop_after=stop_after,
                             progress=lambda *_: self.step_ends.append(time.perf_counter() - started))
        _sync(self.device)
        return time.perf_counter() - started, _peak(self.device), result

    def train_config(self, mode: str) -> TrainConfig:
        steps = self.steps()
        return TrainConfig(data=mode, steps=steps, warmup_steps=max(1, steps // 10), batch_tokens=self.args.seq,
                           checkpoint_every=10**6, seed=self.args.seed, dtype="float32" if self.args.tiny else "auto",
                           compile=False if self.args.eager else None)

    def steps(self) -> int:
        """Optimizer steps of exactly --epochs epochs (a last partial step is left out)."""
        epoch, cursor, micro_batches = 0, 0, 0
        while True:
            _, epoch, cursor = next_batch_indices(self.lengths, self.args.seed, epoch, cursor, self.args.seq)
            if epoch >= self.args.epochs:
                break
            micro_batches += 1
        config = TrainConfig(steps=2, batch_tokens=self.args.seq, warmup_steps=1)
        return max(2, micro_batches // effective_grad_accum(config, self.device.type == "cuda"))

    def online_data(self, kept: int, kept_store: Path | None, buffer: Path, capture) -> OnlineData:  # noqa: ANN001
        return OnlineData(samples=[OnlineSample(s.input_ids, s.loss_mask) for s in self.samples], kept=kept,
                          kept_store=kept_store, capture=capture, buffer_dir=buffer,
                          buffer_bytes=int(self.args.buffer_gib * GIB), aux_layer_ids=self.aux,
                          hidden_size=self.hidden, storage_dtype=self.dtype)

    def offload(self, off: bool) -> None:
        """The target off the GPU (to the host) while the store run trains, and back."""
        if self.device.type == "cuda":
            self.model.to("cpu" if off else self.device)
            torch.cuda.empty_cache()


def run_store(world: World) -> Row:
    row = Row("store")
    store = world.root / "store"
    row.extract_s, row.peak_extract, row.written = world.extract(world.samples, store)
    print(f"store: extracted in {row.extract_s:.1f} s ({row.written / 2**30:.2f} GiB)", flush=True)
    world.offload(True)
    if world.device.type == "cuda":  # torch.compile and the allocator warm up outside the timed runs
        seconds, _, _ = world.train("store", world.root / "warm-up", store, None, stop_after=3)
        print(f"warm-up: 3 steps in {seconds:.1f} s (not counted)", flush=True)
    row.train_s, row.peak_train, result = world.train("store", world.root / "train-store", store, None)
    row.losses, row.step_ends = result.losses, world.step_ends
    world.offload(False)
    shutil.rmtree(store)
    print(f"store: trained {result.steps_done} steps in {row.train_s:.1f} s", flush=True)
    return row


def run_online(world: World, mode: str, kept: int) -> Row:
    """train.data online (kept 0) or hybrid (the first `kept` samples stored first)."""
    row = Row(mode)
    kept_store = world.root / f"kept-{mode}" if kept else None
    if kept_store is not None:
        row.extract_s, row.peak_extract, row.written = world.extract(world.samples[:kept], kept_store)
    source = HFSource(world.model, batch_tokens=world.args.seq)
    capture = SourceCapture(source, world.layer_ids, world.device)
    buffer = world.root / f"buffer-{mode}"
    with BufferWatch(buffer) as watch:
        row.train_s, row.peak_train, result = world.train(mode, world.root / f"train-{mode}",
                                                          kept_store or world.root, world.online_data(
                                                              kept, kept_store, buffer, capture))
    row.losses, row.captured = result.losses, int(result.online.get("tokens_captured", 0))
    row.step_ends = world.step_ends
    # every shard's tensors: exact, where a poll can miss a shard read and deleted within 2 ms (headers: < 1 KB a shard)
    row.written += row.captured * row_bytes(len(world.layer_ids), world.hidden, world.dtype)
    row.disk_peak = watch.peak
    if kept_store is not None:
        shutil.rmtree(kept_store)
    print(f"{mode}: trained {result.steps_done} steps in {row.train_s:.1f} s, {row.captured:,} tokens captured", flush=True)
    return row


class BufferWatch:
    """Polls a buffer folder every 2 ms for the most bytes on disk at once."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak = folder, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="buffer-watch", daemon=True)

    def __enter__(self) -> BufferWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def _poll(self) -> None:
        while not self.done.is_set():
            total = 0
            try:
                entries = list(os.scandir(self.folder))
            except OSError:
                entries = []
            for entry in entries:
                try:
                    total += entry.stat().st_size
                except OSError:
                    continue  # read and deleted meanwhile
            self.peak = max(self.peak, total)
            time.sleep(0.002)


def _samples(args: argparse.Namespace, vocab: int) -> list[TokenizedSample]:
    """Random tokens; lengths in (seq/2, seq] so each micro-batch and each capture forward holds one sample."""
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.seq // 2 + 1, args.seq + 1, (args.samples,), generator=gen).tolist()
    if args.fixed_length:
        lengths = [args.seq] * args.samples
    samples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        samples.append(TokenizedSample(f"s{i}", ids, [0] * (length // 8) + [1] * (length - length // 8)))
    return samples


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def header(world: World) -> None:
    a, n = world.args, len(world.layer_ids)
    print(f"{world.steps()} steps, {a.epochs} epochs of {len(world.samples)} samples ({sum(world.lengths):,} tokens), "
          f"batch_tokens {a.seq}, buffer {a.buffer_gib:g} GiB (one shard <= "
          f"{shard_bytes(a.seq, 1, n, world.hidden, world.dtype):,} B), "
          f"{row_bytes(n, world.hidden, world.dtype):,} B of states a token", flush=True)


def report(r: Row, base: list[float], cuda: bool) -> None:
    """One mode's line (as soon as it has run: a later mode that fails leaves the earlier figures)."""
    diff = max((abs(a - b) for a, b in zip(r.losses, base, strict=True)), default=float("nan"))
    gpu = (f"peak GPU extract {r.peak_extract / GIB:.2f} / train {r.peak_train / GIB:.2f} GiB" if cuda
           else "peak GPU n/a (CPU)")
    ends, first = r.step_ends, min(10, len(r.step_ends) - 1)
    if first > 0:  # the first steps hold torch.compile's (re)compilation and the head's load; the rest run steady
        print(f"{r.mode:<7} train: start to the end of step {first} {ends[first - 1]:.1f} s, the other "
              f"{len(ends) - first} steps {ends[-1] - ends[first - 1]:.1f} s, after the last step "
              f"{r.train_s - ends[-1]:.1f} s", flush=True)
    print(f"{r.mode:<7} wall {r.extract_s + r.train_s:8.1f} s (extract {r.extract_s:.1f} + train {r.train_s:.1f})  "
          f"{gpu}  written {r.written:,} B  buffer peak on disk {r.disk_peak:,} B  captured {r.captured:,} tokens  steps {len(r.losses)}  max|dloss|={diff:.2e}",
          flush=True)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny target on the CPU, fp32: a smoke check in seconds")
    parser.add_argument("--samples", type=int, help="synthetic samples (default 384, tiny 32)")
    parser.add_argument("--seq", type=int, help="longest sample = train.batch_tokens (default 2048, tiny 64)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs every mode trains (the steps follow)")
    parser.add_argument("--buffer-gib", type=float, help="online.buffer_gib (default 2, tiny 4 shards)")
    parser.add_argument("--samples-per-shard", type=int, default=8, help="extract.samples_per_shard of the store")
    parser.add_argument("--draft-vocab", type=int, help="draft vocabulary (default 32000, tiny 256)")
    parser.add_argument("--no-hybrid", action="store_true", help="skip the hybrid mode")
    parser.add_argument("--no-online", action="store_true", help="skip the online mode (store is always run: the "
                        "others' losses are compared with it)")
    parser.add_argument("--fixed-length", action="store_true", help="every sample --seq tokens long (default: "
                        "lengths in (seq/2, seq], as real data varies)")
    parser.add_argument("--eager", action="store_true", help="train.compile=false (default: the trainer's, on for CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=".cache/online-vs-store",
                        help="scratch folder on the local disk, not tmpfs (emptied before and after)")
    args = parser.parse_args(argv)
    args.samples = args.samples or (32 if args.tiny else 384)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.draft_vocab = args.draft_vocab or (256 if args.tiny else 32000)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:  # tiny tensors: a second intra-op thread only contends (a busy machine made steps 20x slower)
        torch.set_num_threads(1)
    shutil.rmtree(args.root, ignore_errors=True)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"shape {'tiny' if args.tiny else '8B'} ({SHAPE_TINY if args.tiny else SHAPE_8B})", flush=True)
    world = World(args, device)
    if args.buffer_gib is None:
        one_shard = shard_bytes(args.seq, 1, len(world.layer_ids), world.hidden, world.dtype)
        args.buffer_gib = 4 * one_shard / GIB if args.tiny else 2.0
    header(world)
    HFSource(world.model, batch_tokens=args.seq).capture([world.samples[0].input_ids], world.layer_ids)  # warm-up
    rows = [run_store(world)]
    report(rows[0], rows[0].losses, device.type == "cuda")
    budget = sum(world.lengths) * row_bytes(len(world.layer_ids), world.hidden, world.dtype) // 2
    for mode in [m for m, skip in (("online", args.no_online), ("hybrid", args.no_hybrid)) if not skip]:
        kept = 0 if mode == "online" else kept_samples(world.lengths, budget, len(world.layer_ids), world.hidden,
                                                       world.dtype)
        rows.append(run_online(world, mode, kept))
        report(rows[-1], rows[0].losses, device.type == "cuda")
    shutil.rmtree(args.root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
