"""The draft registry: where the served draft lives, and the gate that decides what replaces it.

A registry is a folder (or an fsspec URL):

    drafts/<draft_id>/     one folder per promoted draft, never changed once written: the
                           exported draft (config.json + model.safetensors, what vLLM loads),
                           vocab.safetensors (its d2t/t2d, for warm starts) and metadata.json
    current.json           the served draft: its metadata plus "path"; written last, atomically
    current                (local registries) a symlink to drafts/<draft_id>, swapped atomically:
                           `vllm serve ... --speculative-config '{"model": "<registry>/current"}'`

Publishing copies the draft into drafts/ under a temporary name, renames it into place,
then replaces current.json and the symlink. A reader sees the old draft or the new one,
never a half-copied folder. The gate promotes a candidate only when

    candidate acceptance >= published acceptance - tolerance

and, when the held-out samples name data sources (eagle3.data.conversations), on every source

    candidate acceptance on the source >= published acceptance on it - max_source_regression

all measured on the same held-out set (the flow evaluates both drafts on it; simulated
acceptance length). A served draft whose evaluation has no per-source figures (one evaluated
before they existed, or a held-out set that names no source) is gated on the pooled figure
alone, and the reason says so. The first draft is always promoted. A refused candidate leaves
the registry untouched.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from pydantic import BaseModel, ConfigDict, Field

from eagle3.artifacts import StageRecord, atomic_write_text, fsync_tree

CURRENT = "current.json"
CURRENT_LINK = "current"
METADATA = "metadata.json"
VOCAB = "vocab.safetensors"


class RegistryError(RuntimeError):
    """The registry cannot be read or written; the message names the location."""


class PublishConfig(BaseModel):
    """Where promoted drafts go, and how much worse than the served one a candidate may be."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    registry: str = Field(default="registry", description="Registry folder or fsspec URL: drafts/<id>/, current.json, current")
    tolerance: float = Field(
        default=0.02, ge=-10.0, le=10.0,
        description="Promote when candidate acceptance >= served acceptance - tolerance (same held-out set); "
        "negative: the candidate must be better by at least -tolerance",
    )
    # 0.1: a source holds a share of the held-out set, so its figure rests on fewer drafts and moves more from night to
    # night than the pooled one (a draft's accepted count spreads over 0..k, about 1 token of standard deviation at
    # k=3: over 100 drafts the mean moves by about 0.1). Five times the pooled tolerance lets that noise through while
    # a draft that gets one kind of request clearly worse (a tenth of a token per draft, 3-5% of a typical 2-3) is kept out.
    max_source_regression: float = Field(
        default=0.1, ge=-10.0, le=10.0,
        description="Also refuse a candidate whose acceptance on ANY data source (the samples' 'source', see data.source) "
        "is below the served draft's on that source minus this (same held-out set). 0.1 (five times the pooled "
        "tolerance): a source's figure rests on fewer drafts and is noisier, while a tenth of a token per draft on "
        "one kind of request is a loss users notice; negative: every source must improve by at least -value",
    )


