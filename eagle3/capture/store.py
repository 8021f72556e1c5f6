"""The hidden-state store: what extraction writes and training reads.

A store is a directory:

    manifest.json            written last; lists every shard with size and sha256
    shard-00000.safetensors  several samples each
    shard-00001.safetensors
    ...

Inside a shard, sample j (0-based within the shard) has these tensors:

    "{j}.input_ids"      int64  [T]            token ids, prompt and answer
    "{j}.loss_mask"      bool   [T]            True on assistant tokens (the ones to learn)
    "{j}.hidden_states"  dtype  [T, n_aux+1, H] [:, :n_aux] the aux states in `aux_layer_ids`
                                               order, [:, -1] the final state (layer id N:
                                               the last decoder layer's output BEFORE the
                                               final norm)
    "{j}.hidden_scales"  float32 [T, n_aux+1]  fp8 stores only: one scale per (token, layer)
                                               row; state = value * scale

and the shard's safetensors metadata holds the sample ids as JSON ("sample_ids"), and, when any
sample names a data source (eagle3.data.conversations), their sources ("sample_sources", null
for a sample without one), which the manifest lists too ("sources"); a store of data without
sources has neither.
Layer ids follow vLLM: id k is the hidden state entering decoder layer k.

fp8 (`float8_e4m3fn`) stores keep one float32 scale per ROW (a token at one layer), set so
that the row's largest magnitude maps to e4m3's largest finite value, 448. Per-row and not
per-tensor because hidden-state magnitudes differ by orders of magnitude between rows: the
residual stream grows with depth, and a few tokens (the first token, delimiters) carry
"massive activations" 1e3-1e5x a typical element. A fixed scale would clip those (e4m3 ends
at 448); one amax scale for the whole tensor is set by those few rows and pushes the ordinary
rows toward e4m3's subnormals, where bits run out (tests/eagle3/test_store_fp8.py: 2x the
error at a 1e5 spread, 12x at 1e6, then underflow). With a per-row scale nothing is clipped and
every row keeps e4m3's 3-bit mantissa: element error <= 2^-4 of the element (half a step), so
a row's relative error is <= 2^-4, about 2.7% on average (2.65% measured on an 8B-shaped
Llama), for 4 bytes per H-element row (0.1% at H=4096). The reader returns the dequantized
states in bfloat16 (or float32 when asked).

Shards are written under a temporary name and renamed when complete, so a shard file
under its final name is always whole; the sha256 is computed from the bytes as they are
written (no second read). The manifest is rewritten (atomically) after every shard, so a
killed writer resumes at the first shard that is missing or whose checksum does not match.
`write_shard` may be called from several threads at once (extract's writer pool does), and
several processes may write one store at once (data-parallel engines, each its own shards):
the manifest is rewritten under an flock on the store folder, merged with the entries the
others wrote, so it lists every finished shard whoever wrote it. A temporary file is
removed at start only when the process named in its name is gone (it may be another
writer's shard in progress).
"""

from __future__ import annotations

import hashlib
import json
import fcntl
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.artifacts import atomic_write_text, pid_alive, sha256_file

MANIFEST = "manifest.json"
_TMP_PID = re.compile(r"\.tmp-(\d+)-")
SHARD_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*\.safetensors")  # a plain file name in the store (assembled stores prefix it)
FORMAT_VERSION = 1
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALES = "per_row_amax_float32"  # the manifest's name for the fp8 scaling scheme above
# torch dtype -> safetensors dtype tag (the format's spelling)
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", FP8: "F8_E4M3",
}


class StoreError(RuntimeError):
    """A store on disk is missing, incomplete or does not match what was asked for."""


@dataclass(frozen=True)
class Sample:
    """One extracted sample. Shapes: input_ids/loss_mask [T]; hidden_states [T, n_aux+1, H].

    `hidden_scales` [T, n_aux+1] float32 is set only when hidden_states is already fp8-encoded
    (`encode_states`); otherwise None and the writer encodes.
    """

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    hidden_scales: torch.Tensor | None = None
    source: str | None = None  # its data source; None: none given

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
    sources: tuple[str | None, ...] | None = None  # each sample's data source; None: no sample names one


