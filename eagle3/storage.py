"""Artifacts on shared storage: an fsspec URL as the artifact root of record, mirrored locally.

`artifact_root` may be a local folder (an NFS mount included: stages then read and write it
directly, as on one machine) or a URL that fsspec opens (`s3://bucket/prefix`, `gs://...`).
With a URL, every machine works in a local mirror (`<run_dir>/artifacts`, the same layout as
a local root) and `RemoteRoot` keeps the bucket the authority:

    <url>/<stage>/<fingerprint>/<files...>      uploaded as they are finished
    <url>/<stage>/<fingerprint>/.eagle3-complete.json   uploaded LAST: the artifact is whole
    <url>/prefect-results/<task>-<fingerprint>  Prefect's persisted results (tasks.cache)

Object stores have no rename, so the guarantees of eagle3.artifacts are kept by order and by
names instead:
- an object is whole once its PUT returns, so a file is uploaded only once it is whole locally
  (the project's writers finish a file under a temporary name that starts with "." and rename
  it; such names are never uploaded, so nothing in the bucket is ever under a temporary name);
- an artifact counts as whole remotely only when its marker is there and every file the marker
  lists is there with the listed size; the marker goes up after everything it lists;
- a stage that writes in place and resumes (extract's shards with their manifest, train's
  checkpoints) is followed while it runs: `following()` uploads each finished file within a
  second, the manifest after the shards it lists, so a worker killed mid-stage loses at most
  the file it was writing; `pull_partial()` brings those files back on whichever machine runs
  the stage next, and the stage's own resume checks (sha256 per shard, checkpoint markers)
  decide what is reused.
A local mirror is a cache keyed by fingerprint: `pull()` fills it from the bucket when the
artifact is whole there, and a whole local artifact is never downloaded again.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec

from eagle3.artifacts import MARKER, read_complete

RESULTS_DIR = "prefect-results"
FOLLOW_SECONDS = 1.0  # between two uploads of what a running stage finished
IN_PLACE_INDEX = "manifest.json"  # a store's index: uploaded after the shards it lists


class StorageError(RuntimeError):
    """The artifact root cannot be used; the message names the URL and the setting."""


def is_url(root: str | os.PathLike[str] | None) -> bool:
    """True for an fsspec URL other than a plain local path (file:// counts as local)."""
    text = str(root or "")
    return "://" in text and not text.startswith("file://")


def _is_temporary(relative: str) -> bool:
    """A path some writer is still building (its name, or a folder above it, starts with '.')."""
    return any(part.startswith(".") for part in Path(relative).parts)


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    """A local file's bytes, as far as its stat tells: hard links share all four; a new file on a reused inode does not."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


class RemoteRoot:
    """The artifact root at `url`, mirrored into the local folder `local` (see module docstring)."""

    def __init__(self, url: str, local: Path, *, setting: str = "artifact_root") -> None:
        self.url = url.rstrip("/")
        self.local = Path(local)
        self.setting = setting
        try:
            self.fs, self.base = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as err:  # no fsspec implementation for the protocol (s3fs, gcsfs missing)
            raise StorageError(f"{setting}={url!r}: cannot open this URL ({err}); install the fsspec package for "
                               "its protocol (s3fs for s3://, gcsfs for gs://) or set a local folder") from None
        except OSError as err:  # filesystems that connect as they open (ftp://, sftp://) and find no server
            raise StorageError(f"{setting}={url!r}: the artifact root cannot be written ({type(err).__name__}: {err}); "
                               "check that this machine reaches it, or set a local folder") from None
        self._uploaded: dict[str, tuple[int, int]] = {}  # remote path -> (size, mtime_ns) of what went up
        # a local file (device, inode, size, mtime) -> an object in the bucket with its bytes. Size and mtime too: a
        # file deleted or replaced (a store's manifest rewritten) frees its inode, and a new file can get it
        self._objects: dict[tuple[int, int, int, int], str] = {}
        self._lock = threading.Lock()

    # -- names -------------------------------------------------------------------------
    def remote_dir(self, stage: str, fp: str) -> str:
        return f"{self.base}/{stage}/{fp}"

    def local_dir(self, stage: str, fp: str) -> Path:
        return self.local / stage / fp

    @property
    def results_url(self) -> str:
        return f"{self.url}/{RESULTS_DIR}"

    # -- checks ------------------------------------------------------------------------
    def check(self) -> None:
        """Write, read back and delete a probe object: StorageError naming the URL and the setting when
        the bucket is unreachable, missing, or the credentials do not allow it (before any work)."""
        probe = f"{self.base}/.eagle3-probe-{uuid.uuid4().hex}"
        try:
            self.fs.pipe_file(probe, b"eagle3 probe")
            if self.fs.cat_file(probe) != b"eagle3 probe":
                raise OSError("the probe object read back differently")
            self.fs.rm_file(probe)
        except Exception as err:  # noqa: BLE001 - botocore, aiohttp and fsspec raise many kinds; all mean "cannot use it"
            raise StorageError(
                f"{self.setting}={self.url!r}: the artifact root cannot be written ({type(err).__name__}: {err}); "
                f"check that the bucket exists, that this machine reaches it, and the credentials (for S3: "
                f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile, AWS_ENDPOINT_URL for a non-AWS server), "
                f"or set {self.setting} to a local folder"
            ) from None

    def _marker(self, stage: str, fp: str) -> dict | None:
        try:
            marker = json.loads(self.fs.cat_file(f"{self.remote_dir(stage, fp)}/{MARKER}"))
            files = marker["files"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        return marker if isinstance(files, dict) else None

    def _sizes(self, stage: str, fp: str) -> dict[str, int]:
        """relative path -> size of every object under the artifact's prefix."""
        prefix = self.remote_dir(stage, fp)
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(prefix) + 1:]: int(info.get("size") or 0) for name, info in found.items()
                if info.get("type") != "directory" and name.startswith(prefix + "/")}

    def is_whole(self, stage: str, fp: str) -> bool:
        """The marker is in the bucket and every file it lists is there with its size."""
        marker = self._marker(stage, fp)
        if marker is None:
            return False
        sizes = self._sizes(stage, fp)
        return all(sizes.get(name) == size for name, size in marker["files"].items())

    # -- down --------------------------------------------------------------------------
    def _get(self, remote: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            self.fs.get_file(remote, str(tmp))
            os.replace(tmp, local)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        stat = local.stat()
        with self._lock:  # it is in the bucket already: following() need not send it back
            self._uploaded[remote] = (stat.st_size, stat.st_mtime_ns)
            self._objects[_identity(stat)] = remote

    def pull(self, stage: str, fp: str) -> bool:
        """Make the local mirror hold the artifact when the bucket has it whole; True when it then does.

        Files already in the mirror with the listed size are kept (the mirror is a cache); the
        marker is written locally last, as the stage itself would."""
        local = self.local_dir(stage, fp)
        if read_complete(local) is not None:
            return True
        marker = self._marker(stage, fp)
        if marker is None or not self.is_whole(stage, fp):
            return False
        remote = self.remote_dir(stage, fp)
        for name, size in marker["files"].items():
            path = local / name
            if not (path.is_file() and path.stat().st_size == size):
                self._get(f"{remote}/{name}", path)
        self._get(f"{remote}/{MARKER}", local / MARKER)
        return read_complete(local) is not None

    def pull_partial(self, stage: str, fp: str) -> int:
        """Bring what an unfinished run of the stage uploaded (shards, checkpoints) into the mirror;
        returns how many files came down. The stage's own resume checks decide what is reused."""
        local, remote, count = self.local_dir(stage, fp), self.remote_dir(stage, fp), 0
        for name, size in self._sizes(stage, fp).items():
            path = local / name
            if _is_temporary(name) or (path.is_file() and path.stat().st_size == size):
                continue
            self._get(f"{remote}/{name}", path)
            count += 1
        return count

    # -- up ----------------------------------------------------------------------------
    def _put(self, path: Path, remote: str, *, force: bool = False) -> None:
        stat = path.stat()
        key = (stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if self._uploaded.get(remote) == key and not force:
                return
            twin = self._objects.get(_identity(stat))
        if twin is not None and twin != remote:  # a hard link of a file in the bucket (assemble): copied there, not sent
            self.fs.copy(twin, remote)  # server-side on object stores (S3 CopyObject, GCS rewrite)
        else:
            self.fs.put_file(str(path), remote)  # one object, whole once this returns
        with self._lock:
            self._uploaded[remote] = key
            self._objects.setdefault(_identity(stat), remote)

    def _finished_files(self, local: Path) -> list[Path]:
        """The whole files of a local artifact folder, indexes (manifest.json) after what they list."""
        files = [p for p in sorted(local.rglob("*")) if p.is_file() and p.name != MARKER
                 and not _is_temporary(str(p.relative_to(local)))]
        return sorted(files, key=lambda p: p.name == IN_PLACE_INDEX)

    def upload_finished(self, stage: str, fp: str) -> int:
        """Upload the local artifact's whole files that the bucket does not have yet; returns how many."""
        local, remote = self.local_dir(stage, fp), self.remote_dir(stage, fp)
        if not local.is_dir():
            return 0
        before = len(self._uploaded)
        for path in self._finished_files(local):
            with contextlib.suppress(FileNotFoundError):  # replaced between the listing and the upload: next pass
                self._put(path, f"{remote}/{path.relative_to(local)}")
        return len(self._uploaded) - before

    def push(self, stage: str, fp: str) -> None:
        """Upload a whole local artifact: every file, then the marker (the bucket's "it is whole")."""
        local = self.local_dir(stage, fp)
        if read_complete(local) is None:
            raise StorageError(f"{local} is not a whole artifact; nothing was uploaded to {self.remote_dir(stage, fp)}")
        if self.is_whole(stage, fp):
            return
        listed = json.loads((local / MARKER).read_text())["files"]  # the marker is the authority on what is whole
        there, remote = self._sizes(stage, fp), self.remote_dir(stage, fp)
        for name in sorted(listed, key=lambda n: Path(n).name == IN_PLACE_INDEX):
            if there.get(name) != listed[name]:  # missing or damaged in the bucket
                self._put(local / name, f"{remote}/{name}", force=True)
        self.fs.put_file(str(local / MARKER), f"{remote}/{MARKER}")

    @contextlib.contextmanager
    def following(self, stage: str, fp: str, every: float = FOLLOW_SECONDS) -> Iterator[None]:
        """While the body runs, upload what the stage finishes in its local folder, every `every` s."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def loop() -> None:
            while not stop.wait(every):
                try:
                    self.upload_finished(stage, fp)
                except Exception as err:  # noqa: BLE001 - reported after the stage, not lost in a thread
                    errors.append(err)
                    return

        thread = threading.Thread(target=loop, name=f"eagle3-upload-{stage}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        if errors:
            raise StorageError(f"uploading {stage} files to {self.remote_dir(stage, fp)} failed: {errors[0]}") from errors[0]

    def leftovers(self) -> list[str]:
        """Objects under temporary names (there should be none): for checks and tests."""
        try:
            names = self.fs.find(self.base)
        except FileNotFoundError:
            return []
        return [n for n in names if _is_temporary(n[len(self.base) + 1:]) and Path(n).name != MARKER
                and ".eagle3-probe-" not in n]


def open_root(artifact_root: str | None, local: Path, *, check: bool = True) -> RemoteRoot | None:
    """A RemoteRoot for a URL artifact root (checked by a probe write when `check`), None for a local one."""
    if not is_url(artifact_root):
        return None
    root = RemoteRoot(str(artifact_root), local)
    if check:
        root.check()
    return root
