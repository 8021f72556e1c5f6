"""Micro-batches for draft training: packing samples, and reading them straight from the store.

Samples are packed whole (in a seeded per-epoch permutation) into micro-batches of at most
`max_tokens` tokens; attention never crosses a sample boundary (doc_ids). The order is a pure
function of (seed, epoch, cursor), so a resumed run sees exactly the batches the uninterrupted
run would have seen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from eagle3.capture.store import FP8, Sample, dequantize_fp8, shard_header
from eagle3.draft.model import ttt_alignment


class BatchReadError(RuntimeError):
    """A shard ends early or cannot be read; the message names the file and the stage to re-run."""


@dataclass(frozen=True)
class MicroBatch:
    """Packed samples. L = total tokens, K = TTT steps, n_aux aux states.

    For step j, row r's target distribution is the final state's at row r+1+j whenever its
    weight is non-zero (ttt_alignment: a weighted row predicts a token inside its own sample),
    so the loss reads it as a shifted slice, with no gather.
    """

    states: torch.Tensor  # [L, n_aux+1, H] as stored: [:, :n_aux] aux, [:, -1] final (before the target's norm)
    scales: torch.Tensor | None  # [L, n_aux+1] float32 for fp8 stores (state = value * scale), else None
    step_tokens: torch.Tensor  # [K, L] int64 input token of each step
    positions: torch.Tensor  # [L] int64 position inside its sample
    doc_ids: torch.Tensor  # [L] int64 sample index inside the batch
    weights: torch.Tensor  # [K, L] float loss weight

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        return MicroBatch(**{k: None if getattr(self, k) is None else fn(getattr(self, k)) for k in FIELDS})

    def split_states(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [L, n_aux, H], final [L, H]) in `dtype`, dequantized from fp8 where stored so."""
        states = self.states if self.scales is None else dequantize_fp8(self.states, self.scales, dtype)
        states = states.to(dtype)
        return states[:, :-1], states[:, -1]


FIELDS = tuple(MicroBatch.__dataclass_fields__)