# -- fp8 encoding (pure) -------------------------------------------------------------------
def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states [..., H] -> (values [..., H] float8_e4m3fn, scales [...] float32), states ~ values * scales."""
    x = states.float()
    amax = x.abs().amax(dim=-1)  # [...]
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero row keeps scale 1
    values = (x / scales[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # clamp: rounding may land a hair above 448
    return values, scales


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(values [..., H] fp8, scales [...]) -> states [..., H] in `dtype`."""
    return (values.float() * scales.float()[..., None]).to(dtype)


def encode_states(states: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """States [..., H] in the storage `dtype`: (values, per-row scales) for fp8, (states, None) otherwise."""
    if dtype == FP8:
        return quantize_fp8(states)
    return states.to(dtype), None


# -- files ---------------------------------------------------------------------------------



def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without copying when it is already contiguous."""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)  # any dtype -> its bytes [numel * itemsize]
    return memoryview(flat.numpy()).cast("B")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write `tensors` (CPU) to `path` in the safetensors format and fsync; returns (size, sha256).

    The bytes go straight from each tensor's memory to the file (safetensors' own `save_file`
    builds the whole file in memory first, copying every tensor twice while holding the GIL),
    and the checksum is taken from the same buffers as they are written.
    """
    # largest itemsize first, so each tensor starts at a multiple of its own itemsize
    ordered = sorted(tensors.items(), key=lambda item: -item[1].element_size())
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in ordered:
        if tensor.dtype not in _ST_DTYPES:
            raise StoreError(f"tensor {name!r} has dtype {tensor.dtype}, which a store cannot hold; expected one of {list(_ST_DTYPES)}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)  # the format pads the header so the data starts 8-aligned
    digest = hashlib.sha256()
    with open(path, "wb", buffering=0) as handle:
        for chunk in [memoryview(struct.pack("<Q", len(blob)) + blob)] + [_raw_bytes(t) for _, t in ordered]:
            digest.update(chunk)  # releases the GIL on large buffers, as does write
            while chunk:
                chunk = chunk[handle.write(chunk[: 1 << 30]) :]
        os.fsync(handle.fileno())
    return 8 + len(blob) + offset, digest.hexdigest()


# -- writer --------------------------------------------------------------------------------
class StoreWriter:
    """Writes shards into `root`, resuming after a crash.

    `expected_shards` is the list of sample-id groups this store must end up with (the
    caller decides the grouping, so that a resume writes the same shards). `pending()`
    tells which of them still need work; `write_shard` writes one and updates the manifest.
    `dtype` is the storage dtype: float32, bfloat16, or torch.float8_e4m3fn (with per-row scales).
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
        if dtype not in _ST_DTYPES or not (dtype.is_floating_point or dtype == FP8):
            raise StoreError(f"storage dtype {dtype} is not supported; expected float32, bfloat16, float16 or float8_e4m3fn")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.aux_layer_ids = list(aux_layer_ids)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.expected = [tuple(ids) for ids in expected_shards]
        self._entries: dict[int, ShardEntry] = {}
        self._lock = threading.Lock()  # guards _entries and the manifest file
        self._load_valid_entries()

    def _load_valid_entries(self) -> None:
        """Keep manifest entries whose file is present and whole; forget the rest."""
        for tmp in self.root.glob(".*.tmp-*"):
            match = _TMP_PID.search(tmp.name)
            if match is None or int(match.group(1)) == os.getpid() or not pid_alive(int(match.group(1))):
                tmp.unlink(missing_ok=True)  # leftovers of a killed writer (a live one's shard in progress stays)
        self._entries.update(self._manifest_entries(verify=_shard_is_whole))

    def _manifest_entries(self, verify: Callable[[Path, ShardEntry], bool]) -> dict[int, ShardEntry]:
        """The manifest's entries that fit this store's layout and expected shards and pass `verify`."""
        path = self.root / MANIFEST
        if not path.exists():
            return {}
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError:
            return {}  # unreadable manifest: every shard is re-verified by being redone
        same_layout = (manifest.get("aux_layer_ids"), manifest.get("hidden_size"), manifest.get("dtype")) == (
            self.aux_layer_ids, self.hidden_size, _dtype_name(self.dtype))
        if not same_layout:
            return {}
        entries = {}
        for index, raw in enumerate(manifest.get("shards", [])):
            if raw is None or index >= len(self.expected):
                continue
            try:
                entry = _entry(raw, self.root)
            except (StoreError, KeyError, TypeError):
                continue  # an edited or damaged line: that shard is redone
            if entry.sample_ids == self.expected[index] and entry.file == shard_name(index) and verify(self.root, entry):
                entries[index] = entry
        return entries

    def pending(self) -> list[int]:
        """Indices of expected shards that are missing or invalid."""
        with self._lock:
            return [i for i in range(len(self.expected)) if i not in self._entries]

    def write_shard(self, index: int, samples: Sequence[Sample]) -> ShardEntry:
        ids = tuple(s.sample_id for s in samples)
        if ids != self.expected[index]:
            raise StoreError(f"shard {index} got samples {ids}, expected {self.expected[index]}")
        tensors: dict[str, torch.Tensor] = {}
        sources = tuple(s.source for s in samples) if any(s.source is not None for s in samples) else None
        metadata = {"sample_ids": json.dumps(list(ids))} | ({} if sources is None else {"sample_sources": json.dumps(sources)})
        for j, sample in enumerate(samples):
            values, scales = self._encoded(sample)
            tensors[f"{j}.input_ids"] = sample.input_ids.to(torch.int64).contiguous()
            tensors[f"{j}.loss_mask"] = sample.loss_mask.to(torch.bool).contiguous()
            tensors[f"{j}.hidden_states"] = values.contiguous()
            if scales is not None:
                tensors[f"{j}.hidden_scales"] = scales.to(torch.float32).contiguous()
        final = self.root / shard_name(index)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            size, sha256 = write_safetensors(tmp, tensors, metadata)
            os.replace(tmp, final)
        except OSError as err:  # a full disk, a quota, an I/O error: nothing under the final name
            tmp.unlink(missing_ok=True)
            raise StoreError(
                f"writing {final} failed ({err.strerror or err}); nothing was written under that name and the "
                f"finished shards are kept: free space under {self.root} and run the extract stage again"
            ) from err
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        entry = ShardEntry(file=final.name, sample_ids=ids, num_tokens=sum(s.num_tokens for s in samples), size=size,
                           sha256=sha256, sources=sources)
        with self._lock:
            self._entries[index] = entry
            try:
                self._write_manifest()
            except OSError as err:
                raise StoreError(f"updating {self.root / MANIFEST} failed ({err.strerror or err}); free space under "
                                 f"{self.root} and run the extract stage again") from err
        return entry

    def _encoded(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Check the sample's shape and return its states in the storage dtype (+ fp8 scales)."""
        n_rows = len(self.aux_layer_ids) + 1
        want = (sample.num_tokens, n_rows, self.hidden_size)
        states, scales = sample.hidden_states, sample.hidden_scales
        if tuple(states.shape) != want:
            raise StoreError(f"sample {sample.sample_id!r}: hidden_states shape {tuple(states.shape)}, expected {want}")
        if scales is None:
            if states.dtype == FP8:
                raise StoreError(f"sample {sample.sample_id!r}: fp8 hidden_states without hidden_scales; use encode_states()")
            return encode_states(states, self.dtype)
        if states.dtype != FP8 or self.dtype != FP8 or tuple(scales.shape) != want[:2]:
            raise StoreError(
                f"sample {sample.sample_id!r}: hidden_scales {tuple(scales.shape)} with {states.dtype} states for a "
                f"{self.dtype} store; expected fp8 states with scales {want[:2]} in an fp8 store, else no scales"
            )
        return states, scales

    def finish(self) -> None:
        """(Re)write the manifest; an empty store (no shards) is complete once finished."""
        with self._lock:
            self._write_manifest()

    def _write_manifest(self) -> None:
        folder = os.open(self.root, os.O_RDONLY)  # the lock is on the store folder itself: no lock file is left in it
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)  # another process may be merging its shards right now
            # what other writers of this store finished since (their files were checked when written)
            for index, entry in self._manifest_entries(verify=_same_size).items():
                self._entries.setdefault(index, entry)
            self._write_manifest_locked()
        finally:
            os.close(folder)  # releases the lock

    def _write_manifest_locked(self) -> None:
        shards = []
        for i in range(len(self.expected)):
            entry = self._entries.get(i)
            shards.append(None if entry is None else _manifest_line(entry))
        manifest = {
            "format_version": FORMAT_VERSION,
            "aux_layer_ids": self.aux_layer_ids,
            "hidden_size": self.hidden_size,
            "dtype": _dtype_name(self.dtype),
            "hidden_scales": SCALES if self.dtype == FP8 else None,
            "complete": len(self._entries) == len(self.expected),
            "num_samples": sum(len(ids) for ids in self.expected),
            "shards": shards,
        }
        atomic_write_text(self.root / MANIFEST, json.dumps(manifest, indent=1))


def _manifest_line(entry: ShardEntry) -> dict:
    line = {k: v for k, v in entry.__dict__.items() if k != "sources"} | {"sample_ids": list(entry.sample_ids)}
    return line if entry.sources is None else line | {"sources": list(entry.sources)}


def _entry(raw: dict, root: Path) -> ShardEntry:
    """A manifest line as a ShardEntry; its file must be a plain name inside `root` (a hand-edited
    manifest cannot make the reader open, or discard, a file elsewhere)."""
    name = raw["file"]
    if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
        raise StoreError(f"{root / MANIFEST}: shard file {name!r} is not a shard name inside the store "
                         "(expected e.g. shard-00000.safetensors); the manifest was edited: run the extract stage again")
    sources = raw.get("sources")
    return ShardEntry(name, tuple(raw["sample_ids"]), raw["num_tokens"], raw["size"], raw["sha256"],
                      None if sources is None else tuple(sources))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _same_size(root: Path, entry: ShardEntry) -> bool:
    path = root / entry.file
    return path.is_file() and path.stat().st_size == entry.size


def _shard_is_whole(root: Path, entry: ShardEntry) -> bool:
    # The manifest's sample ids are the authority (an assembled store renames them), so only size and sha256.
    path = root / entry.file
    return path.is_file() and path.stat().st_size == entry.size and sha256_file(path) == entry.sha256


# -- reader --------------------------------------------------------------------------------
class StoreReader:
    """Reads a complete store. Opening checks the manifest and (unless `verify=False`) every shard.

    A shard whose size or sha256 do not match the manifest is never loaded: opening
    raises StoreError naming it, after deleting it (its bytes are known bad), so that the extract
    artifact is no longer whole and the next run of the extract stage recomputes exactly that shard.
    `verify=False` reads only the manifest (for sizes and ids). fp8 stores are dequantized on read
    into `dequantize_dtype` (bfloat16 or float32).
    """

    def __init__(self, root: Path, *, dequantize_dtype: torch.dtype = torch.bfloat16, verify: bool = True) -> None:
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise StoreError(f"no hidden-state store at {self.root} (missing {MANIFEST}); run the extract stage")
        manifest = json.loads(path.read_text())
        if not manifest.get("complete"):
            raise StoreError(f"hidden-state store at {self.root} is incomplete; re-run the extract stage to finish it")
        if manifest.get("format_version") != FORMAT_VERSION or manifest.get("hidden_scales") not in (None, SCALES):
            raise StoreError(
                f"store {self.root} has format {manifest.get('format_version')} with scales {manifest.get('hidden_scales')!r}; "
                f"this reader knows format {FORMAT_VERSION} with scales None or {SCALES!r}: re-run the extract stage"
            )
        self.aux_layer_ids: list[int] = manifest["aux_layer_ids"]
        self.hidden_size: int = manifest["hidden_size"]
        self.dtype: str = manifest["dtype"]  # storage dtype, e.g. "bfloat16" or "float8_e4m3fn"
        self.dequantize_dtype = dequantize_dtype
        self.shards = [_entry(e, self.root) for e in manifest["shards"]]
        # (shard index, position in shard) for every sample, in store order
        self._index = [(s, j) for s, entry in enumerate(self.shards) for j in range(len(entry.sample_ids))]
        if verify:
            self._verify_or_discard()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.shards)

    def sample_lengths(self) -> list[int]:
        """Each sample's token count, in store order, from its shard's header: no tensor is loaded."""
        return [shard_header(str(self.root / entry.file))[1][f"{j}.input_ids"]["shape"][0]
                for entry in self.shards for j in range(len(entry.sample_ids))]

    def sample_sources(self) -> list[str | None]:
        """Each sample's data source, in store order (None: it names none), from the manifest: nothing is loaded."""
        return [entry.sources[j] if entry.sources else None for entry in self.shards for j in range(len(entry.sample_ids))]

    def verify(self) -> None:
        """Raise StoreError naming the first shard whose size or checksum is wrong."""
        for entry in self.shards:
            if not _shard_is_whole(self.root, entry):
                raise StoreError(f"shard {self.root / entry.file} is missing or corrupt (size/sha256 do not match {MANIFEST})")

    def _verify_or_discard(self) -> None:
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(self.shards)))) as pool:  # sha256 releases the GIL
            whole = list(pool.map(lambda e: _shard_is_whole(self.root, e), self.shards))
        bad = [entry.file for entry, ok in zip(self.shards, whole) if not ok]
        for name in bad:
            (self.root / name).unlink(missing_ok=True)
        if bad:
            raise StoreError(
                f"store {self.root}: shard(s) {bad} missing or corrupt (size or sha256 do not match {MANIFEST}); "
                "they were not loaded and have been deleted: run again and the extract stage recomputes them"
            )

    def __getitem__(self, i: int) -> Sample:
        shard, j = self._index[i]
        entry = self.shards[shard]
        input_ids, loss_mask, states = read_shard_sample(self.root / entry.file, j, self.dequantize_dtype)
        return Sample(sample_id=entry.sample_ids[j], input_ids=input_ids, loss_mask=loss_mask, hidden_states=states,
                      source=entry.sources[j] if entry.sources else None)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]


