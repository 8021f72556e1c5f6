"""`eagle3 nightly` on the tiny preset against a real Prefect server: day 1 (first draft promoted),
day 2 with new data (only its shards extracted) refused by the gate, refused on a data source
(the rows name two: "faq" and "chat"), then promoted."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest

from eagle3.artifacts import read_complete
from eagle3.data.conversations import DataConfig, load_conversations
from eagle3.ops.publish import PublishedDraft
from tests.e2e.conftest import run_cli

SMALL = ["pipeline.data.max_samples=14", "pipeline.regenerate.max_new_tokens=8", "pipeline.train.steps=6",
         "pipeline.train.warmup_steps=1", "pipeline.train.checkpoint_every=3", "pipeline.extract.samples_per_shard=4",
         "pipeline.eval.served=false"]


def _write_day(folder: Path, name: str, conversations) -> None:  # noqa: ANN001
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": c.id, "messages": [{"role": m.role, "content": m.content} for m in c.messages],
             "source": "faq" if i % 2 else "chat"} for i, c in enumerate(conversations)]
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _tree(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes() if path.is_file() else b"/")
    return digest.hexdigest()


def _shards(artifact: str) -> int:
    """Shards in an extract artifact (train + heldout), from its prepared sample counts."""
    stats = json.loads((Path(artifact) / ".eagle3-complete.json").read_text())["record"]["stats"]
    return sum(math.ceil(stats[f"{split}_samples"] / 4) for split in ("train", "heldout"))


@pytest.fixture(scope="module")
def nightly(tmp_path_factory, prefect_server, builtin_cache):
    root = tmp_path_factory.mktemp("nightly")
    env = os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(builtin_cache)}
    conversations = load_conversations(DataConfig(max_samples=28))
    _write_day(root / "incoming", "2026-01-01.jsonl", conversations[:14])
    _write_day(root / "incoming", "notes.jsonl", conversations[14:16])  # not dated: ignored

    def night(today: str, tolerance: float, max_source_regression: float = 10.0):  # noqa: ANN202
        args = ["nightly", "--preset", "tiny", "--incoming", str(root / "incoming"), "--registry", str(root / "registry"),
                "--run-dir", str(root / "run"), "--set", f"today={today}", "--set", f"publish.tolerance={tolerance}",
                "--set", f"publish.max_source_regression={max_source_regression}"]
        out = run_cli(args + [a for s in SMALL for a in ("--set", s)], env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return json.loads((root / "run" / "nightly.json").read_text()), out.stdout

    day1 = night("2026-01-01", 0.02)
    served_day1 = _tree(root / "registry")
    _write_day(root / "incoming", "2026-01-02.jsonl", conversations[14:28])  # arrives for night 2
    _write_day(root / "incoming", "2026-01-03.jsonl", conversations[:2])  # dated tomorrow: waits
    refused = night("2026-01-02", -10.0)  # must beat the served draft by 10: impossible (k = 3)
    served_after_refusal = _tree(root / "registry")
    by_source = night("2026-01-02", 10.0, -10.0)  # pooled passes; every source must improve by 10: impossible
    served_after_source_refusal = _tree(root / "registry")
    promoted = night("2026-01-02", 10.0)
    return {"root": root, "day1": day1, "refused": refused, "promoted": promoted, "by_source": by_source,
            "served_after_source_refusal": served_after_source_refusal,
            "served_day1": served_day1, "served_after_refusal": served_after_refusal}


def _current(root: Path) -> PublishedDraft:
    return PublishedDraft.model_validate_json((root / "registry" / "current.json").read_text())


def test_day1_promotes_the_first_draft(nightly):
    report, stdout = nightly["day1"]
    assert report["files"] == ["2026-01-01.jsonl"] and report["gate"]["promoted"]
    assert "gate: promoted" in stdout
    (part,) = report["parts"]
    assert part["extract"] == "Completed" and part["shards_extracted"] > 0
    registry = nightly["root"] / "registry"
    day1 = PublishedDraft.model_validate_json((registry / "drafts" / report["gate"]["draft_id"] / "metadata.json").read_text())
    assert day1.parent_draft is None and day1.data_files == ["2026-01-01"] and day1.acceptance_length >= 1.0
    assert day1.train_samples + day1.heldout_samples <= 14 and "+g" in day1.code_version
    assert set(day1.per_source) == {"faq", "chat"}  # the rows' sources, evaluated one by one


def test_day2_extracts_only_the_new_file_and_the_gate_refuses(nightly):
    report, stdout = nightly["refused"]
    day1_part, day2_part = report["parts"]
    assert report["files"] == ["2026-01-01.jsonl", "2026-01-02.jsonl"] and report["new_files"] == ["2026-01-02.jsonl"]
    assert (day1_part["extract"], day1_part["shards_extracted"]) == ("Cached", 0)
    summary = json.loads((nightly["root"] / "run" / "summary.json").read_text())
    day2_extract = next(r["artifact"] for r in summary["stages"] if r["name"] == "extract 2026-01-02")
    assert day2_part["extract"] == "Completed" and day2_part["shards_extracted"] == _shards(day2_extract) > 0
    assert not report["gate"]["promoted"] and "gate: not promoted" in stdout
    assert report["gate"]["served"] is not None  # the served draft was evaluated on the same held-out set
    assert nightly["served_after_refusal"] == nightly["served_day1"]  # the registry was not touched
    # Day 2 trained from the served draft's weights (the train stage names where it started).
    assert report["warm_start"] is True
    train = next(r for r in summary["stages"] if r["name"] == "train (warm)")
    init_from = read_complete(Path(train["artifact"])).stats["init_from"]
    day1_draft = nightly["root"] / "registry" / "drafts" / nightly["day1"][0]["gate"]["draft_id"]
    assert Path(str(init_from)).resolve() == day1_draft.resolve()


def test_day2_refused_on_a_data_source_names_it_and_both_figures(nightly):
    report, stdout = nightly["by_source"]
    gate = report["gate"]
    assert not gate["promoted"] and "gate: not promoted" in stdout
    assert set(gate["sources"]) == {"faq", "chat"}  # both drafts evaluated per source on the same held-out set
    worst = max(gate["sources"], key=lambda n: gate["sources"][n]["served"] - gate["sources"][n]["candidate"])
    figures = gate["sources"][worst]
    assert (f"Data source {worst!r}: candidate {figures['candidate']:.3f} < served {figures['served']:.3f} - "
            "publish.max_source_regression -10.000") in gate["reason"]
    assert nightly["served_after_source_refusal"] == nightly["served_day1"]  # the registry was not touched


def test_day2_promoted_when_the_gate_allows_with_nothing_extracted_again(nightly):
    report, _ = nightly["promoted"]
    assert report["gate"]["promoted"] and set(report["gate"]["sources"]) == {"faq", "chat"}
    assert [p["shards_extracted"] for p in report["parts"]] == [0, 0]
    current = _current(nightly["root"])
    assert current.parent_draft == nightly["day1"][0]["gate"]["draft_id"] and current.warm_start
    assert current.data_files == ["2026-01-01", "2026-01-02"] and current.draft_id == report["gate"]["draft_id"]
    assert (nightly["root"] / "registry" / "current").resolve() == Path(current.path).resolve()
    assert len(list((nightly["root"] / "registry" / "drafts").iterdir())) == 2
