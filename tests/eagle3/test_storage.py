"""eagle3.storage on fsspec's in-memory filesystem (a real fsspec implementation with no rename, like an
object store): the marker goes up last, temporary names never go up, a remote artifact is whole only
when every listed file is there with its size, a half-done stage comes back down, hard links are
copied inside the bucket. The S3 path itself runs in tests/e2e/test_many_machines.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest

from eagle3.artifacts import MARKER, StageRecord, mark_complete, read_complete
from eagle3.storage import RemoteRoot, StorageError, is_url, open_root


@pytest.fixture
def url() -> str:
    return f"memory://eagle3-{uuid.uuid4().hex}"


def _artifact(root: Path, stage: str = "extract", fp: str = "f1") -> Path:
    folder = root / stage / fp
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "shard-00000.safetensors").write_bytes(b"a" * 100)
    (folder / "train" / "manifest.json").write_text("{}")
    mark_complete(folder, StageRecord(stage=stage, uri=str(folder), fingerprint=fp))
    (folder / "train" / ".shard-00001.safetensors.tmp-1-2").write_bytes(b"half")  # a writer's leftover, not listed
    return folder


def test_urls_and_local_paths():
    assert is_url("s3://b/p") and is_url("memory://x") and is_url("gs://b")
    assert not is_url("/srv/nfs/artifacts") and not is_url("runs/x") and not is_url("file:///srv/a") and not is_url(None)


def test_push_then_pull_on_another_machine(url, tmp_path):
    _artifact(tmp_path / "a")
    sent = RemoteRoot(url, tmp_path / "a")
    calls: list[str] = []
    real_put = sent.fs.put_file
    sent.fs.put_file = lambda src, dst, **kw: (calls.append(dst), real_put(src, dst, **kw))[1]  # order of the PUTs
    sent.push("extract", "f1")
    assert calls[-1].endswith(MARKER) and calls[-2].endswith("manifest.json")  # index after shards, marker last
    assert not any(".tmp-" in name for name in sent.fs.find(sent.base))  # a temporary name never goes up
    assert sent.leftovers() == []
    other = RemoteRoot(url, tmp_path / "b")
    assert other.is_whole("extract", "f1") and other.pull("extract", "f1")
    record = read_complete(tmp_path / "b" / "extract" / "f1")
    assert record is not None and record.uri == str(tmp_path / "b" / "extract" / "f1")
    assert (tmp_path / "b/extract/f1/train/shard-00000.safetensors").read_bytes() == b"a" * 100


def test_an_artifact_is_not_whole_without_its_marker_or_with_a_short_file(url, tmp_path):
    _artifact(tmp_path / "a")
    root = RemoteRoot(url, tmp_path / "a")
    root.upload_finished("extract", "f1")  # what following() does while the stage runs: no marker yet
    assert not root.is_whole("extract", "f1") and not RemoteRoot(url, tmp_path / "b").pull("extract", "f1")
    root.push("extract", "f1")
    root.fs.pipe_file(f"{root.remote_dir('extract', 'f1')}/train/shard-00000.safetensors", b"short")  # damaged in the bucket
    assert not root.is_whole("extract", "f1")
    assert not RemoteRoot(url, tmp_path / "c").pull("extract", "f1")
    root.push("extract", "f1")  # a push mends it
    assert root.is_whole("extract", "f1")


def test_a_half_done_stage_comes_back_down_and_is_not_sent_back(url, tmp_path):
    folder = tmp_path / "a" / "extract" / "f2" / "train"
    folder.mkdir(parents=True)
    (folder / "shard-00000.safetensors").write_bytes(b"s" * 50)
    (folder / "manifest.json").write_text(json.dumps({"shards": 1}))
    dying = RemoteRoot(url, tmp_path / "a")
    with dying.following("extract", "f2", every=0.05):
        pass  # the stage "ran": what it finished went up when the follower stopped
    dying.upload_finished("extract", "f2")
    taker = RemoteRoot(url, tmp_path / "b")
    assert taker.pull_partial("extract", "f2") == 2
    assert (tmp_path / "b/extract/f2/train/shard-00000.safetensors").read_bytes() == b"s" * 50
    assert taker.upload_finished("extract", "f2") == 0  # what came down is not uploaded again


def test_hard_links_are_copied_inside_the_bucket(url, tmp_path):
    _artifact(tmp_path / "a")
    root = RemoteRoot(url, tmp_path / "a")
    root.push("extract", "f1")
    mirror = RemoteRoot(url, tmp_path / "b")
    mirror.pull("extract", "f1")
    joined = tmp_path / "b" / "assemble" / "j1"
    joined.mkdir(parents=True)
    os.link(tmp_path / "b/extract/f1/train/shard-00000.safetensors", joined / "p0000-shard-00000.safetensors")
    mark_complete(joined, StageRecord(stage="assemble", uri=str(joined), fingerprint="j1"))
    sent: list[str] = []
    real_put = mirror.fs.put_file
    mirror.fs.put_file = lambda src, dst, **kw: (sent.append(dst), real_put(src, dst, **kw))[1]
    mirror.push("assemble", "j1")
    assert not any("p0000-shard" in name for name in sent)  # not sent through this machine: copied in the bucket
    assert mirror.is_whole("assemble", "j1")
    assert mirror.fs.cat_file(f"{mirror.remote_dir('assemble', 'j1')}/p0000-shard-00000.safetensors") == b"a" * 100


def test_a_new_file_on_the_inode_of_one_that_came_down_is_sent_with_its_own_bytes(url, tmp_path):
    """A part killed mid-extraction is resumed on another machine: its manifest comes down (pull_partial), the store
    rewrites it (the old inode is freed) and a new shard can get that inode number. The push must send the new
    shard's bytes, not copy the old manifest's object over it (CI once saw the resumed artifact "not whole" in the
    bucket). Simulated: the file that came down is renamed to the new shard's name and given other bytes."""
    folder = tmp_path / "a" / "extract" / "f3" / "train"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"shards": [None, None]}))
    RemoteRoot(url, tmp_path / "a").upload_finished("extract", "f3")  # the dying machine's partial upload
    taker = RemoteRoot(url, tmp_path / "b")
    assert taker.pull_partial("extract", "f3") == 1
    done = tmp_path / "b" / "extract" / "f3"
    os.replace(done / "train" / "manifest.json", done / "train" / "shard-00001.safetensors")  # same inode, new file
    (done / "train" / "shard-00001.safetensors").write_bytes(b"n" * 70)
    (done / "train" / "manifest.json").write_text(json.dumps({"shards": ["shard-00000", "shard-00001"]}))
    (done / "train" / "shard-00000.safetensors").write_bytes(b"o" * 60)
    mark_complete(done, StageRecord(stage="extract", uri=str(done), fingerprint="f3"))
    taker.push("extract", "f3")
    assert taker.is_whole("extract", "f3")
    assert taker.fs.cat_file(f"{taker.remote_dir('extract', 'f3')}/train/shard-00001.safetensors") == b"n" * 70


def test_a_bucket_that_cannot_be_written_is_named_with_the_setting(tmp_path):
    with pytest.raises(StorageError, match=r"artifact_root='nosuchproto://x': cannot open this URL"):
        open_root("nosuchproto://x", tmp_path)
    assert open_root(str(tmp_path / "local"), tmp_path) is None  # a local folder: used as it is, nothing to check
    # An S3 endpoint where nothing listens (a machine that cannot reach the bucket): refused, URL and setting named.
    env = os.environ | {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    code = ("from pathlib import Path\nfrom eagle3.storage import open_root\n"
            "open_root('s3://bucket/prefix', Path('unused'))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "StorageError: artifact_root='s3://bucket/prefix': the artifact root cannot be written" in done.stderr
    assert fsspec  # the module under test is fsspec's user
