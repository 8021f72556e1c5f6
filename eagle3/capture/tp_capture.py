"""Capture with tensor parallelism: the capture lives in every vLLM worker process.

With `target.tensor_parallel_size` > 1 vLLM runs the model in TP worker processes (its "mp"
executor), out of this process's reach. `TensorParallelVllmSource` drives the same
HiddenStateCapture (eagle3.capture.hooks) inside each worker through `llm.collective_rpc`,
which runs a function in every worker and returns the list of results in rank order:

    install   each worker resolves its decoder stack and installs the capture, with the row map
              of its own model runner (`vllm_adapter.runner_row_source`);
    open      each worker opens a `collecting()` block for the prompts of this batch: rank 0
              writes its rows straight into a file in shared memory (/dev/shm) that the driver
              named, the other ranks allocate nothing (their hooks copy nothing);
    prefill   the driver runs the batch (vllm_adapter.prefill), every rank the same forward;
    close     each worker closes the block (rank 0 checks every position was captured once) and
              says whether it wrote the file; the driver maps the file, unlinks it, and hands the
              states on as views of that memory.

So the states cross from rank 0 to the driver without being pickled or copied: the hooks'
row copies land in pages the driver then maps (the RPC carries only the prompts and a path).
A killed driver leaves at most one batch's file, removed by the next capture whose install
finds its driver pid gone. Why collective_rpc and not a `worker_extension_cls`: the capture
needs no state at engine start, the functions are plain module functions any vLLM with
collective_rpc can run, and nothing of ours has to be named when the engine is created. Each
call needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (functions travel by reference to this module),
which the adapter sets for TP engines. The driver and the workers are on one host (vLLM's mp
executor), so they share /dev/shm.

Images (`capture_images`): the driver's vLLM processor expands each prompt's placeholders (the ids every
rank runs, which `open` is given), and the prefill carries the images, which vLLM's executor sends to its
workers with the batch as it does for any multimodal request.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3.artifacts import pid_alive

# Per worker process: the capture installed by `_install`, and the open `collecting()` block.
_ACTIVE: dict[str, object] = {}


def _install(worker, layer_ids: list[int]) -> int:  # noqa: ANN001 - a vLLM worker
    from eagle3.capture import vllm_adapter
    from eagle3.capture.hooks import HiddenStateCapture
    from eagle3.capture.layers import resolve_decoder_stack

    _remove(worker)
    runner = worker.model_runner
    capture = HiddenStateCapture(resolve_decoder_stack(runner.get_model()), layer_ids,
                                 row_source=vllm_adapter.runner_row_source(runner))
    capture.install()
    _ACTIVE["capture"] = capture
    return capture.rank()


SHM_PREFIX = "eagle3-tp-states-"  # + driver pid + batch number
_BATCHES = itertools.count()


def shm_dir() -> Path:
    """Where rank 0 and the driver share a batch's states: /dev/shm (memory), else the temp folder."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def _open(worker, prompts: list[list[int]], hidden_size: int, path: str) -> None:  # noqa: ANN001
    capture = _ACTIVE["capture"]
    buffer = None
    if capture.rank() == 0:  # the states land in the driver's file: nothing to pickle at close
        numel = sum(len(p) for p in prompts) * len(capture.layer_ids) * hidden_size
        buffer = torch.from_file(path, shared=True, size=numel, dtype=capture.dtype)
    block = capture.collecting(prompts, hidden_size, buffer=buffer)
    _ACTIVE["block"], _ACTIVE["states"] = block, block.__enter__()


def _close(worker, failed: bool) -> bool:  # noqa: ANN001
    """End the batch's block; True on rank 0 when the file holds every state (checked complete)."""
    block, states = _ACTIVE.pop("block", None), _ACTIVE.pop("states", None)
    if block is None:
        return False
    if failed:  # the batch did not run to the end: drop the buffers without the completeness check
        block.__exit__(RuntimeError, RuntimeError("batch failed"), None)
        return False
    block.__exit__(None, None, None)
    return bool(states)


def _remove_stale_files() -> None:
    """Batch files whose driver is gone (a killed run): nobody will map them again."""
    for path in shm_dir().glob(f"{SHM_PREFIX}*"):
        pid = path.name.removeprefix(SHM_PREFIX).split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)


def _remove(worker) -> None:  # noqa: ANN001
    _close(worker, failed=True)
    capture = _ACTIVE.pop("capture", None)
    if capture is not None:
        capture.remove()


class TensorParallelVllmSource:
    """vLLM engine with TP > 1 (workers in other processes). States come back on the CPU, float32
    (the capture's dtype), as views of the memory rank 0 wrote."""

    def __init__(self, llm: object, hidden_size: int) -> None:
        self._llm = llm
        self._hidden_size = hidden_size
        self._layer_ids: list[int] | None = None

    def capture_images(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[str]],
                       layer_ids: Sequence[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """As VllmSource.capture_images: the driver's processor expands the placeholders (the ids every rank runs),
        the workers get the images with the batch, as vLLM sends any multimodal input to its TP workers."""
        from eagle3.capture.vllm_images import expand_prompts

        expanded = expand_prompts(self._llm, prompts, images)
        return expanded, self.capture(expanded, layer_ids, engine_prompts=(prompts, images))

    def capture(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int],
                engine_prompts: tuple[Sequence[Sequence[int]], Sequence[Sequence[str]]] | None = None) -> list[torch.Tensor]:
        """`engine_prompts`: (prompts, images) the engine is given instead, which it expands into `prompts`."""
        from eagle3.capture import vllm_adapter
        from eagle3.capture.hooks import CaptureError

        if self._layer_ids != list(layer_ids):
            _remove_stale_files()
            ranks = self._llm.collective_rpc(_install, args=(list(layer_ids),))
            if sorted(ranks) != list(range(len(ranks))):
                raise CaptureError(f"the TP workers report ranks {ranks}; expected 0..{len(ranks) - 1} once each")
            self._layer_ids = list(layer_ids)
        path = shm_dir() / f"{SHM_PREFIX}{os.getpid()}-{next(_BATCHES)}"
        lengths = [len(p) for p in prompts]
        try:
            self._llm.collective_rpc(_open, args=([list(p) for p in prompts], self._hidden_size, str(path)))
            try:
                if engine_prompts is None:
                    vllm_adapter.prefill(self._llm, prompts)
                else:
                    vllm_adapter.prefill(self._llm, engine_prompts[0], engine_prompts[1])
            except BaseException:
                self._llm.collective_rpc(_close, args=(True,))
                raise
            wrote = sum(self._llm.collective_rpc(_close, args=(False,)))
            if wrote != 1:
                raise CaptureError(f"{wrote} TP workers wrote states; expected exactly one (TP rank 0)")
            n_ids = len(layer_ids)
            flat = torch.from_file(str(path), shared=True, size=sum(lengths) * n_ids * self._hidden_size, dtype=torch.float32)
        finally:
            path.unlink(missing_ok=True)  # the mapping stays valid; the memory is freed with the last view
        return list(flat.view(sum(lengths), n_ids, self._hidden_size).split(lengths))

    def close(self) -> None:
        if self._layer_ids is not None:
            self._llm.collective_rpc(_remove)
            self._layer_ids = None