class PublishedDraft(BaseModel):
    """metadata.json of a registry draft (and the body of current.json, plus `path`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    draft_id: str = Field(  # a plain folder name: a registry's current.json cannot point a path outside it
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Folder name under drafts/: the export fingerprint's first 16 characters")
    acceptance_length: float = Field(description="Simulated acceptance length on the held-out set of its run")
    per_position: list[float] = Field(default_factory=list, description="Accepted share per draft position")
    per_source: dict[str, float] = Field(
        default_factory=dict, description="Simulated acceptance length per data source on the held-out set of its run "
        "(empty: its samples named no source, or it was published before per-source figures)")
    heldout_samples: int = Field(description="Held-out samples it was evaluated on")
    train_samples: int = Field(description="Samples it was trained on")
    train_tokens: int = Field(description="Tokens it was trained on")
    data_files: list[str] = Field(default_factory=list, description="Dated conversation files of its training data")
    parent_draft: str | None = Field(default=None, description="draft_id of the draft served before it (None: the first)")
    warm_start: bool = Field(default=False, description="Training started from the parent's weights")
    export_fingerprint: str = Field(description="Fingerprint of the export artifact it was copied from")
    code_version: str = Field(description="eagle3-pipeline version and git commit of the code that trained it")
    created_at: str = Field(description="UTC time of publication, ISO 8601")
    path: str | None = Field(default=None, description="current.json only: the draft's folder")


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    candidate: float
    published: float | None
    tolerance: float
    reason: str
    # data source -> (candidate, served) acceptance on it; empty when the gate did not compare sources
    sources: dict[str, tuple[float, float]] = field(default_factory=dict)
    max_source_regression: float | None = None

    def to_markdown(self) -> str:
        verdict = "**Promoted**" if self.promote else "**Not promoted**: the served draft is unchanged"
        served = "none" if self.published is None else f"{self.published:.3f}"
        text = (f"{verdict}. {self.reason}\n\n| | acceptance length |\n|---|---:|\n| candidate | {self.candidate:.3f} |\n"
                f"| served (same held-out set) | {served} |\n| tolerance | {self.tolerance:.3f} |")
        if self.sources and self.max_source_regression is not None:
            bar = self.max_source_regression
            rows = [f"| {name} | {c:.3f} | {p:.3f} | {c - p:+.3f} | {'**worse**' if c < p - bar else 'ok'} |"
                    for name, (c, p) in self.sources.items()]
            text += (f"\n\nPer data source (publish.max_source_regression {self.max_source_regression:.3f}):\n\n"
                     "| data source | candidate | served | change | gate |\n|---|---:|---:|---:|---|\n" + "\n".join(rows))
        return text


def decide(candidate: float, published: float | None, tolerance: float, *,
           candidate_sources: dict[str, float] | None = None, published_sources: dict[str, float] | None = None,
           max_source_regression: float = 0.1) -> GateDecision:
    """The promotion gate: candidate >= published - tolerance, and on every data source both drafts were measured on,
    candidate >= published - max_source_regression (module docstring); the first draft always passes."""
    if published is None:
        return GateDecision(True, candidate, None, tolerance, "No draft is served yet: the first one is promoted.")
    bar = published - tolerance
    pooled = f"served {published:.3f} - tolerance {tolerance:.3f} = {bar:.3f}"
    if candidate < bar:
        return GateDecision(False, candidate, published, tolerance, f"Candidate {candidate:.3f} < {pooled}.")
    reason = f"Candidate {candidate:.3f} >= {pooled}."
    if not candidate_sources:
        return GateDecision(True, candidate, published, tolerance, reason)
    if not published_sources:
        return GateDecision(True, candidate, published, tolerance, reason + (
            " The served draft has no per-source figures on this held-out set (evaluated before per-source "
            f"figures existed), so the candidate's {len(candidate_sources)} data sources were not compared: gated on "
            "the pooled figure alone."))
    both = {name: (value, published_sources[name]) for name, value in candidate_sources.items() if name in published_sources}
    worse = sorted(((p - c, name) for name, (c, p) in both.items() if c < p - max_source_regression), reverse=True)
    if worse:
        named = "; ".join(f"Data source {name!r}: candidate {both[name][0]:.3f} < served {both[name][1]:.3f} - "
                          f"publish.max_source_regression {max_source_regression:.3f} = "
                          f"{both[name][1] - max_source_regression:.3f}" for _, name in worse)
        return GateDecision(False, candidate, published, tolerance, f"{named} (pooled: {reason[:-1].lower()}).",
                            both, max_source_regression)
    return GateDecision(True, candidate, published, tolerance, reason + (
        f" On each of the {len(both)} data sources the candidate is within publish.max_source_regression "
        f"{max_source_regression:.3f} of the served draft (worst change "
        f"{min(c - p for c, p in both.values()):+.3f})."), both, max_source_regression)


def source_figures(stats: dict[str, object]) -> dict[str, float]:
    """An evaluate record's simulated acceptance per data source (empty: none, e.g. evaluated before they existed)."""
    raw = stats.get("per_source")
    return {} if not raw else {name: float(block["acceptance_length"]) for name, block in json.loads(str(raw)).items()}


def code_version() -> str:
    """'<package version>+g<commit>' (the commit when the code runs from a git checkout)."""
    try:
        version = importlib.metadata.version("eagle3-pipeline")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    dirty = ""
    if commit:
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=False).stdout
        dirty = ".dirty" if status.strip() else ""
    return f"{version}+g{commit}{dirty}" if commit else version


