"""Stage artifacts: content-addressed directories that are either whole or absent.

Every stage writes into `<artifact_root>/<stage>/<fingerprint>/`. A directory counts as
an artifact only when its completion marker (`.eagle3-complete.json`, written last) is
there and every file it lists still has the recorded size. Anything else (a deleted
file, a truncated one, a half-built directory left by a killed run) is not an artifact
and the stage builds it again.

Stages that can build in one go use `building()`: they write into a temporary sibling
directory that is renamed into place only when complete, so a failure leaves nothing
under the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

MARKER = ".eagle3-complete.json"

Stat = int | float | str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never half.

    On failure (a full disk) the temporary file is removed and the old file stays as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_write_temporaries(folder: Path, names: Iterable[str]) -> None:
    """The temporaries atomic_write_text leaves for `names` in `folder` when its process is killed mid-write
    (`.<name>.tmp-<pid>-<thread>`). Call it where one writer owns the folder: a live writer's would go too."""
    for name in names:
        for path in Path(folder).glob(f".{name}.tmp-*"):
            path.unlink(missing_ok=True)


class StageRecord(BaseModel):
    """What a stage hands to the next: where its artifact is, its fingerprint, a few stats.

    A pydantic model so that Prefect persists it as JSON (never a pickle).
    """

    model_config = ConfigDict(frozen=True)

    stage: str = Field(description="Stage that wrote the artifact")
    uri: str = Field(description="Artifact folder")
    fingerprint: str = Field(description="Content fingerprint: inputs + settings + stage version")
    stats: dict[str, Stat] = Field(default_factory=dict, description="A few figures about the artifact")

    @property
    def path(self) -> Path:
        return Path(self.uri)

    def to_dict(self) -> dict[str, object]:
        return self.model_dump(mode="json")


def artifact_dir(root: Path, stage: str, fp: str) -> Path:
    return Path(root) / stage / fp


def _listing(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: so that renames inside it survive a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file below `root`, then `root` itself."""
    for path in Path(root).rglob("*"):
        if path.is_file():
            fsync_path(path)
    fsync_path(root)


def mark_complete(directory: Path, record: StageRecord) -> StageRecord:
    """Write the completion marker (last step of building an artifact)."""
    tmp = directory / f".{MARKER}.tmp"
    tmp.unlink(missing_ok=True)  # a killed earlier attempt's: not a file of the artifact
    marker = {"record": record.to_dict(), "files": _listing(directory)}
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, directory / MARKER)
    return record


def read_complete(directory: Path) -> StageRecord | None:
    """The record of a whole artifact at `directory`, or None when it is absent or damaged."""
    path = Path(directory) / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
        files: dict[str, int] = marker["files"]
        raw = marker["record"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    for name, size in files.items():
        file = directory / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return StageRecord(stage=raw["stage"], uri=str(directory), fingerprint=raw["fingerprint"], stats=raw["stats"])


@contextlib.contextmanager
def building(final: Path) -> Iterator[Path]:
    """Yield a temporary directory; on success rename it to `final`, on failure delete it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)  # a damaged earlier attempt (read_complete said no)
    os.replace(tmp, final)


def remove_stale_builds(parent: Path) -> None:
    """Delete `.X.building-PID` leftovers of killed runs under `parent`."""
    if parent.is_dir():
        for tmp in parent.glob(".*.building-*"):
            shutil.rmtree(tmp, ignore_errors=True)
