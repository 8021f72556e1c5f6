"""How stage tasks are cached.

The key is the stage's content fingerprint (inputs + settings + stage version), computed
by the flow and passed in as `fp`; editing a task's code does not change it. Results are
persisted as JSON (StageRecord) under the run's artifact root. Before calling a task the
flow checks that the artifact itself is whole (eagle3.artifacts.read_complete); when it
is not (deleted, truncated, half-built) the task is run with refresh_cache=True, so a
cached record never points at a missing artifact.

A persisted result file names its own serializer, and Prefect obeys it: a file rewritten to
say "pickle" would be unpickled (code run) when the cache is read. So before Prefect reads
one, `trusted_result` checks that it is what this module writes: Prefect's JSON serializer
with its standard decoder, holding exactly one object, a StageRecord. Anything else is
deleted (with a warning) and the task runs afresh; the stage function then finds its whole
artifact and returns it without work.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

import fsspec
from prefect import Task
from prefect.filesystems import RemoteFileSystem
from prefect.context import TaskRunContext

from eagle3.artifacts import read_complete
from eagle3.stages import out_dir

log = logging.getLogger(__name__)

RESULTS = "prefect-results"
JSON_DECODER = "prefect.serializers.prefect_json_object_decoder"
RECORD_CLASS = "eagle3.artifacts.StageRecord"


def trusted_result(path: Path | str) -> bool:
    """True when the persisted result at `path` (a file, or a URL) is a JSON StageRecord as this module writes it."""
    try:
        with fsspec.open(str(path), "r", encoding="utf-8") as handle:
            record = json.loads(handle.read())
        serializer = record["metadata"]["serializer"]
        payload = record["result"]
        inner = json.loads(payload)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(serializer, dict) and serializer.get("type") == "json"
        and serializer.get("jsonlib", "json") == "json" and serializer.get("object_decoder") == JSON_DECODER
        and isinstance(inner, dict) and inner.get("__class__") == RECORD_CLASS
        and payload.count('"__class__"') == 1  # the decoder imports whatever a nested "__class__" names
    )


def fingerprint_key(context: TaskRunContext, parameters: dict) -> str:
    return f"{context.task.name}-{parameters['fp']}"


def _result_storage(root: Path, results: str | None) -> tuple[Path | RemoteFileSystem, str]:
    """(Prefect's result storage, the folder or URL its files are in)."""
    if results is None:
        storage = Path(root).resolve() / RESULTS
        return storage, str(storage)
    return _saved_block(results), results


@functools.cache
def _saved_block(url: str) -> RemoteFileSystem:
    """A RemoteFileSystem block for `url`, saved on the server (Prefect refuses unsaved result-storage
    blocks), named by the URL's hash. It holds no credentials: each machine's own environment gives
    them (AWS_* variables, a profile, GOOGLE_APPLICATION_CREDENTIALS), as for the artifacts."""
    block = RemoteFileSystem(basepath=url)
    block.save(f"eagle3-results-{hashlib.sha256(url.encode()).hexdigest()[:12]}", overwrite=True)
    return block


def cached(task: Task, root: Path, stage: str, fp: str, results: str | None = None) -> Task:
    """`task` configured for this run: results under `root` (or at the URL `results`: a shared
    artifact root's prefect-results), cache refreshed when the (local) artifact is not whole."""
    whole = read_complete(out_dir(root, stage, fp)) is not None
    storage, where = _result_storage(root, results)
    result = f"{where}/{task.name}-{fp}"
    fs, path = fsspec.core.url_to_fs(result)
    if fs.exists(path) and not trusted_result(result):
        log.warning("%s is not a JSON StageRecord as eagle3 writes it (edited by hand, or another serializer); "
                    "deleted unread, the %s stage runs again", path, stage)
        fs.rm_file(path)
        whole = False
    return task.with_options(
        cache_key_fn=fingerprint_key,
        persist_result=True,
        result_storage=storage,  # a Path or a block: a str would name a saved block
        result_serializer="json",
        refresh_cache=not whole,
    )
