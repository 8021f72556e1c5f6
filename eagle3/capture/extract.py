"""The extract stage: prefill every sample once through the target, store aux + final states.

Backends (eagle3.capture.source): vLLM in-process with a patched inner forward (production), or
transformers with hooks (`extract.backend="hf"`). The engine is asked for only when some
shard is missing, so a resumed or cached run never loads the target. Shards already in the
store and whole are skipped (eagle3.capture.store).

The speed path, so that the GPU never waits for the disk:
- capture (main thread) -> `HostStager.stage`: the batch's states are packed and encoded to
  the storage dtype ON the device (fp8 halves what crosses PCIe), then copied into pinned host
  memory with non_blocking copies on a side CUDA stream; the main thread moves straight on to
  the next batch's forward while the copy engine works;
- `ShardWriterPool`: background threads wait for the copy's event, build the Samples and call
  `StoreWriter.write_shard` (serialization, sha256 and fsync all release the GIL); the queue
  between them is bounded, so when the disk falls behind the producer waits (backpressure)
  instead of piling up host memory; a writer's exception is re-raised in the caller.
On the CPU the same path runs without pinning, streams or events.

Samples with images (eagle3.data.images). What the store keeps at image positions, decided from vLLM
0.32's EAGLE-3 proposer (v1/spec_decode/llm_base_proposer.py) and its Eagle3 draft classes
(llama_eagle3, qwen3_eagle3, deepseek_eagle3): the proposer feeds a multimodal target's draft the
target's multimodal embeddings only when the draft model supports external multimodal embeddings
(`supports_multimodal_embeddings`); none of the Eagle3 classes does (they are not SupportsMultiModal,
and their `embed_input_ids` ignores `multimodal_embeddings`), so the proposer logs "using text-only draft
inputs" and the draft embeds the token ids it is given: at an image position, the placeholder token
(`<|media_pad|>` for Kimi-K2.5), repeated once per image token. Its hidden-state input there is the
target's aux states at that position, as everywhere. So the store keeps, per sample, the token ids as
the engine ran them (placeholders expanded by vLLM's processor: `expand_sample`), the aux + final states
at EVERY position (image ones included: the next position's draft reads them), and a loss mask that is 0
at every image position (the placeholder was masked by prepare_data, the positions the expansion adds
are 0). No image embeddings are stored: no vLLM 0.32 draft would read them. A draft class that takes
the target's multimodal embeddings would need them (then stored at the image positions).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from eagle3.capture.source import ImageSource, open_source
from eagle3.capture.store import FP8, Sample, StoreWriter, encode_states
from eagle3.data.conversations import TokenizedSample
from eagle3.data.target import check_aux_layer_ids

Progress = Callable[[int, int], None]  # (shards done, shards total)
log = logging.getLogger(__name__)


class ExtractInputError(ValueError):
    """Input that extraction refuses before any engine work; the message names the samples or ids and the setting."""


class ExtractConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["vllm", "hf"] = Field(
        default="vllm", description="Engine that runs the target: 'vllm' (in-process, patched forward) or 'hf' (transformers, hooks)"
    )
    samples_per_shard: int = Field(default=32, ge=1, description="Samples per safetensors shard (the unit of resume)")
    batch_tokens: int = Field(
        default=16384, ge=1, description="Tokens per prefill call (whole shards are batched together up to this)"
    )
    storage_dtype: Literal["auto", "float32", "bfloat16", "float8_e4m3"] = Field(
        default="auto",
        description="Dtype of stored states; 'auto' = float32 for float32 targets, else bfloat16; "
        "'float8_e4m3' = half of bfloat16's bytes, one float32 scale per (token, layer) row, ~3% relative error",
    )
    too_long: Literal["truncate", "reject"] = Field(
        default="reject",
        description="A sample with more than target.max_model_len - 1 tokens (a prefill samples one token): 'reject' "
        "(error naming the samples) or 'truncate' (keep its first max_model_len - 1 tokens, with a warning naming the samples)",
    )
    parts: int = Field(
        default=1, ge=1,
        description="Fan-out over machines: split the conversations into this many parts, each part's regenerate -> "
        "prepare_data -> extract chain a flow run of the `extract.part_deployment` deployment on the gpu work pool; "
        "needs a Prefect server with workers and an artifact_root every worker reaches (an fsspec URL or a shared "
        "folder). 1: everything in this run's process",
    )
    part_deployment: str = Field(
        default="extract-part/extract-part", description="Deployment ('flow name/deployment name') that runs one part"
    )
    part_timeout_s: float = Field(
        default=86400.0, gt=0, description="Seconds to wait for one part's flow run before it counts as failed (then retried)"
    )
    store_budget_gib: float | None = Field(
        default=None, ge=0,
        description="train.data='hybrid' only: GiB of the train split's states kept in the store (the first samples, in "
        "store order, that fit); the rest are captured again each epoch while the draft trains. None: every state is "
        "stored (train.data='store'); train.data='online' stores none of the train split",
    )


# How the extraction is spread over machines, not what it stores: not part of the extract fingerprint. Also
# store_budget_gib, which eagle3.stages.fingerprint_extract adds itself only when set (so a store run's fingerprint
# stays what it was; parts never run with it: eagle3.config refuses online/hybrid with extract.parts > 1).
FAN_OUT_SETTINGS = {"parts", "part_deployment", "part_timeout_s", "store_budget_gib"}


@dataclass(frozen=True)
class ExtractStats:
    samples: int
    tokens: int
    shards_written: int
    shards_reused: int


def storage_dtype(config: ExtractConfig, target_dtype: str) -> torch.dtype:
    if config.storage_dtype == "float8_e4m3":
        return FP8
    if config.storage_dtype == "float32" or (config.storage_dtype == "auto" and target_dtype == "float32"):
        return torch.float32
    return torch.bfloat16


def extract_store(
    samples: Sequence[TokenizedSample],
    store_dir: Path,
    *,
    get_engine: Callable[[], object],
    aux_layer_ids: Sequence[int],
    num_layers: int,
    hidden_size: int,
    config: ExtractConfig,
    dtype: torch.dtype,
    progress: Progress | None = None,
    writer_threads: int = 4,
    max_pending_shards: int = 4,
    max_model_len: int | None = None,
    only: Collection[int] | None = None,
) -> ExtractStats:
    """Fill the store at `store_dir` with aux ids + final state (id N) for every sample.

    `get_engine` returns a vllm.LLM for backend "vllm" and a transformers model for "hf".
    `writer_threads` and `max_pending_shards` tune the write path only (never the output).
    `max_model_len`: the target's; a sample may have max_model_len - 1 tokens (a vLLM prefill
    samples one token), longer ones follow `config.too_long` (None: no length check).
    `only`: the shard indices (of `shard_groups`) this call may write, the rest are left to other
    engines writing the same store (eagle3.capture.data_parallel); None = every shard.
    Bad input raises ExtractInputError before the engine is asked for (nothing is written).
    """
    samples = check_inputs(samples, aux_layer_ids, num_layers, max_model_len, config.too_long)
    by_id = {s.id: s for s in samples}
    groups = shard_groups(samples, config.samples_per_shard)
    layer_ids = list(aux_layer_ids) + [num_layers]  # the final state (id N) is stored last
    writer = StoreWriter(store_dir, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size, dtype=dtype, expected_shards=groups)
    pending = writer.pending() if only is None else [i for i in writer.pending() if i in set(only)]
    reused = len(groups) - len(pending)
    stats = ExtractStats(len(samples), sum(len(s.input_ids) for s in samples), len(pending), reused)
    if not pending:
        writer.finish()
        return stats
    # on_device: a vLLM engine's states stay on its GPU until the stager copies them off on a side stream
    source = open_source(config.backend, get_engine(), hidden_size=hidden_size, batch_tokens=config.batch_tokens,
                         on_device=True)
    stager = HostStager()
    done = reused
    try:
        with ShardWriterPool(writer, threads=writer_threads, max_pending=max_pending_shards) as pool:
            for shard_indices in _batches(pending, groups, by_id, config.batch_tokens):
                batch = [by_id[i] for index in shard_indices for i in groups[index]]
                if any(s.images for s in batch):  # placeholders expanded as the engine runs them
                    batch, states = capture_images(source, batch, layer_ids, config.backend)
                    by_id |= {s.id: s for s in batch}
                else:
                    states = source.capture([s.input_ids for s in batch], layer_ids)  # per sample [T, n_aux+1, H]
                staged = stager.stage(states, dtype)
                del states  # the device memory goes back to the allocator (the side stream still holds it)
                first = 0
                for index in shard_indices:
                    members = [by_id[i] for i in groups[index]]
                    pool.submit(_ShardJob(index, members, staged, first))
                    first += len(members)
                done = _report(progress, done, len(pool.completed()), len(groups))
        done = _report(progress, done, len(pool.completed()), len(groups))
    finally:
        source.close()
    return stats


def capture_images(source: object, batch: Sequence[TokenizedSample], layer_ids: Sequence[int],
                   backend: str) -> tuple[list[TokenizedSample], list[torch.Tensor]]:
    """(`batch` with each image sample's placeholders expanded as the engine ran them, their states [T_i, n_ids, H])
    (module docstring); ExtractInputError when the source cannot take images."""
    if not isinstance(source, ImageSource):
        with_images = [s.id for s in batch if s.images]
        raise ExtractInputError(
            f"samples {_some(with_images)} hold images, and extract.backend={backend!r} through "
            f"{type(source).__name__} captures text only; images are captured by our vLLM engine: "
            "extract.backend='vllm', target.data_parallel_size=1")
    expanded, states = source.capture_images([s.input_ids for s in batch], [s.images for s in batch], layer_ids)
    return [expand_sample(s, ids) if s.images else s for s, ids in zip(batch, expanded, strict=True)], states


def expand_sample(sample: TokenizedSample, expanded: Sequence[int]) -> TokenizedSample:
    """`sample` with the engine's ids `expanded` (its own ids with tokens inserted at its images), its mask as
    expanded_mask's."""
    mask = expanded_mask(sample.input_ids, sample.loss_mask, expanded)
    if mask is None:
        raise ExtractInputError(f"sample {sample.id!r}: the engine's ids for its images ({len(expanded)} tokens) do not "
                                f"hold its own {len(sample.input_ids)} tokens in order; re-run prepare_data")
    return replace(sample, input_ids=list(expanded), loss_mask=mask)


def expanded_mask(input_ids: Sequence[int], loss_mask: Sequence[int], expanded: Sequence[int]) -> list[int] | None:
    """The loss mask of `expanded` (the engine's ids: `input_ids` with tokens inserted at its images): a position the
    expansion added is never learned (0), the others keep their entry; None when `expanded` does not hold
    `input_ids` in order."""
    mask: list[int] = []
    i = 0
    for token in expanded:
        if i < len(input_ids) and token == input_ids[i]:
            mask.append(loss_mask[i])
            i += 1
        else:
            mask.append(0)
    return mask if i == len(input_ids) else None


def shard_groups(samples: Sequence[TokenizedSample], samples_per_shard: int) -> list[list[str]]:
    """The sample ids of each shard, in order: the store's layout, the same on every resume."""
    return [[s.id for s in samples[i : i + samples_per_shard]] for i in range(0, len(samples), samples_per_shard)]


def check_inputs(
    samples: Sequence[TokenizedSample],
    aux_layer_ids: Sequence[int],
    num_layers: int,
    max_model_len: int | None,
    too_long: Literal["truncate", "reject"],
) -> list[TokenizedSample]:
    """The samples to extract, or ExtractInputError: bad layer ids, duplicate ids, empty or too long samples.

    Truncated samples keep their first `max_model_len - 1` tokens (and loss-mask entries).
    """
    try:
        check_aux_layer_ids(aux_layer_ids, num_layers)  # the final state (id N) is added by extraction
    except ValueError as err:
        raise ExtractInputError(str(err)) from err
    seen: set[str] = set()
    duplicates = [s.id for s in samples if s.id in seen or seen.add(s.id)]
    if duplicates:
        raise ExtractInputError(f"duplicate sample ids {_some(duplicates)} in the prepared data; ids must be unique")
    empty = [s.id for s in samples if len(s.input_ids) == 0]
    if empty:
        raise ExtractInputError(f"samples {_some(empty)} have no tokens; expected >= 1 token each (re-run prepare_data)")
    uneven = [s.id for s in samples if len(s.loss_mask) != len(s.input_ids)]
    if uneven:
        raise ExtractInputError(f"samples {_some(uneven)}: loss_mask and input_ids differ in length; expected one mask entry per token")
    if max_model_len is None:
        return list(samples)
    limit = max_model_len - 1  # vLLM's prefill asks for one output token: prompt + 1 <= max_model_len
    long = [s.id for s in samples if len(s.input_ids) > limit]
    if not long:
        return list(samples)
    what = f"samples {_some(long)} are longer than {limit} tokens (target.max_model_len={max_model_len} minus the one token a prefill samples)"
    imaged = [s.id for s in samples if s.images and len(s.input_ids) > limit]
    if too_long == "reject" or imaged:  # a cut could split an image's placeholders from its image
        what += f" (samples {_some(imaged)} hold images: never truncated)" if imaged else ""
        raise ExtractInputError(
            f"{what}; set extract.too_long='truncate' to keep their first {limit} tokens, "
            "raise target.max_model_len, or lower data.max_tokens"
        )
    log.warning("%s; truncated to their first %d tokens (extract.too_long='truncate')", what, limit)
    return [
        s if len(s.input_ids) <= limit else replace(s, input_ids=s.input_ids[:limit], loss_mask=s.loss_mask[:limit])
        for s in samples
    ]


def _some(ids: Sequence[str], limit: int = 10) -> str:
    """Up to `limit` ids and how many more, for error messages."""
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return f"{list(ids[:limit])}{more}"


def _report(progress: Progress | None, done: int, newly: int, total: int) -> int:
    if progress and newly:
        progress(done + newly, total)
    return done + newly


@dataclass(frozen=True)
class StagedBatch:
    """One captured batch on the host: every prompt's states, packed in prompt order.

    values [sum T_i, n_ids, H] in the storage dtype; scales [sum T_i, n_ids] float32 for fp8
    (else None); prompt i is rows starts[i] : starts[i] + T_i. Read only after `wait()`.
    """

    values: torch.Tensor
    scales: torch.Tensor | None
    starts: tuple[int, ...]
    ready: torch.cuda.Event | None  # recorded after the device-to-host copies; None on the CPU

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()  # releases the GIL while it waits

    def prompt(self, i: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = slice(self.starts[i], self.starts[i] + length)
        return self.values[rows], None if self.scales is None else self.scales[rows]


class HostStager:
    """Copies captured states to the host without making the GPU (or the main thread) wait."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stage(self, states: Sequence[torch.Tensor], dtype: torch.dtype) -> StagedBatch:
        lengths = [int(s.shape[0]) for s in states]
        starts = tuple(sum(lengths[:i]) for i in range(len(lengths)))
        packed = pack_states(states)  # n_prompts x [T_i, n_ids, H] -> [sum T_i, n_ids, H], on the capture device
        values, scales = encode_states(packed, dtype)  # on the device: fp8 quantizes before the copy
        if packed.device.type != "cuda":
            return StagedBatch(values, scales, starts, None)
        stream = self._streams.setdefault(packed.device, torch.cuda.Stream(packed.device))
        stream.wait_stream(torch.cuda.current_stream(packed.device))  # copy after the kernels that made the states
        with torch.cuda.stream(stream):
            host_values = _to_pinned(values, stream)
            host_scales = None if scales is None else _to_pinned(scales, stream)
            ready = torch.cuda.Event()
            ready.record(stream)
        return StagedBatch(host_values, host_scales, starts, ready)


def pack_states(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """[sum T_i, n_ids, H]: a view when the prompts' states already lie back to back in one tensor (a capture batch
    of equal lengths: its rows), else a copy (torch.cat): 0.5 GB less to copy on the GPU for an 8B batch."""
    first = states[0]
    end = first.data_ptr()
    for state in states:
        if (not state.is_contiguous() or state.data_ptr() != end or state.shape[1:] != first.shape[1:]
                or state.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return torch.cat(list(states))
        end += state.numel() * state.element_size()
    return first.as_strided((sum(int(s.shape[0]) for s in states), *first.shape[1:]), first.stride())


def _to_pinned(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # pinned: a true async DMA copy
    host.copy_(tensor, non_blocking=True)
    tensor.record_stream(stream)  # the allocator must not reuse this memory before the copy has run
    return host


@dataclass(frozen=True)
class _ShardJob:
    """Write shard `index`: its samples are prompts first .. first+len(samples)-1 of `staged`."""

    index: int
    samples: list[TokenizedSample]
    staged: StagedBatch
    first: int

    def write(self, writer: StoreWriter) -> None:
        self.staged.wait()
        out = []
        for k, s in enumerate(self.samples):
            values, scales = self.staged.prompt(self.first + k, len(s.input_ids))  # [T, n_ids, H], [T, n_ids] | None
            out.append(Sample(s.id, torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool), values, scales,
                              source=s.source))
        writer.write_shard(self.index, out)


class ShardWriterPool:
    """Background threads writing shards from a bounded queue. Use as a context manager.

    `submit` blocks while `max_pending` jobs wait (backpressure), and raises at once when a
    writer has failed; leaving the block waits for every queued shard and re-raises the first
    writer error. After an error the remaining queued jobs are dropped, not written.
    """

    def __init__(self, writer: StoreWriter, *, threads: int, max_pending: int) -> None:
        if threads < 1 or max_pending < 1:
            raise ValueError(f"writer_threads={threads}, max_pending_shards={max_pending}; expected both >= 1")
        self._writer = writer
        self._queue: queue.Queue[_ShardJob | None] = queue.Queue(maxsize=max_pending)
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._in_flight = 0
        self.max_in_flight = 0  # most jobs submitted but not finished at once (bounded by max_pending + threads)
        self._threads = [threading.Thread(target=self._run, name=f"eagle3-shard-writer-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> ShardWriterPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        self.close(raise_error=exc is None)
        if exc is not None and self._error is not None:
            exc.add_note(f"a shard writer had also failed: {self._error!r}")

    def submit(self, job: _ShardJob) -> None:
        with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(job, timeout=0.05)
                return
            except queue.Full:
                continue

    def completed(self) -> list[int]:
        """Shard indices written since the last call."""
        out = []
        while not self._done.empty():
            out.append(self._done.get())
        return out

    def close(self, raise_error: bool = True) -> None:
        for _ in self._threads:
            self._queue.put(None)  # writers never stop taking jobs, so this cannot block for long
        for thread in self._threads:
            thread.join()
        if raise_error:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._error is None:
                try:
                    job.write(self._writer)
                    self._done.put(job.index)
                except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, re-raised there
                    with self._lock:
                        self._error = self._error or err
            with self._lock:
                self._in_flight -= 1


def _batches(pending: list[int], groups: list[list[str]], by_id: dict[str, TokenizedSample], batch_tokens: int) -> list[list[int]]:
    """Group pending shard indices so that each prefill call holds about `batch_tokens` tokens."""
    out: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index in pending:
        size = sum(len(by_id[i].input_ids) for i in groups[index])
        if current and tokens + size > batch_tokens:
            out.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += size
    if current:
        out.append(current)
    return out
