"""Online training data: the target captures each micro-batch's states just ahead of the trainer.

`train.data` (eagle3.train.config) picks where the trainer's hidden states come from:

- `store`: the extract stage wrote every sample's states; the trainer reads them (today's path);
- `online`: nothing of the train split is stored. A producer thread in the trainer's process walks
  the very sequence of micro-batches the trainer will take (eagle3.draft.batches.next_batch_indices
  from the same (seed, epoch, cursor)), asks the target engine to capture each micro-batch's samples
  and writes them as ONE shard in the store's own format (eagle3.capture.store: "{j}.input_ids",
  "{j}.loss_mask", "{j}.hidden_states", fp8 "{j}.hidden_scales") into a buffer folder. The trainer's
  loader reads a shard exactly as it reads a store shard (eagle3.draft.batches.read_batch) and the
  shard is deleted as soon as it is read. Each epoch captures again;
- `hybrid`: the extract stage stored the first samples (store order) whose states fit
  extract.store_budget_gib; the trainer reads those from the store and the rest come online.

The buffer is bounded: before writing a shard the producer waits until the bytes of the shards
still on disk plus this shard's fit `online.buffer_gib` (a buffer that cannot hold one micro-batch
is refused before any load: check_buffer). A consumer waiting for a shard never deadlocks the
producer: shards are written in the order the loader reads them, and every shard on disk is ahead
of the loader, so each read frees room.

Samples with images (eagle3.data.images): an OnlineSample carries its image URLs as prepared and the number
of tokens the engine runs for it (each image's placeholder expanded by vLLM's processor; the extract stage
measured it without a forward, so the trainer plans its micro-batches, and the buffer its shards, on the
store's lengths). The producer sends such a micro-batch through `ImageCapture` (the engine loads the images
and expands the placeholders, as extract does) and writes the expanded ids, their states and a loss mask that
is 0 at every image position, cut to train.batch_tokens as the store's reader cuts: the shard a store would
hold. An engine that runs a different number of tokens than measured is an error (run extract again).

What a trainer process needs from the engine is a single callable, `Capture` (prompts -> per prompt
[T, n_aux+1, H]), and for images `ImageCapture`; the stage builds it around the warm engine (eagle3.draft_stages), `SourceCapture`
wraps an in-process source (the HF backend: benchmarks/online_vs_store.py, tests), tests may give
any function. online.producer 'remote': a capture worker in another process or on another machine writes the
shards instead, and the trainer only reads them (eagle3.online.remote). Data-parallel trainers: refused
(train.num_processes must be 1).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from eagle3.capture.extract import expanded_mask
from eagle3.capture.source import HiddenStateSource
from eagle3.capture.store import FP8, StoreReader, encode_states, write_safetensors
from eagle3.draft.batches import next_batch_indices

log = logging.getLogger(__name__)

Capture = Callable[[Sequence[Sequence[int]]], list[torch.Tensor]]  # prompts -> per prompt [T_i, n_aux+1, H]
# (prompts as prepared, per prompt its image URLs) -> (per prompt the ids the engine ran, its states [T_i, n_aux+1, H])
ImageCapture = Callable[[Sequence[Sequence[int]], Sequence[Sequence[str]]], tuple[list[list[int]], list[torch.Tensor]]]
HEADER_ALLOWANCE = 4096  # bytes a shard's safetensors header may take beyond its tensors (per sample: ~200)
GIB = 1 << 30


class OnlineDataError(RuntimeError):
    """Online training data cannot be produced; the message names the setting or the engine."""


@dataclass(frozen=True)
class OnlineSample:
    """One train-split sample as the trainer sees it before capture (the prepared token ids)."""

    input_ids: list[int]
    loss_mask: list[int]
    images: tuple[str, ...] = ()  # its image URLs as prepared, in placeholder order (the engine loads them)
    length: int | None = None  # tokens the engine runs, images expanded (the extract stage's measure); None: no images

    @property
    def tokens(self) -> int:
        """The sample's length in the store: its ids with every image's placeholder expanded."""
        return len(self.input_ids) if self.length is None else self.length


class SourceCapture:
    """A `Capture` over a source in this process (eagle3.capture.source: `HFSource` on the trainer's GPU or CPU).

    The producer thread runs the target itself: per prompt the states of `layer_ids` (the aux ids + the final
    id N), copied to the host where the shard writer wants them. With CUDA the forward runs on a stream of its
    own, so the copy waits for the capture only and the trainer's default stream never waits for it.
    """

    def __init__(self, source: HiddenStateSource, layer_ids: Sequence[int], device: torch.device) -> None:
        self.source, self.layer_ids = source, list(layer_ids)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.tokens = 0  # captured so far, as the engine capture counts them

    def __call__(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            states = self.source.capture(prompts, self.layer_ids)  # per prompt [T_i, n_aux+1, H] on the device
            host = [s.to("cpu") for s in states]  # waits for this stream only
        self.tokens += sum(len(p) for p in prompts)
        return host


@dataclass(frozen=True)
class OnlineData:
    """What train_draft needs instead of a complete store.

    samples[i] is sample i in store order; samples[:kept] are in `kept_store` (hybrid), the rest
    are captured each epoch into `buffer_dir`, never more than `buffer_bytes` on disk at once.
    """

    samples: list[OnlineSample]
    kept: int
    kept_store: Path | None
    capture: Capture | None  # None: online.producer 'remote'
    buffer_dir: Path
    buffer_bytes: int
    aux_layer_ids: list[int]
    hidden_size: int
    storage_dtype: torch.dtype
    producer: Literal["local", "remote"] = "local"  # remote: a capture worker writes the shards (online_remote)
    remote_wait_s: float = 600.0  # remote: the longest wait for one shard
    capture_images: ImageCapture | None = None  # samples with images: the engine loads them and expands placeholders


def row_bytes(n_states: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes one token takes in a shard: its states (+ fp8 scales), its id (int64) and mask (bool)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    scales = 4 * n_states if dtype == FP8 else 0
    return n_states * hidden_size * itemsize + scales + 9


def shard_bytes(tokens: int, samples: int, n_states: int, hidden_size: int, dtype: torch.dtype) -> int:
    """An upper bound of a buffer shard's size on disk: `tokens` tokens of `samples` samples."""
    return tokens * row_bytes(n_states, hidden_size, dtype) + HEADER_ALLOWANCE + 256 * samples


def check_buffer(buffer_gib: float, batch_tokens: int, n_states: int, hidden_size: int, dtype: torch.dtype) -> None:
    """Refuse a buffer that cannot hold one micro-batch's shard (the trainer would wait for ever)."""
    need = shard_bytes(batch_tokens, batch_tokens, n_states, hidden_size, dtype)
    if buffer_gib * GIB < need:
        raise OnlineDataError(
            f"online.buffer_gib={buffer_gib:g} ({int(buffer_gib * GIB):,} bytes) is smaller than one shard: a micro-batch "
            f"of train.batch_tokens={batch_tokens} tokens x {n_states} states x hidden {hidden_size} in {dtype} takes up "
            f"to {need:,} bytes; set online.buffer_gib >= {math.ceil(need / GIB * 1e4) / 1e4:g} (or lower "
            "train.batch_tokens)")


def kept_samples(lengths: Sequence[int], budget_bytes: int, n_states: int, hidden_size: int, dtype: torch.dtype) -> int:
    """How many samples, from the first in store order, fit `budget_bytes` of stored states (hybrid)."""
    used, kept = 0, 0
    for length in lengths:
        used += length * row_bytes(n_states, hidden_size, dtype)
        if used > budget_bytes:
            break
        kept += 1
    return kept


def plan_text(lengths: Sequence[int], kept: int, batch_tokens: int, budget_gib: float | None,
              tokens_per_s: float | None) -> str:
    """The line the train stage prints at start: samples kept, tokens re-captured per epoch, target time per epoch."""
    captured = sum(min(n, batch_tokens) for n in lengths[kept:])
    budget = "online (nothing stored)" if not budget_gib else f"hybrid (extract.store_budget_gib={budget_gib:g})"
    rate = (f"about {captured / tokens_per_s:.1f} s of target time per epoch at the measured {tokens_per_s:,.0f} "
            "tokens/s" if tokens_per_s else "target time per epoch unknown (no measured extraction rate)")
    return (f"{budget}: {kept} of {len(lengths)} samples kept in the store, {captured:,} tokens re-captured per "
            f"epoch, {rate}")


class OnlineFeed:
    """The producer thread and the buffer: micro-batch k of the trainer's stream, captured and on disk.

    `locations(k, indices)` blocks until micro-batch k (counted from the stream's start) is on disk and
    returns {sample index: (shard path, position)}; `consumed(k)` deletes its shard. `close()` stops
    the producer and removes every shard left (nothing in the buffer outlives the run).
    """

    def __init__(self, data: OnlineData, lengths: Sequence[int], seed: int, batch_tokens: int, epoch: int,
                 cursor: int) -> None:
        self.data, self.lengths, self.seed, self.batch_tokens = data, list(lengths), seed, batch_tokens
        self.kept_locations = kept_locations(data)
        self.n_states = len(data.aux_layer_ids) + 1
        self.folder = Path(data.buffer_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        remove_shards(self.folder)  # a killed run's: the stream starts again at the checkpoint's cursor
        self.cond = threading.Condition()
        self.ready: dict[int, dict[int, tuple[str, int]]] = {}
        self.sizes: dict[int, int] = {}  # shard k on disk (or being written) -> bytes
        self.closed, self.error = False, None
        self.tokens_captured, self.capture_seconds, self.peak_bytes = 0, 0.0, 0
        self.thread = threading.Thread(target=self._produce, args=(epoch, cursor), name="online-capture", daemon=True)
        self.thread.start()

    # -- consumer side (the loader threads)
    def locations(self, k: int, indices: Sequence[int]) -> dict[int, tuple[str, int]]:
        with self.cond:
            while k not in self.ready:
                if self.error is not None:
                    raise OnlineDataError(f"online capture failed: {self.error}") from self.error
                if self.closed:
                    raise OnlineDataError("online data feed closed")
                self.cond.wait(0.5)
            found = self.ready[k]
        missing = [i for i in indices if i not in found and i not in self.kept_locations]
        if missing:
            raise OnlineDataError(f"micro-batch {k}: samples {missing[:10]} neither kept nor captured (a feed bug)")
        return {i: found.get(i) or self.kept_locations[i] for i in indices}

    def consumed(self, k: int) -> None:
        (self.folder / _shard(k)).unlink(missing_ok=True)  # first: the room is freed only once the bytes are gone
        with self.cond:
            self.ready.pop(k, None)
            self.sizes.pop(k, None)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=600)
        remove_shards(self.folder)
        with contextlib.suppress(OSError):  # the folder when empty, and the default's online_buffer/ when no other
            self.folder.rmdir()           # run's buffer is in it (a folder of the user's keeps its other files)
            if self.folder.parent.name == "online_buffer":
                self.folder.parent.rmdir()

    def stats(self) -> dict[str, float]:
        return {"tokens_captured": self.tokens_captured, "capture_seconds": round(self.capture_seconds, 3),
                "buffer_peak_bytes": self.peak_bytes}

    # -- producer side
    def _produce(self, epoch: int, cursor: int) -> None:
        k = 0
        try:
            while not self.closed:
                indices, epoch, cursor = next_batch_indices(self.lengths, self.seed, epoch, cursor, self.batch_tokens)
                need = [i for i in indices if i >= self.data.kept]
                found: dict[int, tuple[str, int]] = {}
                if need:
                    tokens = sum(min(self.lengths[i], self.batch_tokens) for i in need)
                    size = shard_bytes(tokens, len(need), self.n_states, self.data.hidden_size, self.data.storage_dtype)
                    if not self._reserve(k, size):
                        return
                    found = self._write(k, need)
                with self.cond:
                    self.ready[k] = found
                    self.cond.notify_all()
                k += 1
        except BaseException as err:  # noqa: BLE001 - handed to the loader threads, raised there
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _reserve(self, k: int, size: int) -> bool:
        """Wait until `size` more bytes fit the buffer (always when it is empty); False when closed."""
        with self.cond:
            while self.sizes and sum(self.sizes.values()) + size > self.data.buffer_bytes:
                if self.closed:
                    return False
                self.cond.wait(0.5)
            self.sizes[k] = size
            self.peak_bytes = max(self.peak_bytes, sum(self.sizes.values()))
            return not self.closed

    def _write(self, k: int, need: list[int]) -> dict[int, tuple[str, int]]:
        samples = [self.data.samples[i] for i in need]
        started = time.monotonic()
        if any(s.images for s in samples):
            prompts, masks, states = capture_with_images(self.data.capture_images, need, samples, self.batch_tokens)
        else:
            prompts, masks = [s.input_ids[: self.batch_tokens] for s in samples], [s.loss_mask for s in samples]
            states = self.data.capture(prompts)  # per prompt [T_i, n_aux+1, H]
        self.capture_seconds += time.monotonic() - started
        final = self.folder / _shard(k)
        size = write_shard(final, need, prompts, masks, states, self.n_states, self.data.hidden_size,
                           self.data.storage_dtype)
        with self.cond:
            self.sizes[k] = size  # the true size (the reservation was an upper bound)
        self.tokens_captured += sum(len(p) for p in prompts)
        return {i: (str(final), j) for j, i in enumerate(need)}


def capture_with_images(capture: ImageCapture | None, need: Sequence[int], samples: Sequence[OnlineSample],
                        batch_tokens: int) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """(ids, loss masks, states [T_i, n_aux+1, H]) per sample as the store holds them, cut to `batch_tokens` as the
    store's reader cuts: a sample with images is sent whole with its URLs and comes back expanded (mask 0 at each
    image position); a text one is sent cut. OnlineDataError when the engine's length differs from the measured one."""
    if capture is None:
        raise OnlineDataError(f"samples {list(need)[:10]} hold images, and this capture takes text only; images are "
                              "captured by the run's own vLLM engine (online.producer='local')")
    prompts = [s.input_ids if s.images else s.input_ids[:batch_tokens] for s in samples]
    expanded, states = capture(prompts, [list(s.images) for s in samples])  # ids as run; per prompt [T_i, n, H]
    ids, masks, cut = [], [], []
    for i, s, prompt, run, st in zip(need, samples, prompts, expanded, states, strict=True):
        mask = expanded_mask(s.input_ids, s.loss_mask, run) if s.images else list(s.loss_mask)
        if mask is None or len(run) != (s.tokens if s.images else len(prompt)):
            raise OnlineDataError(f"sample {i}: the engine ran {len(run)} tokens for its images, the extract stage "
                                  f"measured {s.tokens} (its own ids in order: {mask is not None}); the target or its "
                                  "processor changed since: run the extract stage again")
        ids.append(list(run[:batch_tokens]))
        masks.append(mask[:batch_tokens])
        cut.append(st[:batch_tokens])  # [min(T_i, batch_tokens), n, H]: causal, so the cut equals a capture of the cut
    return ids, masks, cut


def write_shard(final: Path, need: Sequence[int], prompts: Sequence[Sequence[int]], masks: Sequence[Sequence[int]],
                states: Sequence[torch.Tensor], n_states: int, hidden_size: int, dtype: torch.dtype) -> int:
    """One micro-batch's captured samples as one shard in the store's format, written under a temporary name and
    renamed (a reader never sees half a shard); its size in bytes. `states`: per prompt [T_i, n_states, H]."""
    tensors: dict[str, torch.Tensor] = {}
    for j, (i, prompt, s) in enumerate(zip(need, prompts, states, strict=True)):
        if tuple(s.shape) != (len(prompt), n_states, hidden_size):
            raise OnlineDataError(f"sample {i}: captured states {tuple(s.shape)}, expected "
                                  f"{(len(prompt), n_states, hidden_size)}")
        values, scales = encode_states(s, dtype)  # [T, n, H] (+ [T, n] fp8 scales)
        tensors[f"{j}.input_ids"] = torch.tensor(list(prompt), dtype=torch.int64)
        tensors[f"{j}.loss_mask"] = torch.tensor(list(masks[j])[: len(prompt)], dtype=torch.bool)
        tensors[f"{j}.hidden_states"] = values.contiguous()
        if scales is not None:
            tensors[f"{j}.hidden_scales"] = scales.contiguous()
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        size, _ = write_safetensors(tmp, tensors, {"sample_ids": json.dumps([str(i) for i in need])})
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _shard(k: int) -> str:
    return f"batch-{k:08d}.safetensors"


def remove_shards(folder: Path) -> None:
    """The buffer's own files (shards and their temporaries), nothing else of the folder."""
    for path in [*folder.glob("batch-*.safetensors"), *folder.glob(".batch-*.safetensors.tmp-*")]:
        path.unlink(missing_ok=True)


def kept_locations(data: OnlineData) -> dict[int, tuple[str, int]]:
    """(shard path, position) of the samples the hybrid store keeps: samples[:kept], in store order."""
    if data.kept == 0:
        return {}
    reader = StoreReader(Path(data.kept_store), verify=False)
    locations = [(str(reader.root / e.file), j) for e in reader.shards for j in range(len(e.sample_ids))]
    if len(locations) != data.kept:
        raise OnlineDataError(f"the kept store {data.kept_store} holds {len(locations)} samples, the plan {data.kept}; "
                              "run the extract stage again")
    return dict(enumerate(locations))


class OnlineConfig(BaseModel):
    """Settings of online training data (train.data online or hybrid)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    buffer_gib: float = Field(
        default=16.0, gt=0, description="Most GiB of captured states on disk at once (train.data online/hybrid): the "
        "engine captures ahead of the trainer until the buffer is full, and each shard (one micro-batch) is deleted "
        "once the trainer has read it. Must hold at least one micro-batch's shard (train.batch_tokens tokens of every "
        "stored state); refused before any load otherwise. Not part of any fingerprint."
    )
    engine_cpus: int | Literal["auto"] = Field(
        default="auto", description="CPU build: cores of their own for the target engine process (the first N this "
        "process may use; every engine thread is pinned there), the trainer gets the rest and as many torch threads. "
        "'auto': half of them (at least 1) when there are at least 2; 0: no pinning, both share every core. "
        "Refused with CUDA, where the engine and the trainer take GPUs (target.devices, train.devices). Not part of "
        "any fingerprint."
    )
    producer: Literal["local", "remote"] = Field(
        default="local", description="Who captures: 'local', a thread of the trainer's process through the run's warm "
        "engine; 'remote', a capture worker in another process or on another machine (`eagle3 online-capture "
        "--buffer DIR --model DIR`) that writes the shards into online.buffer_dir, a folder both see; the trainer "
        "only reads them (docs/online-training.md, Across machines). Not part of any fingerprint."
    )
    remote_wait_s: float = Field(
        default=600.0, gt=0, description="online.producer 'remote': seconds the trainer waits for one micro-batch's "
        "shard before it stops with an error naming the buffer folder. Not part of any fingerprint."
    )
    buffer_dir: str | None = Field(
        default=None, description="Folder of the buffer (its shards removed at start and at the end, then the folder "
        "when empty); default "
        "<artifact root>/online_buffer/<train fingerprint>. Not part of any fingerprint."
    )

    @field_validator("engine_cpus")
    @classmethod
    def _cores(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"online.engine_cpus is {value}; expected a number of cores >= 0 (0: no pinning) or 'auto'")
        return value
