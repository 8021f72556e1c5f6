"""Settings of the train stage (TrainConfig), the errors it refuses with, and its learning-rate schedule.

Kept apart from the trainer (eagle3.train.trainer) so that the configuration, the UI form and the
checks before any work read the settings without the training code.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3.train import ddp
from eagle3.draft.architecture import DraftSettings
from eagle3.gpu.devices import Devices, check_devices

# Settings that may change between an interrupted run and its resume.
_RESUMABLE_CHANGES = {"data", "steps", "checkpoint_every", "num_draft_tokens_eval", "deterministic", "loader_threads", "compile",
                      "param_dtype", "num_processes", "nnodes", "rdzv_endpoint", "rdzv_join_timeout", "select",
                      "devices"}
# Settings added after train artifacts were first cached: at this default they stay out of the train fingerprint,
# so an upgrade does not retrain drafts whose settings did not change.
ADDED_WITH_DEFAULT = {"optimizer": "adamw", "tokens_per_step": "auto", "select": "best", "ttt_loss_decay": 1.0,
                      "feature_noise": 0.0}
# train.tokens_per_step='auto' on CUDA: tokens per optimizer step (8 micro-batches of 2,048 tokens)
AUTO_TOKENS_PER_STEP_CUDA = 16_384
# train.draft counts as the architecture it resolves to (eagle3.draft.architecture.resolve: the trainer's meta and
# fingerprint_train hold it resolved); every run before the setting trained the Llama-style draft.
ADDED_WITH_DEFAULT["draft"] = DraftSettings(architecture="llama").fingerprint_view()
# Settings that change how fast (or where) training runs, not what it learns: left out of the train fingerprint.
# train.data is one of them: online and hybrid give the store run's losses (within 1e-5, tests/eagle3/test_online.py),
# so the three name one train artifact.
RUNTIME_ONLY = {"data", "compile", "param_dtype", "num_processes", "nnodes", "rdzv_endpoint", "rdzv_join_timeout",
                "devices"}


class TrainError(RuntimeError):
    """Training cannot start or resume; the message names the setting or file."""


class TrainConfig(BaseModel):
    """Settings of the train stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=2000, gt=0, description="Optimizer steps to train for in total (resumes count).")
    learning_rate: float = Field(default=1e-4, gt=0, description="Peak learning rate, reached after warm-up (with "
                                 "'muon', Muon's is matched to AdamW's update size, so the same value serves both).")
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw", description="'adamw', or 'muon': torch's Muon on the draft's hidden matrices (weight decay "
        "0.1) and AdamW on lm_head and the norms, as speculators trains (eagle3.train.optim)."
    )
    select: Literal["best", "last"] = Field(
        default="best", description="The checkpoint the export takes: 'best', the one with the highest walk on the "
        "held-out split (the simulated acceptance at the positions a served greedy run drafts at, within 0.03 of "
        "vLLM's served figure wherever both ran; acceptance can peak mid-training, or fall on a bad step), or "
        "'last'. Every checkpoint is scored either way (evals.jsonl); with no held-out split, the last."
    )
    draft: DraftSettings = Field(
        default_factory=DraftSettings, description="The draft's architecture and, for the MLA draft, its shapes "
        "(train.draft.architecture: auto | llama | deepseek_mla; eagle3.draft.architecture)."
    )
    data: Literal["store", "online", "hybrid"] = Field(
        default="store", description="Where the trainer's hidden states come from: 'store' (the extract stage stores "
        "every sample's states first), 'online' (the target engine stays loaded through training and captures each "
        "micro-batch just ahead of the trainer into a bounded buffer, online.buffer_gib; a shard is deleted once read; "
        "every epoch captures again), or 'hybrid' (the first samples whose states fit extract.store_budget_gib are "
        "stored, the rest captured online each epoch). The same losses in all three (docs/online-training.md); not "
        "part of the stage's fingerprint."
    )
    warmup_steps: int = Field(default=50, ge=0, description="Steps of linear warm-up from 0 to learning_rate.")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Cosine decay ends at learning_rate * min_lr_ratio at the last step."
    )
    weight_decay: float = Field(
        default=0.0, ge=0, description="AdamW weight decay on matrices (never on norms; with 'muon', on lm_head only)."
    )
    batch_tokens: int = Field(
        default=2048, gt=0, description="Tokens per micro-batch: whole samples are packed up to this many "
        "(a longer sample is cut to this length)."
    )
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches whose gradients add up to one step.")
    tokens_per_step: int | Literal["auto"] = Field(
        default="auto", description="Tokens one optimizer step trains at least: train.grad_accum becomes the number "
        "of train.batch_tokens micro-batches that reach it, rounded up to a multiple of the training processes. "
        f"'auto': {AUTO_TOKENS_PER_STEP_CUDA:,} on CUDA (steps of one 2,048-token micro-batch leave a GPU waiting on "
        "the optimizer, Muon's the longest), and train.grad_accum as set on the CPU. An explicit train.grad_accum "
        "above 1 wins over 'auto'; a number here needs train.grad_accum left at 1. Part of the stage's fingerprint "
        "as written: 'auto' resolves on the machine that trains, as train.dtype does, so every machine names the "
        "same artifact."
    )
    ttt_steps: int = Field(default=3, ge=1, description="TTT unroll depth: draft tokens trained per position.")
    ttt_loss_decay: float = Field(
        default=1.0, gt=0, le=1, description="Weight of the loss of draft position k (k = 0 for the first draft "
        "token) relative to the first: decay**k, the weights normalized to sum to one. 1.0 (default): every TTT step "
        "counts the same, as EAGLE-3 trains. Below 1 the first draft tokens count more: a served draft's later "
        "tokens are only accepted after the earlier ones (benchmarks/quality.py --ttt-loss-decay measures it)."
    )
    feature_noise: float = Field(
        default=0.0, ge=0, le=1, description="Data augmentation: while training, Gaussian noise is added to the "
        "target's hidden states the draft reads, its standard deviation this share of each state's RMS (0.1: a "
        "tenth). Seeded by train.seed, the step and the micro-batch, so a resumed run and a data-parallel one see "
        "the noise a straight run sees; held-out scoring reads the states as captured. 0 (default): none. EAGLE's "
        "first trainer added noise to its features for robustness (benchmarks/quality.py --feature-noise measures "
        "it)."
    )
    checkpoint_every: int = Field(
        default=200, ge=1, description="Write a checkpoint every this many steps (and at the end)."
    )
    seed: int = Field(default=0, description="Seeds the draft's initial weights and the data order.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Compute dtype: 'auto' is bfloat16 autocast on CUDA, float32 on the CPU."
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradients are clipped to this global norm.")
    num_draft_tokens_eval: int = Field(
        default=3, ge=1, description="Draft tokens per draft when checkpoints are evaluated for acceptance."
    )
    deterministic: bool | None = Field(
        default=None, description="torch deterministic algorithms; None: on for the CPU (bitwise resume), off on "
        "CUDA (deterministic attention backward is slower)."
    )
    loader_threads: int = Field(
        default=2, ge=1, description="Threads that read and pack upcoming micro-batches while the device computes."
    )
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Dtype of the draft's weights in the forward and backward pass. bfloat16 keeps "
        "an fp32 master copy that the optimizer updates and checkpoints hold (mixed precision without casts; "
        "faster on GPUs). 'auto': bfloat16 when the compute dtype is bfloat16, else float32. Not part of the "
        "stage's fingerprint."
    )
    compile: bool | None = Field(
        default=None, description="torch.compile the draft's TTT step and the loss kernels (about a minute of "
        "compiling, then faster: 55,300 against 45,400 tokens/s on an H200, benchmarks/train_throughput.py; results "
        "equal eager up to rounding). None: on for CUDA, off on the CPU. Not part of the stage's fingerprint."
    )

    num_processes: int | Literal["auto"] = Field(
        default="auto", description="Processes that train data-parallel, one per GPU, launched with torchrun "
        "(eagle3.train.launch). 'auto': every visible GPU, 1 on the CPU. Must divide train.grad_accum (each process "
        "takes every n-th micro-batch of a step, so the result does not depend on it). A run may resume with another "
        "number. Not part of the stage's fingerprint."
    )
    devices: Devices = Field(
        default="auto", description="GPUs of the trainer, as CUDA_VISIBLE_DEVICES of this process names them (e.g. "
        "[2]): one training process trains on the first; train.num_processes processes are launched on as many (store "
        "mode; online/hybrid train in one process, on one GPU, disjoint from target.devices). Refused on the CPU build "
        "and when a GPU is not visible. 'auto': torch's default GPU (every visible GPU for train.num_processes='auto'). "
        "Not part of the stage's fingerprint."
    )
    nnodes: int = Field(
        default=1, ge=1, description="Machines that train together, each running train.num_processes ranks (torchrun "
        "with a c10d rendezvous). Node 0 is the machine that runs the train stage; each other machine joins with "
        "`eagle3 train-node --spec SPEC --node-rank R`, the command the stage prints, and must see the artifacts "
        "folder at the same path (a shared folder). train.nnodes x train.num_processes must divide train.grad_accum. "
        "A run may resume with another number. Not part of the stage's fingerprint."
    )
    rdzv_endpoint: str | None = Field(
        default=None, description="'host:port' of the c10d rendezvous when train.nnodes > 1 (required then): an "
        "address of node 0 (the machine that runs the train stage, which hosts the rendezvous) that the other "
        "machines reach, and a free TCP port there, e.g. 'node0.cluster:29400'. Not part of the stage's fingerprint."
    )
    rdzv_join_timeout: int = Field(
        default=600, ge=1, description="Seconds node 0 waits for the other train.nnodes - 1 machines to join the "
        "rendezvous before the stage fails. Not part of the stage's fingerprint."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        check_devices(self.devices, "train.devices")
        if self.draft.method == "dflash" and not (self.num_processes in (1, "auto") and self.nnodes == 1):
            raise ValueError(f"train.draft.method is 'dflash', which trains in one process so far, but "
                             f"train.num_processes={self.num_processes!r} and train.nnodes={self.nnodes} ask for more; "
                             "set train.num_processes: 1 and train.nnodes: 1 (docs/dflash.md)")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) must be below train.steps ({self.steps})")
        if isinstance(self.tokens_per_step, int) and self.tokens_per_step < 1:
            raise ValueError(f"train.tokens_per_step is {self.tokens_per_step}; expected a number of tokens >= 1 or "
                             "'auto'")
        if isinstance(self.tokens_per_step, int) and self.grad_accum > 1:
            raise ValueError(f"train.tokens_per_step ({self.tokens_per_step}) and train.grad_accum ({self.grad_accum}) "
                             "both set the micro-batches of a step; set one of them (train.grad_accum=1, or "
                             "train.tokens_per_step='auto')")
        if isinstance(self.num_processes, int) and self.num_processes < 1:
            raise ValueError(f"train.num_processes is {self.num_processes}; expected a number >= 1 or 'auto'")
        if self.nnodes > 1 or self.rdzv_endpoint is not None:
            ddp.check_rdzv_endpoint(self.rdzv_endpoint, self.nnodes)
        if isinstance(self.num_processes, int) and self.grad_accum % (self.nnodes * self.num_processes):
            ranks = self.nnodes * self.num_processes
            raise ValueError(f"train.grad_accum ({self.grad_accum}) does not split over train.num_processes "
                             f"({self.num_processes}) x train.nnodes ({self.nnodes}) = {ranks} ranks; set "
                             f"train.grad_accum to a multiple of {ranks}")
        if self.num_processes == "auto" and self.grad_accum % self.nnodes:
            raise ValueError(f"train.grad_accum ({self.grad_accum}) does not split over train.nnodes ({self.nnodes}) "
                             "machines of train.num_processes='auto' ranks each; set train.grad_accum to a multiple of "
                             "train.nnodes x the ranks per machine")
        return self


def effective_grad_accum(config: TrainConfig, cuda: bool, ranks: int = 1) -> int:
    """Micro-batches per optimizer step on this device (`cuda`) with `ranks` training processes in all:
    train.grad_accum, or what train.tokens_per_step asks for (see its description)."""
    auto = config.tokens_per_step == "auto"
    if auto and (not cuda or config.grad_accum > 1):
        return config.grad_accum
    tokens = AUTO_TOKENS_PER_STEP_CUDA if auto else int(config.tokens_per_step)
    micro_batches = math.ceil(tokens / config.batch_tokens)
    return math.ceil(micro_batches / ranks) * ranks


def with_effective_grad_accum(config: TrainConfig, cuda: bool, ranks: int = 1) -> TrainConfig:
    """`config` with train.grad_accum as this device trains it (effective_grad_accum); not re-validated, so a
    number in train.tokens_per_step may stand beside the grad_accum it gives."""
    return config.model_copy(update={"grad_accum": effective_grad_accum(config, cuda, ranks)})


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine decay."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.learning_rate * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)
