"""Incremental data for the nightly run: dated conversation files, one chain of artifacts each.

New traffic lands as dated JSONL files (`YYYY-MM-DD*.jsonl`, one conversation per line, the
format of eagle3.data.conversations) under a folder or an fsspec URL. Each file goes through regenerate ->
prepare_data -> extract on its own, so its artifacts are keyed by its own content: a file
that was there last night comes back Cached (no shard is extracted twice), and only the
files that arrived since are computed. A dated file is expected not to change once written;
if it does, its chain is computed again.

`assemble` then joins the parts into one artifact that the draft stages read as both the
prepared data (train.jsonl, heldout.jsonl) and the hidden-state store (train/, heldout/):
shards are hard links to the parts' shards (a copy across file systems) under a merged
manifest, so nothing is recomputed and nothing large is copied. Sample ids are prefixed with
their file's date, so that two files may reuse an id.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

import fsspec

from eagle3.artifacts import StageRecord, atomic_write_text, building, mark_complete
from eagle3.capture.store import MANIFEST, SHARD_FILE
from eagle3.data import conversations
from eagle3.data.conversations import DataError
from eagle3.fingerprint import fingerprint

ASSEMBLE_VERSION = "1"
_DATED = re.compile(r"^(\d{4}-\d{2}-\d{2}).*\.jsonl$")


@dataclass(frozen=True)
class IncomingFile:
    day: date
    name: str  # file name, e.g. 2026-11-29.jsonl
    uri: str  # where it is (local path or URL)
    size: int


def discover(incoming: str, *, today: date | None = None, window_days: int | None = None) -> list[IncomingFile]:
    """The dated files under `incoming`, oldest first; files dated after `today` wait for their day."""
    fs, root = fsspec.core.url_to_fs(incoming)
    if not fs.isdir(root):
        raise DataError(f"incoming={incoming!r}: no such folder; expected a folder of dated files YYYY-MM-DD*.jsonl")
    today = today or date.today()
    first = today - timedelta(days=window_days - 1) if window_days else date.min
    found = []
    for info in fs.ls(root, detail=True):
        name = Path(info["name"]).name
        match = _DATED.match(name)
        if info.get("type") != "file" or not match:
            continue
        try:
            day = date.fromisoformat(match.group(1))
        except ValueError:
            continue
        if first <= day <= today:
            uri = info["name"] if "://" not in incoming else f"{incoming.rstrip('/')}/{name}"
            found.append(IncomingFile(day, name, uri, int(info.get("size") or 0)))
    if not found:
        raise DataError(
            f"incoming={incoming!r}: no dated conversation file (YYYY-MM-DD*.jsonl) up to {today}"
            + (f" in the last window_days={window_days} days" if window_days else "")
        )
    return sorted(found, key=lambda f: (f.day, f.name))


def local_copy(file: IncomingFile, staging: Path) -> Path:
    """A local path with the file's content: the file itself when local, else a copy under `staging`."""
    if "://" not in file.uri or file.uri.startswith("file://"):
        return Path(file.uri.removeprefix("file://"))
    target = Path(staging) / file.name
    if not target.is_file() or target.stat().st_size != file.size:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        with fsspec.open(file.uri, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, target)
    return target


# -- assemble ----------------------------------------------------------------------------
def fingerprint_assemble(parts: list[tuple[str | None, StageRecord, StageRecord]]) -> str:
    """parts: (label, prepared, extracted) per file, oldest first."""
    return fingerprint("assemble", ASSEMBLE_VERSION, [label for label, _, _ in parts],
                       *[f"{p.fingerprint}:{e.fingerprint}" for _, p, e in parts])


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system: copy
        shutil.copyfile(src, dst)


def _label(label: str | None, sample_id: str) -> str:
    """A part's sample id in the assembled artifact: prefixed with its file's label, or as it is (label None:
    the parts of one split, whose ids are distinct already)."""
    return sample_id if label is None else f"{label}:{sample_id}"


def _merge_store(parts: list[tuple[str | None, Path]], out: Path) -> dict[str, int]:
    """Join the stores `parts` (label, store dir) into `out`: linked shards, one manifest."""
    out.mkdir(parents=True, exist_ok=True)
    merged: dict | None = None
    shards: list[dict] = []
    for index, (label, store) in enumerate(parts):
        manifest = json.loads((store / MANIFEST).read_text())
        layout = {k: manifest.get(k) for k in ("format_version", "aux_layer_ids", "hidden_size", "dtype", "hidden_scales")}
        if merged is None:
            merged = layout
        elif layout != merged:
            raise DataError(f"store {store} ({label}) has layout {layout}, the earlier parts {merged}: "
                            "all files must be extracted with the same target and extract settings")
        for entry in manifest["shards"]:
            if not isinstance(entry.get("file"), str) or not SHARD_FILE.fullmatch(entry["file"]):
                raise DataError(f"{store / MANIFEST} lists {entry.get('file')!r}, not a shard file name of the store; "
                                "the manifest was edited by hand: delete that extract artifact and run again")
            name = f"p{index:04d}-{entry['file']}"
            _link(store / entry["file"], out / name)
            shards.append(entry | {"file": name, "sample_ids": [_label(label, i) for i in entry["sample_ids"]]})
    manifest = (merged or {}) | {"complete": True, "num_samples": sum(len(s["sample_ids"]) for s in shards), "shards": shards}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    return {"samples": manifest["num_samples"], "tokens": sum(s["num_tokens"] for s in shards), "shards": len(shards)}


def _merge_samples(parts: list[tuple[str | None, Path]], out: Path) -> None:
    with open(out, "w", encoding="utf-8") as handle:
        for label, path in parts:
            for s in conversations.read_samples(path):  # the data source travels with the sample
                handle.write(json.dumps(conversations.sample_row(s) | {"id": _label(label, s.id)}) + "\n")


def run_assemble(parts: list[tuple[str | None, StageRecord, StageRecord]], root: Path, fp: str) -> StageRecord:
    """One artifact with the prepared data and the hidden states of every part (label, prepared, extracted);
    label None keeps the part's sample ids as they are."""
    from eagle3.stages import _done

    final, done = _done(root, "assemble", fp)
    if done:
        return done
    if not parts:
        raise DataError("nothing to assemble: no incoming file was prepared")
    with building(final) as tmp:
        stats: dict[str, int | str] = {"parts": len(parts), "files": json.dumps([label for label, _, _ in parts])}
        for split in ("train", "heldout"):
            _merge_samples([(label, p.path / f"{split}.jsonl") for label, p, _ in parts], tmp / f"{split}.jsonl")
            merged = _merge_store([(label, e.path / split) for label, _, e in parts], tmp / split)
            stats |= {f"{split}_{k}": v for k, v in merged.items()}
        return mark_complete(tmp, StageRecord(stage="assemble", uri=str(final), fingerprint=fp, stats=stats))
