"""docs/settings.md: every setting of a run, generated from the pydantic models so it cannot drift.

One table per section of PipelineConfig (and one for the nightly run's own NightlyConfig): the
setting's name as `--set` spells it, its type, its default, its description, and what changing it
recomputes. That last column is not written by hand: for each setting the stage fingerprints of a
run are computed (without running anything) with the default value and with another valid value,
and the first stage whose fingerprint moves is named (it and every stage after it recompute; the
stages before it come back Cached). A setting no fingerprint moves for ("nothing") changes how or
where the work runs, not what it produces.

    python -m eagle3.ops.settings_reference > docs/settings.md

tests/test_docs.py fails when the committed page differs from what this prints, so a field added
to a config model without regenerating the page fails the suite.
"""

from __future__ import annotations

import json
import tempfile
import types
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from eagle3 import draft_stages, stages
from eagle3.artifacts import StageRecord
from eagle3.config import PRESETS, PipelineConfig, merge_settings
from eagle3.data.conversations import SYNTHESIZE, DataConfig
from eagle3.ops.nightly import NightlyConfig

# The stages in the order a run reaches them: the first one whose fingerprint moves is the one named.
STAGE_ORDER = ("stage_target", "synthesize", "regenerate", "prepare_data", "extract", "vocab", "train", "export", "evaluate")
# Values to try where the type alone does not give a valid other value (a path must exist, a model must resolve).
_KNOWN_ALTERNATIVES: dict[str, list[object]] = {"target.model": ["builtin:tiny", "builtin:smollm2"],
                                                "train.rdzv_endpoint": ["node1.cluster:29400"],
                                                "regenerate.endpoint": ["http://127.0.0.1:8000"],
                                                "regenerate.api_key_env": ["VLLM_API_KEY"],
                                                "regenerate.chat_template_kwargs": [{"enable_thinking": True}],
                                                "target.devices": [[0]], "train.devices": [[0]],
                                                "eval.served_concurrency": [[1, 8]], "eval.served_k": [[1, 2]]}
# Settings with one valid value: nothing to compare.
_FIXED = {"target.pipeline_parallel_size"}
# Settings valid only beside others (the DFlash draft's): those are set with them when a value is tried.
_DFLASH = {"train.draft.method": "dflash", "train.draft.mask_token_id": 1}
_COMPANIONS: dict[str, dict[str, object]] = {
    f"train.draft.{name}": {k: v for k, v in _DFLASH.items() if k != f"train.draft.{name}"}
    for name in ("method", "block_size", "mask_token_id", "decay_gamma", "anchors_per_sample")}


def leaf_fields(model: type[BaseModel], prefix: str = "", skip: frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, FieldInfo]]:
    """('train.steps', its FieldInfo), ... for every setting that is not itself a section (nor in `skip`)."""
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from leaf_fields(info.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def stage_fingerprints(config: PipelineConfig) -> dict[str, str]:
    """Every cached stage's fingerprint for `config`, as the flow names them before running (no file is read
    but the target's and the data source's own, which the fingerprints hash)."""
    fps: dict[str, str] = {}

    def record(stage: str, fp: str, **stats: object) -> StageRecord:
        fps[stage] = fp
        return StageRecord(stage=stage, uri=f"/{stage}/{fp}", fingerprint=fp, stats=dict(stats))

    aux = config.target.aux_layer_ids or [2, 4, 5]  # the tiny target's default ids: only their identity matters here
    target = record("stage_target", stages.fingerprint_target(config.target), aux_layer_ids=json.dumps(aux))
    data = config.data
    if data.source == SYNTHESIZE:  # regenerate reads the synthesized file: a stand-in named by synthesize's fingerprint
        synthesized = record("synthesize", stages.fingerprint_synthesize(config.synthesize, config.regenerate, target))
        data = _synthesized_stand_in(data, synthesized.fingerprint, config.synthesize.prompts)
    regen = record("regenerate", stages.fingerprint_regenerate(config.regenerate, data, target,
                                                                config.target.max_model_len))
    prepared = record("prepare_data", stages.fingerprint_prepare(data, regen, target))
    extract = stages.online_extract_config(config.train.data, config.extract)  # as the flow runs it
    extracted = record("extract", stages.fingerprint_extract(extract, config.target, prepared, target))
    vocab = record("vocab", draft_stages.fingerprint_vocab(config.vocab, prepared))
    fps.update(draft_stages.chain_fingerprints(config.train, config.eval, target, extracted, vocab))
    return fps


_STAND_INS: list[Path] = []  # the folder of the synthesized stand-ins, made on first use


def _synthesized_stand_in(data: DataConfig, fp: str, prompts: int) -> DataConfig:
    """The data settings regenerate would get after a synthesize stage of fingerprint `fp`: a file whose content
    moves with `fp`, as the synthesized prompts do."""
    if not _STAND_INS:
        _STAND_INS.append(Path(tempfile.mkdtemp(prefix="eagle3-settings-reference-")))
    path = _STAND_INS[0] / fp / stages.SYNTHESIZED
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"id": "s000000", "messages": [{"role": "user", "content": fp},
                                                                 {"role": "assistant", "content": "-"}]}) + "\n")
    return stages.synthesized_data(data, StageRecord(stage="synthesize", uri=str(path.parent), fingerprint=fp), prompts)