def shard_header(path: str) -> tuple[int, dict]:
    """(offset of the data section, header) of a safetensors file (the format's 8-byte length + JSON).
    Cached per (path, size, mtime): a shard rewritten in place is read afresh."""
    stat = os.stat(path)
    return _header_of(path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4096)
def _header_of(path: str, size: int, mtime_ns: int) -> tuple[int, dict]:
    with open(path, "rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        return 8 + length, json.loads(handle.read(length))


def read_shard_sample(path: Path, j: int, dequantize_dtype: torch.dtype = torch.bfloat16
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample `j` of a shard in the store's format (a store's, or an online buffer's): token ids, loss mask and
    states [T, n, H] (fp8 states dequantized to `dequantize_dtype`)."""
    with safe_open(str(path), framework="pt") as handle:
        states = handle.get_tensor(f"{j}.hidden_states")
        if states.dtype == FP8:
            states = dequantize_fp8(states, handle.get_tensor(f"{j}.hidden_scales"), dequantize_dtype)
        return handle.get_tensor(f"{j}.input_ids"), handle.get_tensor(f"{j}.loss_mask"), states


def is_complete(root: Path) -> bool:
    """True when `root` holds a complete store whose shards all match their checksums (nothing is deleted)."""
    try:
        StoreReader(root, verify=False).verify()
    except (StoreError, json.JSONDecodeError, KeyError):
        return False
    return True


def shards_listed(root: Path) -> int:
    """How many shards the manifest at `root` lists as written (0 before the first); cheap, for progress."""
    try:
        return sum(raw is not None for raw in json.loads((Path(root) / MANIFEST).read_text()).get("shards", []))
    except (OSError, json.JSONDecodeError, AttributeError):
        return 0