def pack(samples: list[Sample], steps: int, max_tokens: int) -> MicroBatch:
    """Concatenate samples (each cut to max_tokens) into one TTT micro-batch."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in FIELDS if k != "scales"}
    for doc, sample in enumerate(samples):
        length = min(sample.num_tokens, max_tokens)
        step_tokens, _, weights = ttt_alignment(sample.input_ids[:length], sample.loss_mask[:length], steps)  # [K, T]
        parts["states"].append(sample.hidden_states[:length])  # [T, n_aux+1, H]
        parts["step_tokens"].append(step_tokens)
        parts["positions"].append(torch.arange(length))
        parts["doc_ids"].append(torch.full((length,), doc))
        parts["weights"].append(weights.float())
    dims = {"step_tokens": 1, "weights": 1}
    return MicroBatch(scales=None, **{k: torch.cat(v, dim=dims.get(k, 0)) for k, v in parts.items()})


CPU_ROW_MULTIPLE = 128  # the CPU trainer's micro-batches are padded to a multiple of this many rows (pad_rows)


def pad_rows(batch: MicroBatch, multiple: int, limit: int | None = None) -> MicroBatch:
    """`batch` with rows appended up to a multiple of `multiple`, or to `limit` (train.batch_tokens, the longest a
    batch gets) where that is less: a sample of their own (next doc id, positions from 0), zero states, token 0,
    loss weight 0. The loss and every gradient are those of `batch` (weighted means over the weights; attention
    never crosses samples, and a single-sample batch's causal mask keeps rows after it unseen), so only the shapes
    change: oneDNN builds and keeps a kernel for each matmul shape it meets, and packed batches of every length made
    the demo's bf16 training grow to 7.1 GB on a 2-core Xeon; padded to 128, 3.2 GB and the training stage 16%
    faster (benchmarks/results/demo-xeon-2026-12-06.txt)."""
    rows = batch.num_tokens
    target = rows + -rows % multiple
    extra = (target if limit is None else max(rows, min(target, limit))) - rows
    if extra == 0:
        return batch
    states = torch.cat([batch.states, batch.states.new_zeros(extra, *batch.states.shape[1:])])
    scales = None if batch.scales is None else torch.cat([batch.scales, batch.scales.new_zeros(extra, *batch.scales.shape[1:])])
    steps = batch.step_tokens.shape[0]
    return MicroBatch(
        states=states, scales=scales,
        step_tokens=torch.cat([batch.step_tokens, batch.step_tokens.new_zeros(steps, extra)], dim=1),
        positions=torch.cat([batch.positions, torch.arange(extra, dtype=batch.positions.dtype)]),
        doc_ids=torch.cat([batch.doc_ids, batch.doc_ids.new_full((extra,), int(batch.doc_ids.max()) + 1)]),
        weights=torch.cat([batch.weights, batch.weights.new_zeros(steps, extra)], dim=1),
    )


# -- reading micro-batches straight from the store's shards ------------------------------
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": FP8,
                       "I64": torch.int64, "BOOL": torch.bool}


def _read_rows(handle, path: str, name: str, rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read tensor `name` (its first `rows` rows) from an open shard into `out` (or a new tensor).

    One read system call straight into the destination's memory (pinned, for the GPU), with
    the GIL released: no intermediate copy, and reader threads do not stall the training loop.
    """
    start, header = shard_header(path)
    entry = header[name]
    shape = list(entry["shape"])
    if rows is not None:
        shape[0] = min(shape[0], rows)
    dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
    handle.seek(start + entry["data_offsets"][0])
    done = 0
    while done < nbytes:
        got = handle.readinto(view[done:])
        if not got:
            raise BatchReadError(f"shard {path} ends inside tensor {name}; the store is damaged: re-run the extract stage")
        done += got
    return out


def read_batch(locations: list[tuple[str, int]], indices: list[int], steps: int, max_tokens: int,
               pin: bool) -> MicroBatch:
    """The micro-batch of samples `indices` (locations[i] = (shard path, position in shard)), read
    from the shards into one (pinned when `pin`) buffer; fp8 states stay fp8 (dequantized on the device)."""
    heads = [shard_header(locations[i][0])[1] for i in indices]
    lengths = [min(h[f"{locations[i][1]}.input_ids"]["shape"][0], max_tokens) for h, i in zip(heads, indices, strict=True)]
    first = heads[0][f"{locations[indices[0]][1]}.hidden_states"]
    total, fp8 = sum(lengths), first["dtype"] == "F8_E4M3"
    states = torch.empty([total, *first["shape"][1:]], dtype=_SAFETENSORS_DTYPES[first["dtype"]], pin_memory=pin)
    scales = torch.empty([total, first["shape"][1]], dtype=torch.float32, pin_memory=pin) if fp8 else None
    parts: dict[str, list[torch.Tensor]] = {"step_tokens": [], "positions": [], "doc_ids": [], "weights": []}
    offset = 0
    for doc, (index, length) in enumerate(zip(indices, lengths, strict=True)):
        path, j = locations[index]
        with open(path, "rb", buffering=0) as handle:
            ids = _read_rows(handle, path, f"{j}.input_ids", length)  # [T]
            mask = _read_rows(handle, path, f"{j}.loss_mask", length)  # [T]
            _read_rows(handle, path, f"{j}.hidden_states", length, states[offset : offset + length])
            if scales is not None:
                _read_rows(handle, path, f"{j}.hidden_scales", length, scales[offset : offset + length])
        step_tokens, _, weights = ttt_alignment(ids, mask, steps)  # [K, T] each
        parts["step_tokens"].append(step_tokens)
        parts["positions"].append(torch.arange(length))
        parts["doc_ids"].append(torch.full((length,), doc))
        parts["weights"].append(weights.float())
        offset += length
    small = {k: torch.cat(v, dim=1 if k in ("step_tokens", "weights") else 0) for k, v in parts.items()}
    return MicroBatch(states=states, scales=scales, **{k: v.pin_memory() if pin else v for k, v in small.items()})


@lru_cache(maxsize=4)
def _order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(num_samples, generator=generator).tolist())


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: a permutation fixed by (seed, epoch)."""
    return torch.tensor(_order(num_samples, seed, epoch))


def next_batch_indices(
    lengths: list[int], seed: int, epoch: int, cursor: int, max_tokens: int
) -> tuple[list[int], int, int]:
    """Sample indices of the next micro-batch and the new (epoch, cursor). Batches never span epochs."""
    if cursor >= len(lengths):
        epoch, cursor = epoch + 1, 0
    order = _order(len(lengths), seed, epoch)
    chosen, used = [], 0
    while cursor < len(order):
        size = min(lengths[order[cursor]], max_tokens)
        if chosen and used + size > max_tokens:
            break
        chosen.append(order[cursor])
        used += size
        cursor += 1
    return chosen, epoch, cursor


class BatchStream:
    """The training run's micro-batches in order, read, packed (and copied to the GPU) ahead by a thread pool.

    The sequence is fixed by (seed, epoch, cursor), exactly as next_batch_indices walks it; the
    run's own (epoch, cursor) advances only when a batch is taken, so a checkpoint records the
    position of the batches really trained on. Each process loads only the micro-batches it owns.
    """

    def __init__(self, run: Any, depth: int = 4) -> None:
        self.run, self.epoch, self.cursor, self.index = run, run.epoch, run.cursor, 0
        self.pool = ThreadPoolExecutor(max_workers=run.config.loader_threads, thread_name_prefix="batches")
        self.copy_stream = torch.cuda.Stream(run.device) if run.device.type == "cuda" else None
        self.pending: deque[tuple[int, int, int, int, Future | None]] = deque()
        self.feed = run.open_feed() if run.open_feed is not None else None  # train.data online/hybrid
        for _ in range(depth):
            self._submit()

    def _submit(self) -> None:
        c = self.run.config
        indices, self.epoch, self.cursor = next_batch_indices(self.run.lengths, c.seed, self.epoch, self.cursor, c.batch_tokens)
        tokens = sum(min(self.run.lengths[i], c.batch_tokens) for i in indices)
        mine = self.run.ctx.owns(self.index % c.grad_accum)
        future = self.pool.submit(self._load, indices, self.index) if mine else None
        self.pending.append((self.epoch, self.cursor, tokens, len(indices), future))
        self.index += 1

    def _load(self, indices: list[int], index: int) -> tuple[MicroBatch, torch.cuda.Event | None]:
        run = self.run
        # online: micro-batch `index` of this stream, captured into the buffer (eagle3.online.feed)
        locations = run.locations if self.feed is None else self.feed.locations(index, indices)
        batch = read_batch(locations, indices, run.config.ttt_steps, run.config.batch_tokens,
                           pin=self.copy_stream is not None)
        if self.feed is not None:
            self.feed.consumed(index)  # read into memory: its shard leaves the disk
        if run.device.type == "cpu":  # few shapes, so oneDNN's kernels are reused, not built anew for each length
            batch = pad_rows(batch, CPU_ROW_MULTIPLE, run.config.batch_tokens)
        if self.copy_stream is None:
            return batch.map(lambda t: t.to(run.device)), None
        with torch.cuda.stream(self.copy_stream):  # host-to-device copies overlap the compute stream
            moved = batch.map(lambda t: t.to(run.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return moved, event

    def take(self) -> tuple[MicroBatch | None, int, bool]:
        """The next micro-batch (None when another process owns it), its token count, and one_doc."""
        epoch, cursor, tokens, num_docs, future = self.pending.popleft()
        self._submit()
        self.run.epoch, self.run.cursor = epoch, cursor
        if future is None:
            return None, tokens, num_docs == 1
        batch, event = future.result()
        if event is not None:
            stream = torch.cuda.current_stream(self.run.device)
            stream.wait_event(event)
            for tensor in (getattr(batch, name) for name in FIELDS):
                if tensor is not None:
                    tensor.record_stream(stream)  # allocated on the copy stream, used on this one
        return batch, tokens, num_docs == 1

    def close(self) -> None:
        for *_, future in self.pending:
            if future is not None:
                future.cancel()
        if self.feed is not None:
            self.feed.close()  # a loader waiting for a shard that will not come stops waiting
        self.pool.shutdown(wait=True)