def _alternatives(default: object, annotation: object) -> list[object]:
    """Other values of the type of a field whose default is `default`, most likely valid first."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return [a for a in args if a != default]
    if origin in (Union, types.UnionType):
        out: list[object] = [] if default is None or type(None) not in args else [None]
        for arg in (a for a in args if a is not type(None)):
            out += _alternatives(default if isinstance(default, arg if isinstance(arg, type) else object) else None, arg)
        return out
    if annotation is bool:
        return [not default]
    if annotation is int:
        base = default if isinstance(default, int) else 0
        return [v for v in (base + 1, base * 2, 1, 2, 8, 64) if v != default]
    if annotation is float:
        base = default if isinstance(default, float) else 0.0
        return [v for v in (base * 2, base + 0.1, 0.5, 0.05) if v != default]
    if annotation is str:
        return [f"{default}-other" if default else "other"]
    if origin is list:
        return [[0, 1, 3]] if args and args[0] is int else [["other"]]
    if annotation is date:
        return [date(2026, 1, 2)]
    return []


def _with(base: dict, path: str, value: object) -> dict:
    keys = path.split(".")
    override: dict = {keys[-1]: value}
    for key in reversed(keys[:-1]):
        override = {key: override}
    return merge_settings(base, override)


def _value_at(config: BaseModel, path: str) -> object:
    for key in path.split("."):
        config = getattr(config, key)
    return config


def _baselines() -> list[dict]:
    """Runs to compare against: the tiny preset (with an absolute artifact_root, which extract.parts > 1 needs),
    the same with extract.too_long=truncate (which stores up to target.max_model_len), with what
    train.nnodes > 1 needs beside it (a rendezvous endpoint and a grad_accum that splits over the machines), and
    train.data=hybrid with its extract.store_budget_gib, and data.source=synthesize (the synthesize settings)."""
    tiny = merge_settings(PRESETS["tiny"], {"artifact_root": "/srv/eagle3-artifacts"})
    return [tiny, _with(tiny, "extract.too_long", "truncate"),
            merge_settings(tiny, {"train": {"rdzv_endpoint": "node0.cluster:29400", "grad_accum": 8}}),
            merge_settings(tiny, {"train": {"data": "hybrid"}, "extract": {"store_budget_gib": 1.0}}),
            _with(tiny, "data.source", SYNTHESIZE)]


def first_rerun(path: str, info: FieldInfo, known: dict[str, list[object]]) -> tuple[str | None, str | None]:
    """The first stage (in STAGE_ORDER) whose fingerprint moves when `path` changes (None for none): in the runs that
    read their data, and in the run with data.source=synthesize (the second). `known`: values to try for the settings
    whose type alone gives no valid other value."""
    if path in _FIXED:
        return None, None
    moved: dict[bool, set[str]] = {False: set(), True: set()}
    compared = False
    for base in _baselines():
        config = PipelineConfig.model_validate(base)
        before = stage_fingerprints(config)
        current = _value_at(config, path)
        for value in [v for v in known.get(path, []) if v != current] or _alternatives(current, info.annotation):
            try:
                changed = _with(base, path, value)
                for companion, companion_value in _COMPANIONS.get(path, {}).items():
                    changed = _with(changed, companion, companion_value)
                after = stage_fingerprints(PipelineConfig.model_validate(changed))
            except (ValidationError, ValueError, OSError):
                continue  # not a valid value here: try the next one
            compared = True
            moved[config.data.source == SYNTHESIZE] |= {stage for stage, fp in after.items() if before.get(stage) != fp}
    if not compared:
        raise ValueError(f"settings reference: no other valid value found for {path}; add one to _KNOWN_ALTERNATIVES "
                         "(or to _FIXED when it has only one)")
    plain, synthesized = (next((stage for stage in STAGE_ORDER if stage in moved[s]), None) for s in (False, True))
    return plain, synthesized


def _type_name(annotation: object) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "null"
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _rerun_cell(plain: str | None, synthesized: str | None) -> str:
    """`plain` (see first_rerun), and where data.source=synthesize recomputes from an earlier stage, that too."""
    cell = "nothing" if plain is None else f"`{plain}` on"
    if synthesized is not None and plain is not None and STAGE_ORDER.index(synthesized) < STAGE_ORDER.index(plain):
        cell += f" (`{synthesized}` on with data.source synthesize)"
    return cell if plain is not None or synthesized is None else f"`{synthesized}` on"


def _section_tables(model: type[BaseModel], known: dict[str, list[object]] | None,
                    skip: frozenset[str] = frozenset()) -> list[str]:
    """One `##` table per section of `model`, top-level settings first; with the recompute column unless
    `known` (see first_rerun) is None."""
    with_reruns = known is not None
    sections: dict[str, list[str]] = {}
    for path, info in leaf_fields(model, skip=skip):
        section = path.split(".")[0] if "." in path else ""
        row = [f"`{path}`", _type_name(info.annotation), _default(info), _cell(info.description)]
        if with_reruns:
            row.append(_rerun_cell(*first_rerun(path, info, known)))
        sections.setdefault(section, []).append("| " + " | ".join(row) + " |")
    head = "| setting | type | default | what it is |" + (" changing it recomputes |" if with_reruns else "")
    rule = "|---|---|---|---|" + ("---|" if with_reruns else "")
    lines: list[str] = []
    for section, rows in sections.items():
        title = f"`{section}`" if section else ("The run" if with_reruns else "The nightly run")
        described = model.model_fields[section].description if section else model.__doc__
        lines += [f"## {title}", "", f"{_cell(described).rstrip('.')}.", "", head, rule, *rows, ""]
    return lines


def markdown() -> str:
    """The whole page."""
    with tempfile.TemporaryDirectory() as tmp:  # another data.source: a JSONL file of one conversation
        chats = Path(tmp) / "chats.jsonl"
        chats.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": "Hello"}]}) + "\n")
        pipeline = _section_tables(PipelineConfig, {**_KNOWN_ALTERNATIVES, "data.source": [str(chats)]})
    lines = [
        "# Settings reference",
        "",
        "Every setting of `eagle3 run` (a PipelineConfig), generated from the code by",
        "`python -m eagle3.ops.settings_reference > docs/settings.md`; `make test` fails when this page and the",
        "code differ. Set them in a YAML file with one section per stage (`train: {steps: 100}`), with",
        "`--set train.steps=100` on the command line, or in the Prefect UI's run form, which shows the same",
        "descriptions (see [your own target](your-target.md)). Unknown settings and wrong types are refused",
        "before any work ([troubleshooting](troubleshooting.md)).",
        "",
        "**Changing it recomputes** names the first stage whose fingerprint moves when the setting changes",
        "(found by computing the run's fingerprints with the default and with another value): that stage and",
        "every stage after it run again, the ones before it come back `Cached`. \"nothing\": the setting changes",
        "how or where the work runs, not what it produces, and every artifact is reused.",
        "",
        *pipeline,
        "# The nightly run's own settings",
        "",
        "`eagle3 nightly` and the `nightly-eagle3` deployment take a NightlyConfig: `pipeline` is a whole",
        "PipelineConfig (the tables above, as `pipeline.train.steps`), and these are its other settings",
        "(see [the nightly run](prefect.md)).",
        "",
        *_section_tables(NightlyConfig, None, skip=frozenset({"pipeline"})),
    ]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
