"""The hidden-state store: what extraction writes and training reads.

A store is a directory:

    manifest.json            written last; lists every shard with size and sha256
    shard-00000.safetensors  several samples each
    shard-00001.safetensors
    ...

Inside a shard, sample j (0-based within the shard) has three tensors:

    "{j}.input_ids"      int64  [T]            token ids, prompt and answer
    "{j}.loss_mask"      bool   [T]            True on assistant tokens (the ones to learn)
    "{j}.hidden_states"  dtype  [T, n_aux+1, H] [:, :n_aux] the aux states in `aux_layer_ids`
                                               order, [:, -1] the final state (layer id N:
                                               the last decoder layer's output BEFORE the
                                               final norm)

and the shard's safetensors metadata holds the sample ids as JSON ("sample_ids").
Layer ids follow vLLM: id k is the hidden state entering decoder layer k.

Shards are written under a temporary name and renamed when complete, so a shard file
under its final name is always whole; the manifest is rewritten (atomically) after
every shard, so a killed writer resumes at the first shard that is missing or whose
checksum does not match.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class StoreError(RuntimeError):
    """A store on disk is missing, incomplete or does not match what was asked for."""


@dataclass(frozen=True)
class Sample:
    """One extracted sample. Shapes: input_ids/loss_mask [T]; hidden_states [T, n_aux+1, H]."""

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class ShardEntry:
    """One manifest line: file name, its sample ids, byte size and sha256."""

    file: str
    sample_ids: tuple[str, ...]
    num_tokens: int
    size: int
    sha256: str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


class StoreWriter:
    """Writes shards into `root`, resuming after a crash.

    `expected_shards` is the list of sample-id groups this store must end up with (the
    caller decides the grouping, so that a resume writes the same shards). `pending()`
    tells which of them still need work; `write_shard` writes one and updates the manifest.
    """

    def __init__(
        self,
        root: Path,
        *,
        aux_layer_ids: Sequence[int],
        hidden_size: int,
        dtype: torch.dtype,
        expected_shards: Sequence[Sequence[str]],
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.aux_layer_ids = list(aux_layer_ids)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.expected = [tuple(ids) for ids in expected_shards]
        self._entries: dict[int, ShardEntry] = {}
        self._load_valid_entries()

    def _load_valid_entries(self) -> None:
        """Keep manifest entries whose file is present and whole; forget the rest."""
        for tmp in self.root.glob(".*.tmp-*"):
            tmp.unlink(missing_ok=True)  # leftovers of a killed writer
        path = self.root / MANIFEST
        if not path.exists():
            return
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError:
            return  # unreadable manifest: every shard is re-verified by being redone
        if manifest.get("aux_layer_ids") != self.aux_layer_ids:
            return
        for index, raw in enumerate(manifest.get("shards", [])):
            if raw is None or index >= len(self.expected):
                continue
            entry = ShardEntry(
                file=raw["file"],
                sample_ids=tuple(raw["sample_ids"]),
                num_tokens=raw["num_tokens"],
                size=raw["size"],
                sha256=raw["sha256"],
            )
            if entry.sample_ids == self.expected[index] and _shard_is_whole(self.root, entry):
                self._entries[index] = entry

    def pending(self) -> list[int]:
        """Indices of expected shards that are missing or invalid."""
        return [i for i in range(len(self.expected)) if i not in self._entries]

    def write_shard(self, index: int, samples: Sequence[Sample]) -> ShardEntry:
        ids = tuple(s.sample_id for s in samples)
        if ids != self.expected[index]:
            raise StoreError(f"shard {index} got samples {ids}, expected {self.expected[index]}")
        tensors: dict[str, torch.Tensor] = {}
        for j, sample in enumerate(samples):
            n_aux = len(self.aux_layer_ids)
            want = (sample.num_tokens, n_aux + 1, self.hidden_size)
            if tuple(sample.hidden_states.shape) != want:
                raise StoreError(
                    f"sample {sample.sample_id!r}: hidden_states shape "
                    f"{tuple(sample.hidden_states.shape)}, expected {want}"
                )
            tensors[f"{j}.input_ids"] = sample.input_ids.to(torch.int64).contiguous()
            tensors[f"{j}.loss_mask"] = sample.loss_mask.to(torch.bool).contiguous()
            tensors[f"{j}.hidden_states"] = sample.hidden_states.to(self.dtype).contiguous()
        final = self.root / shard_name(index)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        save_file(tensors, str(tmp), metadata={"sample_ids": json.dumps(list(ids))})
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        entry = ShardEntry(
            file=final.name,
            sample_ids=ids,
            num_tokens=sum(s.num_tokens for s in samples),
            size=final.stat().st_size,
            sha256=sha256_file(final),
        )
        self._entries[index] = entry
        self._write_manifest()
        return entry

    def finish(self) -> None:
        """(Re)write the manifest; an empty store (no shards) is complete once finished."""
        self._write_manifest()

    def _write_manifest(self) -> None:
        shards = []
        for i in range(len(self.expected)):
            entry = self._entries.get(i)
            shards.append(None if entry is None else entry.__dict__ | {"sample_ids": list(entry.sample_ids)})
        manifest = {
            "format_version": FORMAT_VERSION,
            "aux_layer_ids": self.aux_layer_ids,
            "hidden_size": self.hidden_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "complete": not self.pending(),
            "num_samples": sum(len(ids) for ids in self.expected),
            "shards": shards,
        }
        atomic_write_text(self.root / MANIFEST, json.dumps(manifest, indent=1))


def _shard_is_whole(root: Path, entry: ShardEntry) -> bool:
    path = root / entry.file
    return path.is_file() and path.stat().st_size == entry.size and sha256_file(path) == entry.sha256


class StoreReader:
    """Reads a complete store. Opening checks the manifest; `verify()` checks every checksum."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise StoreError(f"no hidden-state store at {self.root} (missing {MANIFEST}); run the extract stage")
        manifest = json.loads(path.read_text())
        if not manifest.get("complete"):
            raise StoreError(f"hidden-state store at {self.root} is incomplete; re-run the extract stage to finish it")
        self.aux_layer_ids: list[int] = manifest["aux_layer_ids"]
        self.hidden_size: int = manifest["hidden_size"]
        self.dtype: str = manifest["dtype"]
        self.shards = [
            ShardEntry(e["file"], tuple(e["sample_ids"]), e["num_tokens"], e["size"], e["sha256"])
            for e in manifest["shards"]
        ]
        # (shard index, position in shard) for every sample, in store order
        self._index = [(s, j) for s, entry in enumerate(self.shards) for j in range(len(entry.sample_ids))]

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.shards)

    def verify(self) -> None:
        """Raise StoreError naming the first shard whose size or checksum is wrong."""
        for entry in self.shards:
            if not _shard_is_whole(self.root, entry):
                raise StoreError(f"shard {self.root / entry.file} is missing or corrupt (size/sha256 mismatch)")

    def __getitem__(self, i: int) -> Sample:
        shard, j = self._index[i]
        entry = self.shards[shard]
        with safe_open(str(self.root / entry.file), framework="pt") as handle:
            return Sample(
                sample_id=entry.sample_ids[j],
                input_ids=handle.get_tensor(f"{j}.input_ids"),
                loss_mask=handle.get_tensor(f"{j}.loss_mask"),
                hidden_states=handle.get_tensor(f"{j}.hidden_states"),
            )

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]


def is_complete(root: Path) -> bool:
    """True when `root` holds a complete store whose shards all match their checksums."""
    try:
        StoreReader(root).verify()
    except (StoreError, json.JSONDecodeError, KeyError):
        return False
    return True