def _fs(location: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(location)
    return fs, path.rstrip("/")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def read_current(registry: str) -> PublishedDraft | None:
    """The served draft's metadata (with `path`), or None when nothing was published yet."""
    fs, root = _fs(registry)
    path = f"{root}/{CURRENT}"
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "r") as handle:
            return PublishedDraft.model_validate_json(handle.read())
    except ValueError as err:
        raise RegistryError(f"{registry}/{CURRENT} is not a published draft's metadata ({err}); fix or remove it") from err


def fetch_draft(current: PublishedDraft, registry: str, cache_dir: Path) -> Path:
    """A local folder with the served draft: the registry folder itself when local, else a copy under cache_dir."""
    fs, _ = _fs(registry)
    if current.path is None:
        raise RegistryError(f"{registry}/{CURRENT} has no 'path'; publish again")
    if _is_local(fs):
        return Path(current.path)
    local = Path(cache_dir) / "registry" / current.draft_id
    if not (local / METADATA).is_file():
        tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        fs.get(current.path, str(tmp), recursive=True)
        os.replace(tmp, local)
    return local


def _stage_locally(export_dir: Path, vocab_file: Path, metadata: PublishedDraft, tmp: Path) -> None:
    shutil.copytree(export_dir, tmp, ignore=shutil.ignore_patterns(".eagle3-complete.json", ".*"))
    shutil.copyfile(vocab_file, tmp / VOCAB)
    (tmp / METADATA).write_text(metadata.model_dump_json(indent=1, exclude={"path"}))
    fsync_tree(tmp)


def publish(export_dir: Path, vocab_file: Path, metadata: PublishedDraft, registry: str) -> PublishedDraft:
    """Copy the draft into drafts/<id>/ atomically, then make it the served one; returns current.json's content."""
    fs, root = _fs(registry)
    final = f"{root}/drafts/{metadata.draft_id}"
    served = metadata.model_copy(update={"path": final})
    if _is_local(fs):
        Path(final).parent.mkdir(parents=True, exist_ok=True)
        if not (Path(final) / METADATA).is_file():
            tmp = Path(final).with_name(f".{metadata.draft_id}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            _stage_locally(Path(export_dir), Path(vocab_file), metadata, tmp)
            shutil.rmtree(final, ignore_errors=True)  # a folder without metadata.json is a half-copy of a crash
            os.replace(tmp, final)
        atomic_write_text(Path(root) / CURRENT, served.model_dump_json(indent=1))
        link = Path(root) / CURRENT_LINK
        tmp_link = Path(root) / f".{CURRENT_LINK}.tmp-{os.getpid()}"
        tmp_link.unlink(missing_ok=True)
        os.symlink(Path("drafts") / metadata.draft_id, tmp_link)
        os.replace(tmp_link, link)
        return served
    if not fs.exists(f"{final}/{METADATA}"):
        staging = Path(os.environ.get("TMPDIR", "/tmp")) / f"eagle3-publish-{metadata.draft_id}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        _stage_locally(Path(export_dir), Path(vocab_file), metadata, staging)
        tmp = f"{root}/drafts/.{metadata.draft_id}.tmp-{os.getpid()}"
        fs.put(str(staging), tmp, recursive=True)
        fs.mv(tmp, final, recursive=True)
        shutil.rmtree(staging, ignore_errors=True)
    with fs.open(f"{root}/{CURRENT}", "w") as handle:  # the commit point on object stores
        handle.write(served.model_dump_json(indent=1))
    return served


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_parent_vocab(draft_dir: Path, draft_id: str, root: Path, fp: str) -> StageRecord:
    """The served draft's vocabulary as a vocab artifact (a warm start keeps the draft's d2t/t2d)."""
    from eagle3.artifacts import building, mark_complete
    from eagle3.stages import _done

    final, done = _done(root, "vocab", fp)
    if done:
        return done
    source = Path(draft_dir) / VOCAB
    if not source.is_file():
        raise RegistryError(f"registry draft {draft_dir} has no {VOCAB}; set warm_start=false or publish a draft again")
    with building(final) as tmp:
        shutil.copyfile(source, tmp / VOCAB)
        return mark_complete(tmp, StageRecord(stage="vocab", uri=str(final), fingerprint=fp, stats={"from_draft": draft_id}))
