"""Capture with tensor parallelism: the capture lives in every vLLM worker process.

With `target.tensor_parallel_size` > 1 vLLM runs the model in TP worker processes (its "mp"
executor), out of this process's reach. `TensorParallelVllmSource` drives the same
HiddenStateCapture (eagle3.capture.hooks) inside each worker through `llm.collective_rpc`,
which runs a function in every worker and returns the list of results in rank order:

    install   each worker resolves its decoder stack and installs the capture, with the row map
              of its own model runner (`vllm_adapter.runner_row_source`);
    open      each worker opens a `collecting()` block for the prompts of this batch: rank 0
              allocates the per-prompt buffers, the other ranks none (their hooks copy nothing);
    prefill   the driver runs the batch (vllm_adapter.prefill), every rank the same forward;
    close     each worker closes the block (rank 0 checks every position was captured once) and
              returns its states: rank 0 the per-prompt tensors, the others None.

So only rank 0's rows cross a process boundary, once per batch, through vLLM's own RPC channel
(pickled; the states of one extract batch, `extract.batch_tokens` x (n_aux+1) x H floats). Why
collective_rpc and not a `worker_extension_cls`: the capture needs no state at engine start, the
functions are plain module functions any vLLM with collective_rpc can run, and nothing of ours
has to be named when the engine is created. Each call needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
(functions travel by reference to this module), which the adapter sets for TP engines.

Not done: rank 0 writing shards itself (or handing a shared-memory handle) instead of returning
tensors, which would spare the copy through the driver for large batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def _open(worker, prompts: list[list[int]], hidden_size: int) -> None:  # noqa: ANN001
    block = _ACTIVE["capture"].collecting(prompts, hidden_size)
    _ACTIVE["block"], _ACTIVE["states"] = block, block.__enter__()


def _close(worker, failed: bool) -> list[torch.Tensor] | None:  # noqa: ANN001
    """End the batch's block; rank 0 returns its states (checked complete), other ranks None."""
    block, states = _ACTIVE.pop("block", None), _ACTIVE.pop("states", None)
    if block is None:
        return None
    if failed:  # the batch did not run to the end: drop the buffers without the completeness check
        block.__exit__(RuntimeError, RuntimeError("batch failed"), None)
        return None
    block.__exit__(None, None, None)
    return list(states) if states else None


def _remove(worker) -> None:  # noqa: ANN001
    _close(worker, failed=True)
    capture = _ACTIVE.pop("capture", None)
    if capture is not None:
        capture.remove()


class TensorParallelVllmSource:
    """vLLM engine with TP > 1 (workers in other processes). States come back on the CPU, float32."""

    def __init__(self, llm: object, hidden_size: int) -> None:
        self._llm = llm
        self._hidden_size = hidden_size
        self._layer_ids: list[int] | None = None

    def capture(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        from eagle3.capture import vllm_adapter
        from eagle3.capture.hooks import CaptureError

        if self._layer_ids != list(layer_ids):
            ranks = self._llm.collective_rpc(_install, args=(list(layer_ids),))
            if sorted(ranks) != list(range(len(ranks))):
                raise CaptureError(f"the TP workers report ranks {ranks}; expected 0..{len(ranks) - 1} once each")
            self._layer_ids = list(layer_ids)
        self._llm.collective_rpc(_open, args=([list(p) for p in prompts], self._hidden_size))
        try:
            vllm_adapter.prefill(self._llm, prompts)
        except BaseException:
            self._llm.collective_rpc(_close, args=(True,))
            raise
        results = [r for r in self._llm.collective_rpc(_close, args=(False,)) if r is not None]
        if len(results) != 1:
            raise CaptureError(f"{len(results)} TP workers returned states; expected exactly one (TP rank 0)")
        return results[0]

    def close(self) -> None:
        if self._layer_ids is not None:
            self._llm.collective_rpc(_remove)
            self._layer_ids = None
