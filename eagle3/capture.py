"""Capturing hidden states from a running target through a patched inner forward.

How it works (vLLM backend):
- the inner transformer's `forward` (the module that owns the decoder layers) is replaced
  by a wrapper that records, for each forward pass, the flattened `input_ids` [T] and
  `positions` [T] of all scheduled tokens and maps every row to its request and position;
- a forward hook on decoder layer k-1 captures layer id k; a vLLM layer returns
  (hidden_states, residual) and the true hidden state is their SUM (both [T, H]);
- rows are copied into per-request buffers [T_req, n_ids, H] at their positions.

Rows are mapped to requests explicitly, never by batch order: a row at position p with
token x belongs to a request whose next uncaptured position is p and whose token at p is
x. Because the target is causal, two requests that agree on tokens[0..p] have the same
states at p, so the match is exact even when prompts share prefixes.

Guards that turn silent corruption into errors:
- a layer hook firing outside the patched forward (something bypassed the patch);
- a forward pass whose hooks did not all fire (a CUDA graph or compiled region replayed);
- a row that belongs to no request (an unexpected batch), a position captured twice;
- at the end, any request position not captured exactly once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from eagle3.layers import DecoderStack


class CaptureError(RuntimeError):
    """The captured states would be wrong or incomplete; the message says why."""


@dataclass
class _Request:
    tokens: torch.Tensor  # [T] int64
    states: torch.Tensor  # [T, n_ids, H]
    coverage: torch.Tensor  # [T, n_ids] int32: times each (position, id) was written
    next_pos: int = 0  # first position not yet scheduled


@dataclass(frozen=True)
class _Segment:
    request: int
    row: int  # first row in the flattened batch
    pos: int  # first position in the request
    length: int


def _layer_state(output: object) -> torch.Tensor:
    """The hidden state leaving a decoder layer: vLLM returns (hidden, residual) -> their sum."""
    if isinstance(output, torch.Tensor):
        return output  # HF style: the state itself
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        if len(output) >= 2 and isinstance(output[1], torch.Tensor) and output[1].shape == output[0].shape:
            return output[0] + output[1]
        return output[0]
    raise CaptureError(f"unexpected decoder layer output type {type(output).__name__}")


class HiddenStateCapture:
    """Capture layer ids `layer_ids` (vLLM convention) from `stack` while `collecting()`."""

    def __init__(self, stack: DecoderStack, layer_ids: Sequence[int], dtype: torch.dtype = torch.float32) -> None:
        n = stack.num_layers
        for k in layer_ids:
            if not 1 <= k <= n:
                raise CaptureError(f"layer id {k} out of range 1..{n} (id k = state entering layer k; id {n} = last layer's output)")
        self.stack = stack
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._original_forward = None
        self._requests: list[_Request] | None = None
        self._segments: list[_Segment] | None = None  # of the forward pass in flight
        self._fired: set[int] = set()
        self.forward_passes = 0
        self.rows_seen = 0

    # -- install / remove -------------------------------------------------------------
    def install(self) -> None:
        inner = self.stack.inner
        if self._original_forward is not None:
            return
        self._original_forward = inner.forward
        inner.forward = self._patched_forward  # instance attribute: vLLM's compile wrapper calls self.forward
        for slot, k in enumerate(self.layer_ids):
            layer: nn.Module = self.stack.layers[k - 1]
            self._handles.append(layer.register_forward_hook(self._make_hook(slot)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._original_forward is not None:
            del self.stack.inner.forward  # back to the class's forward
            self._original_forward = None

    # -- collecting -------------------------------------------------------------------
    @contextlib.contextmanager
    def collecting(self, prompts: Sequence[Sequence[int]], hidden_size: int) -> Iterator[list[torch.Tensor]]:
        """Within the block, forward passes fill one [T_i, n_ids, H] tensor per prompt."""
        n_ids = len(self.layer_ids)
        self._requests = [
            _Request(
                tokens=torch.as_tensor(list(p), dtype=torch.int64),
                states=torch.zeros(len(p), n_ids, hidden_size, dtype=self.dtype),
                coverage=torch.zeros(len(p), n_ids, dtype=torch.int32),
            )
            for p in prompts
        ]
        try:
            yield [r.states for r in self._requests]
            self._check_complete()
        finally:
            self._requests = None
            self._segments = None

    def _check_complete(self) -> None:
        assert self._requests is not None
        for i, req in enumerate(self._requests):
            if not bool((req.coverage == 1).all()):
                missing = int((req.coverage == 0).sum())
                doubled = int((req.coverage > 1).sum())
                raise CaptureError(
                    f"prompt {i} ({len(req.tokens)} tokens): {missing} (position, layer) states never captured, "
                    f"{doubled} captured more than once; the patched forward was bypassed or saw "
                    "tokens it did not expect (is prefix caching off and eager mode on?)"
                )

    # -- the patch --------------------------------------------------------------------
    def _patched_forward(self, input_ids=None, positions=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        assert self._original_forward is not None
        if self._requests is None:  # warm-up, profiling, ordinary generation: pass through
            return self._original_forward(input_ids, positions, *args, **kwargs)
        self._segments = self._map_rows(input_ids, positions)
        self._fired = set()
        out = self._original_forward(input_ids, positions, *args, **kwargs)
        if len(self._fired) != len(self.layer_ids):
            missing = [self.layer_ids[s] for s in range(len(self.layer_ids)) if s not in self._fired]
            raise CaptureError(f"forward pass ran but the hooks for layer ids {missing} did not fire")
        self._segments = None
        self.forward_passes += 1
        return out

    def _map_rows(self, input_ids: torch.Tensor | None, positions: torch.Tensor) -> list[_Segment]:
        """Split the flattened batch into per-request segments by (position, token)."""
        assert self._requests is not None
        if input_ids is None:
            raise CaptureError("the inner forward got no input_ids (embeddings only); this target needs a row map from the engine")
        ids = input_ids.detach().to("cpu", torch.int64).reshape(-1)
        pos = positions.detach().to("cpu", torch.int64)
        pos = (pos[0] if pos.dim() == 2 else pos).reshape(-1)  # M-RoPE models pass [3, T]
        segments: list[_Segment] = []
        row, total = 0, ids.shape[0]
        while row < total:
            p, x = int(pos[row]), int(ids[row])
            match = next(
                (i for i, r in enumerate(self._requests) if r.next_pos == p and p < len(r.tokens) and int(r.tokens[p]) == x),
                None,
            )
            if match is None:
                raise CaptureError(f"row {row} (position {p}, token {x}) belongs to no pending request; refusing to guess")
            req = self._requests[match]
            length = 1
            while (
                row + length < total
                and p + length < len(req.tokens)
                and int(pos[row + length]) == p + length
                and int(ids[row + length]) == int(req.tokens[p + length])
            ):
                length += 1
            req.next_pos = p + length
            segments.append(_Segment(request=match, row=row, pos=p, length=length))
            row += length
        self.rows_seen += total
        return segments

    def _make_hook(self, slot: int):  # noqa: ANN202
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self._requests is None:
                return
            if self._segments is None:
                raise CaptureError(
                    f"decoder layer for id {self.layer_ids[slot]} ran outside the patched inner forward; "
                    "something bypassed the patch, states would be wrong"
                )
            state = _layer_state(output).detach()  # [T, H] (flattened batch)
            for seg in self._segments:
                req = self._requests[seg.request]
                rows = state[seg.row : seg.row + seg.length]
                req.states[seg.pos : seg.pos + seg.length, slot] = rows.to("cpu", self.dtype)
                req.coverage[seg.pos : seg.pos + seg.length, slot] += 1
            self._fired.add(slot)

        return hook
