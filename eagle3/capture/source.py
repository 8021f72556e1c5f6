"""Where hidden states come from: the `HiddenStateSource` interface and its backends.

A source runs prefill-only passes of the target over token-id prompts and returns, per
prompt, the states at the requested layer ids (vLLM's convention, eagle3.capture.layers): a tensor
[T, len(layer_ids), H], rows in token order, on whatever device the backend keeps them.

- `VllmSource`: in-process vLLM with a patched inner forward (eagle3.capture.hooks); the production path.
  By default its states come back on the CPU in float32 (what the warm engine and the online feed hand on);
  `on_device=True` (extract_store) keeps them where the engine computed them, in its own dtype, all prompts of a
  call in one buffer: the forward then copies nothing to the host and waits for nothing, and the extract's host
  stager moves them off the GPU on a side stream while the next batch runs (as HFSource's). The stored bytes are
  the same either way (the states are computed in the engine's dtype; float32 holds them exactly).
  It takes images (an `ImageSource`, `capture_images`): the engine gets each prompt as
  prepared (one placeholder per image) with its images, and expands the placeholders itself; the capture
  waits for the expanded ids (vLLM's own multimodal processor, asked first) and returns them with the states.
  HFSource refuses image samples.
- `TensorParallelVllmSource` (eagle3.capture.tp_capture): the same capture inside each TP worker process,
  images too (the driver expands, vLLM sends the images to its workers with the batch).
- `HFSource` (eagle3.capture.hf_source): transformers with forward hooks; reference, small targets, benchmark.
- a `SourceProvider` (a warm engine, eagle3.engine.client): the engine process runs one of the above itself.

`open_source` picks one from `extract.backend` and the engine object the caller loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn

Backend = Literal["vllm", "hf"]


@runtime_checkable
class HiddenStateSource(Protocol):
    def capture(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        """Per prompt, in prompt order: states [T_i, len(layer_ids), H]."""
        ...

    def close(self) -> None:
        """Undo whatever the source installed on the engine (patches, hooks)."""
        ...


class VllmSource:
    """vLLM in-process engine + patched-forward capture. States come back on the CPU in float32, or with
    `on_device` on the engine's device in its dtype (module docstring)."""

    def __init__(self, llm: object, hidden_size: int, on_device: bool = False) -> None:
        from eagle3.capture import vllm_adapter
        from eagle3.capture.layers import resolve_decoder_stack

        if vllm_adapter.tensor_parallel_size(llm) > 1:
            raise ValueError("VllmSource needs an in-process engine (TP 1); open_source picks TensorParallelVllmSource for TP > 1")
        self._llm = llm
        self._hidden_size = hidden_size
        self._stack = resolve_decoder_stack(vllm_adapter.torch_module(llm))
        self._capture = None  # HiddenStateCapture, installed for the layer ids last asked for
        if on_device:  # the states' own dtype (the engine's activations) on the device holding the decoder layers
            self._dtype = vllm_adapter.activation_dtype(llm)
            self._device = next(self._stack.inner.parameters()).device
        else:
            self._dtype, self._device = torch.float32, torch.device("cpu")

    def capture_images(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[str]],
                       layer_ids: Sequence[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """(the ids the engine ran, states [T_i, len(layer_ids), H]) per prompt: `prompts` as prepared (one
        placeholder per image), `images` their image URLs (module docstring)."""
        from eagle3.capture.vllm_images import expand_prompts

        expanded = expand_prompts(self._llm, prompts, images)
        return expanded, self.capture(expanded, layer_ids, engine_prompts=(prompts, images))

    def capture(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int],
                engine_prompts: tuple[Sequence[Sequence[int]], Sequence[Sequence[str]]] | None = None) -> list[torch.Tensor]:
        """`engine_prompts`: (prompts, images) the engine is given instead, which it expands into `prompts`."""
        from eagle3.capture import vllm_adapter
        from eagle3.capture.hooks import HiddenStateCapture

        if self._capture is None or self._capture.layer_ids != list(layer_ids):
            self.close()
            # the engine's own row map when its runner exposes one (works when a multimodal
            # wrapper feeds embeddings instead of ids); else rows are matched by (position, token)
            try:
                rows = vllm_adapter.row_source(self._llm)
            except vllm_adapter.VllmUnsupported:
                rows = None
            self._capture = HiddenStateCapture(self._stack, layer_ids, dtype=self._dtype, row_source=rows)
            self._capture.install()
        # one buffer for the call, prompts back to back: the stager copies it to the host as it is (no torch.cat);
        # empty, not zeros: the capture's coverage check fails the call unless every row was written once
        buffer = torch.empty(sum(len(p) for p in prompts) * len(layer_ids) * self._hidden_size, dtype=self._dtype,
                             device=self._device)
        with self._capture.collecting(prompts, self._hidden_size, buffer=buffer) as states:
            if engine_prompts is None:
                vllm_adapter.prefill(self._llm, prompts)
            else:
                vllm_adapter.prefill(self._llm, engine_prompts[0], engine_prompts[1])
        return states

    def close(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None


@runtime_checkable
class ImageSource(Protocol):
    """A source that captures prompts with images (VllmSource, TensorParallelVllmSource, a warm engine's)."""

    def capture_images(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[str]],
                       layer_ids: Sequence[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        ...


@runtime_checkable
class SourceProvider(Protocol):
    """An engine that runs the capture itself, elsewhere (a warm engine process, eagle3.engine.client)."""

    def open_source(self, hidden_size: int, batch_tokens: int) -> HiddenStateSource:
        ...


def open_source(backend: Backend, engine: object, *, hidden_size: int, batch_tokens: int,
                on_device: bool = False) -> HiddenStateSource:
    """The source for `backend` over `engine` (a vllm.LLM or a SourceProvider for "vllm", a transformers model for "hf").

    `on_device`: an in-process vLLM engine (TP 1) keeps the states on its device in its dtype (VllmSource); the
    others return what they always do (HFSource: the model's device and dtype; the warm engine and TP > 1: the CPU
    in float32, through shared memory)."""
    if backend == "vllm":
        from eagle3.capture import vllm_adapter

        if isinstance(engine, SourceProvider):
            return engine.open_source(hidden_size, batch_tokens)

        if vllm_adapter.tensor_parallel_size(engine) > 1:
            from eagle3.capture.tp_capture import TensorParallelVllmSource

            return TensorParallelVllmSource(engine, hidden_size)
        return VllmSource(engine, hidden_size, on_device=on_device)
    if backend == "hf":
        if not isinstance(engine, nn.Module):
            raise TypeError(
                f"extract.backend='hf' needs a transformers model (torch nn.Module), got {type(engine).__name__}; "
                "load the target with eagle3.capture.hf_source.load_hf_target, or set extract.backend='vllm'"
            )
        from eagle3.capture.hf_source import HFSource

        return HFSource(engine, batch_tokens=batch_tokens)
    raise ValueError(f"extract.backend={backend!r}; expected 'vllm' or 'hf'")
