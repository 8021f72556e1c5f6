"""The extract stage: prefill every sample once through the target, store aux + final states.

Backend: vLLM in-process with a patched inner forward (eagle3.capture). The engine is
asked for only when some shard is missing, so a resumed or cached run never loads the
target. Shards already in the store and whole are skipped (eagle3.store).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from eagle3 import vllm_adapter
from eagle3.capture import HiddenStateCapture
from eagle3.data import TokenizedSample
from eagle3.layers import resolve_decoder_stack
from eagle3.store import Sample, StoreWriter

Progress = Callable[[int, int], None]  # (shards done, shards total)


class ExtractConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["vllm"] = Field(default="vllm", description="Engine that runs the target (vLLM in-process, patched forward)")
    samples_per_shard: int = Field(default=32, ge=1, description="Samples per safetensors shard (the unit of resume)")
    batch_tokens: int = Field(
        default=16384, ge=1, description="Tokens per prefill call (whole shards are batched together up to this)"
    )
    storage_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Dtype of stored states; 'auto' = float32 for float32 targets, else bfloat16"
    )


@dataclass(frozen=True)
class ExtractStats:
    samples: int
    tokens: int
    shards_written: int
    shards_reused: int


def storage_dtype(config: ExtractConfig, target_dtype: str) -> torch.dtype:
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
) -> ExtractStats:
    """Fill the store at `store_dir` with aux ids + final state (id N) for every sample."""
    by_id = {s.id: s for s in samples}
    if len(by_id) != len(samples):
        raise ValueError("duplicate sample ids in the prepared data; ids must be unique")
    groups = [[s.id for s in samples[i : i + config.samples_per_shard]] for i in range(0, len(samples), config.samples_per_shard)]
    layer_ids = list(aux_layer_ids) + [num_layers]  # the final state (id N) is stored last
    writer = StoreWriter(store_dir, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size, dtype=dtype, expected_shards=groups)
    pending = writer.pending()
    reused = len(groups) - len(pending)
    if not pending:
        writer.finish()
        return ExtractStats(len(samples), sum(len(s.input_ids) for s in samples), 0, reused)
    llm = get_engine()
    capture = HiddenStateCapture(resolve_decoder_stack(vllm_adapter.torch_module(llm)), layer_ids)
    capture.install()
    done = reused
    try:
        for shard_indices in _batches(pending, groups, by_id, config.batch_tokens):
            batch = [by_id[i] for index in shard_indices for i in groups[index]]
            prompts = [s.input_ids for s in batch]
            with capture.collecting(prompts, hidden_size) as states:
                vllm_adapter.prefill(llm, prompts)
            by_sample = {s.id: (s, h) for s, h in zip(batch, states)}  # h: [T, n_aux+1, H]
            for index in shard_indices:
                writer.write_shard(index, [
                    Sample(s.id, torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool), h)
                    for s, h in (by_sample[i] for i in groups[index])
                ])
                done += 1
                if progress:
                    progress(done, len(groups))
    finally:
        capture.remove()
    return ExtractStats(len(samples), sum(len(s.input_ids) for s in samples), len(pending), reused)


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
