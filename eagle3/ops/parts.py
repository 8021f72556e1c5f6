"""Fan-out of the data chain over machines: the conversations split into N parts, a flow run each.

`extract.parts: N` (N > 1) splits the conversations once (`split_data`: data.source with
data.max_samples applied, conversation i to part i % N, ids kept). Each part's regenerate ->
prepare_data -> extract chain then runs as its own flow run (flows/part.py, the `extract-part`
deployment on the `gpu` work pool) on whichever worker takes it, against the shared artifact
root; its last stage, `part`, records its prepared and extracted artifacts. The parent waits
for every part, joins them with `assemble` (eagle3.ops.incremental, sample ids unchanged: the
parts are disjoint) and trains on the result, as a one-machine run trains on its extraction.

A part is named by `fingerprint_part`, which the parent computes without running anything, so
a rerun finds a finished part in the bucket and launches nothing for it. A part's own stages
are keyed as everywhere else; its data source is a path relative to the worker's working
folder (`part_data`), the same string on every machine, so a part that a dead worker left
half-done has the same fingerprints on the next worker, which reuses its uploaded shards.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.artifacts import StageRecord, atomic_write_text, building, mark_complete
from eagle3.capture.extract import FAN_OUT_SETTINGS
from eagle3.capture.regenerate import RUNTIME_REGENERATE_SETTINGS
from eagle3.config import PipelineConfig
from eagle3.data import conversations
from eagle3.data.conversations import DataConfig, DataError
from eagle3.fingerprint import fingerprint, hash_files

SPLIT_VERSION = "1"
PART_VERSION = "1"
PARTS_DIR = "eagle3-parts"  # part flow runs' run folders, under the worker's working folder
RECORDS = "records.json"  # in a part artifact: {"prepared": StageRecord, "extracted": StageRecord}
ALL_SAMPLES = 10**9  # a part file is already cut to data.max_samples


def part_file(index: int) -> str:
    return f"part-{index:05d}.jsonl"


# -- split_data ----------------------------------------------------------------------------
def fingerprint_split(data: DataConfig, parts: int) -> str:
    source = hash_files(conversations.source_files(data.source))
    settings = {"source": data.source, "max_samples": data.max_samples, "max_bad_rows": data.max_bad_rows, "parts": parts}
    if conversations.names_sources(data.source):  # part files written before sources were kept lack them
        settings["sources"] = "1"
    return fingerprint("split_data", SPLIT_VERSION, settings, source)


def run_split(data: DataConfig, parts: int, root: Path, fp: str) -> StageRecord:
    """N part files of the source's conversations (conversation i in part i % N)."""
    from eagle3.stages import _done

    final, done = _done(root, "split_data", fp)
    if done:
        return done
    chats = conversations.load_conversations(data)
    if len(chats) < parts:
        raise DataError(f"extract.parts={parts}, but data.source={data.source!r} gives {len(chats)} conversations "
                        f"(data.max_samples={data.max_samples}); set extract.parts to at most {len(chats)}")
    with building(final) as tmp:
        for index in range(parts):
            conversations.write_conversations(tmp / part_file(index), chats[index::parts])
        stats = {"conversations": len(chats), "parts": parts}
        return mark_complete(tmp, StageRecord(stage="split_data", uri=str(final), fingerprint=fp, stats=stats))


# -- one part ------------------------------------------------------------------------------
def part_config(config: PipelineConfig, split_fp: str, index: int) -> PipelineConfig:
    """The settings of part `index`'s flow run: its own run folder (relative: under the worker's working
    folder), the shared artifact root, its part file as the data source, and no further fan-out."""
    run_dir = f"{PARTS_DIR}/{split_fp}/part-{index:05d}"
    shell = config.model_copy(update={"run_dir": run_dir})
    source = str(shell.artifacts / "split_data" / split_fp / part_file(index))
    return config.model_copy(update={
        "run_dir": run_dir,
        "data": config.data.model_copy(update={"source": source, "max_samples": ALL_SAMPLES}),
        "extract": config.extract.model_copy(update={"parts": 1}),
    })


def fingerprint_part(config: PipelineConfig, split_fp: str, index: int, target_fp: str) -> str:
    """What part `index` computes: its split, the target and the settings of its three stages."""
    settings = {
        "regenerate": config.regenerate.model_dump(mode="json", exclude=RUNTIME_REGENERATE_SETTINGS),
        "data": config.data.model_dump(mode="json", exclude={"source", "max_samples"}),
        "extract": config.extract.model_dump(mode="json", exclude=RUNTIME_EXTRACT),
        "dtype": config.target.dtype, "max_model_len": config.target.max_model_len, "index": index,
    }
    return fingerprint("part", PART_VERSION, settings, split_fp, target_fp)


RUNTIME_EXTRACT = FAN_OUT_SETTINGS | {"batch_tokens"}  # how a part runs, not what it stores


def run_part_record(prepared: StageRecord, extracted: StageRecord, root: Path, fp: str) -> StageRecord:
    """The part's own artifact: which prepared and extracted artifacts it made (the parent reads it)."""
    from eagle3.stages import _done

    final, done = _done(root, "part", fp)
    if done:
        return done
    with building(final) as tmp:
        atomic_write_text(tmp / RECORDS, json.dumps({"prepared": prepared.to_dict(), "extracted": extracted.to_dict()}))
        stats = {"prepared": prepared.fingerprint, "extracted": extracted.fingerprint,
                 **{k: v for k, v in extracted.stats.items() if k.endswith(("_samples", "_tokens"))}}
        return mark_complete(tmp, StageRecord(stage="part", uri=str(final), fingerprint=fp, stats=stats))


def read_part(part: StageRecord) -> tuple[StageRecord, StageRecord]:
    """(prepared, extracted) records of a part artifact."""
    raw = json.loads((part.path / RECORDS).read_text())
    return StageRecord.model_validate(raw["prepared"]), StageRecord.model_validate(raw["extracted"])
