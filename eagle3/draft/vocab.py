"""The draft vocabulary: which target tokens the draft can propose.

The draft's lm_head covers only the `draft_vocab_size` target tokens seen most often
where the draft must predict (loss-masked, i.e. assistant, tokens). Two tensors map
between the vocabularies, stored inside the exported weights exactly as vLLM's
llama_eagle3 and speculators read them:

    d2t  int64 [draft_vocab]   OFFSETS: draft id i stands for target id i + d2t[i]
    t2d  bool  [target_vocab]  True for the target ids that have a draft id

Draft ids are in increasing target-id order, so i + d2t[i] is increasing and t2d's
True entries, in order, are the draft ids 0, 1, 2, ...
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file


class VocabConfig(BaseModel):
    """Settings of the vocab stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    draft_vocab_size: int = Field(
        default=32000,
        gt=0,
        description="Number of target tokens the draft can propose (its lm_head rows); at most the target vocabulary.",
    )


class VocabError(ValueError):
    """A vocab setting or mapping file does not fit the target."""


@dataclass(frozen=True)
class VocabMapping:
    """d2t int64 [draft_vocab] (offsets) and t2d bool [target_vocab]; see the module docstring."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id: int64 [draft_vocab], increasing."""
        return torch.arange(self.draft_vocab_size, dtype=torch.int64) + self.d2t


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Count token ids where the loss mask is True. (input_ids [T], loss_mask [T]) pairs -> int64 [V]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for index, (input_ids, loss_mask) in enumerate(samples):
        if input_ids.shape != loss_mask.shape:
            raise VocabError(
                f"sample {index}: input_ids shape {tuple(input_ids.shape)} differs from loss_mask "
                f"shape {tuple(loss_mask.shape)}"
            )
        ids = input_ids[loss_mask.to(torch.bool)].to(torch.int64)  # [n_masked]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise VocabError(
                f"sample {index}: token id {int(ids.max())} outside the target vocabulary "
                f"[0, {vocab_size}); does the data match this target's tokenizer?"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_mapping(counts: torch.Tensor, draft_vocab_size: int) -> VocabMapping:
    """Top `draft_vocab_size` tokens by count (ties: lower token id first) -> d2t/t2d."""
    vocab_size = int(counts.shape[0])
    if not 0 < draft_vocab_size <= vocab_size:
        raise VocabError(
            f"vocab.draft_vocab_size is {draft_vocab_size}, but it must be between 1 and the "
            f"target vocabulary size {vocab_size}; lower vocab.draft_vocab_size"
        )
    # A stable descending sort keeps equal counts in increasing id order.
    order = torch.sort(counts, descending=True, stable=True).indices  # [V]
    target_ids = torch.sort(order[:draft_vocab_size]).values  # [draft_vocab], increasing
    d2t = target_ids - torch.arange(draft_vocab_size, dtype=torch.int64)  # [draft_vocab]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[target_ids] = True
    return VocabMapping(d2t=d2t, t2d=t2d)


def save_mapping(mapping: VocabMapping, path: Path) -> None:
    """Write d2t and t2d to one safetensors file, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({"d2t": mapping.d2t.contiguous(), "t2d": mapping.t2d.contiguous()}, str(tmp))
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_mapping(path: Path) -> VocabMapping:
    """Read a mapping written by `save_mapping` and check that d2t and t2d agree."""
    tensors = load_file(str(path))
    if set(tensors) != {"d2t", "t2d"}:
        raise VocabError(f"vocab file {path} holds {sorted(tensors)}, expected ['d2t', 't2d']; re-run the vocab stage")
    mapping = VocabMapping(d2t=tensors["d2t"].to(torch.int64), t2d=tensors["t2d"].to(torch.bool))
    check_mapping(mapping, source=str(path))
    return mapping


def check_mapping(mapping: VocabMapping, *, source: str = "mapping") -> None:
    """Raise VocabError unless i + d2t[i] are exactly t2d's True ids, in increasing order."""
    ids = mapping.target_ids
    expected = torch.nonzero(mapping.t2d).flatten()
    if ids.shape != expected.shape or not torch.equal(ids, expected):
        raise VocabError(
            f"{source}: d2t and t2d disagree (t2d has {int(mapping.t2d.sum())} true entries, "
            f"d2t has {mapping.draft_vocab_size}); re-run the vocab stage"
        )
