"""Capturing hidden states from a running target through a patched inner forward.

How it works (vLLM backend):
- the inner transformer's `forward` (the module that owns the decoder layers) is replaced
  by a wrapper that records, for each forward pass, the flattened `input_ids` [T] and
  `positions` [T] of all scheduled tokens and maps every row to its request and position;
- the state at id k is read the way the class's own EAGLE-3 code reads it: a vLLM model whose inner
  module collects aux hidden states (`aux_hidden_state_layers`, vLLM's SupportsEagle3 classes) runs
  that code under the patch, with the capture's ids added to its `aux_hidden_state_layers` for the
  call, and the states it returns are the ones stored, so id k is exactly what vLLM hands an
  EAGLE-3 draft for id k. Most classes hand `hidden_states + residual` of layer k-1's output;
  some do not: Cohere2Moe's layers return (full state, stale residual) and its code takes the
  first alone (adding the two, as a generic rule would, gives state_k + state_(k-1)). Its forward
  then returns what it would have without the capture's ids;
- a module without that code (HF style, or a toy), or, on a vLLM before 0.20 (vllm_versions.features:
  `aux_code_complete`), one without EagleModelMixin (`_maybe_add_hidden_state`: its aux loop never returns
  the last layer's state), falls back to a forward hook on decoder layer
  k-1: a layer returning (hidden_states, residual) gives their SUM (both [T, H]), a tensor itself;
  `from_vllm_aux=False` forces that rule (the tests compare the two). Hooks are installed either
  way: they guard the patch (below);
- rows are copied into per-request buffers [T_req, n_ids, H] at their positions, in the capture's dtype on the
  buffers' device (the CPU by default; a buffer on the GPU keeps the copies on the GPU, where they wait for nothing).

Rows are mapped to requests explicitly, never by batch order, in one of two ways:
- with a `row_source` (the engine's own description of the batch in flight: for each engine
  request its whole prompt, first row, first position and row count; vLLM's comes from
  `eagle3.capture.vllm_adapter.row_source`), each engine request is bound to a pending prompt with
  the same tokens the first time it is seen. Prompts that are equal token for token have
  equal states, so which one of them is bound does not matter. This also works when the
  inner forward gets embeddings only (`input_ids=None`, as vLLM's multimodal wrappers do);
  when it gets ids and positions they are checked against the row map.
- without one, from `input_ids` and `positions`: a row at position p with token x belongs to
  a request whose next uncaptured position is p and whose token at p is x, extended over
  the following rows while tokens and positions keep agreeing. Picking the first of several
  such requests is harmless when they agree on tokens[:p] (the target is causal: equal
  tokens so far, equal states), and a pick that was wrong later leaves a row that matches
  nothing, which is an error. Candidates that differ before p (two prompts both halfway
  through a chunked prefill) are an error too, since a wrong pick there would go unnoticed.

Guards that turn silent corruption into errors:
- a layer hook firing outside the patched forward (something bypassed the patch);
- a forward pass whose hooks did not all fire (a CUDA graph or compiled region replayed);
- a row that belongs to no request (an unexpected batch), a position captured twice;
- at the end, any request position not captured exactly once.

Tensor parallelism (TP), rank 0 only. With TP > 1 every rank runs the same forward over the
same flattened batch, and the state leaving a decoder layer is replicated: vLLM's
row-parallel layers (attention o_proj, MLP down_proj) end in an all-reduce, so every rank
holds the full [T, H] hidden state and residual. Copying rows on every rank would only
multiply the host traffic, so the capture asks `rank()` (default `tensor_parallel_rank`:
vLLM's TP rank when its parallel state is up, else torch.distributed's rank, else 0) when a
`collecting()` block opens: rank 0 maps and copies rows as above; any other rank yields no
buffers and its hooks copy nothing (and so it checks nothing either: rank 0's checks cover the
batch, which is the same on every rank); its patched forward passes straight through, or, where
the states come from vLLM's aux code, runs that code with the same ids as rank 0 and drops what
it returns (DeepSeek's all-gathers its aux states under sequence-parallel MoE: every rank must).

Shipping rank 0's rows from vLLM's worker processes (its "mp" executor, which TP > 1 uses) to
the driver: eagle3.capture.tp_capture installs this capture in every worker through
`llm.collective_rpc`, and only rank 0's states come back. Another route, not taken: vLLM's
"external_launcher" executor under torchrun, where each rank holds its own in-process engine.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from eagle3.capture import vllm_versions
from eagle3.capture.layers import DecoderStack


_MISSING = object()


class CaptureError(RuntimeError):
    """The captured states would be wrong or incomplete; the message says why."""


@dataclass
class _Request:
    tokens: torch.Tensor  # [T] int64
    states: torch.Tensor  # [T, n_ids, H]
    coverage: torch.Tensor  # [T, n_ids] int32: times each (position, id) was written
    next_pos: int = 0  # first position not yet scheduled


@dataclass(frozen=True)
class RowSpan:
    """Rows [row, row + length) of the forward pass in flight are positions [pos, pos + length) of one engine request."""

    request_key: str  # the engine's id of the request, stable across forward passes
    prompt: Sequence[int]  # the request's whole prompt, token ids
    row: int
    pos: int
    length: int


RowSource = Callable[[], Sequence[RowSpan]]  # called inside each forward pass: the batch in flight
RankFn = Callable[[], int]  # this process's tensor-parallel rank


def tensor_parallel_rank() -> int:
    """This process's TP rank: vLLM's when its model-parallel state is initialized, else torch.distributed's, else 0.

    vLLM is consulted only when already imported (this module never imports it): no vLLM, no vLLM parallel state.
    """
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None and state.model_parallel_is_initialized():
        return int(state.get_tensor_model_parallel_rank())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())  # TP-only runs: the global rank is the TP rank
    return 0


@dataclass(frozen=True)
class _Segment:
    request: int
    row: int  # first row in the flattened batch
    pos: int  # first position in the request
    length: int


def collects_aux_states(inner: nn.Module, vllm_version: str | None = None) -> bool:
    """Whether `inner` has vLLM's own aux-hidden-state code that returns every id the capture asks for:
    EagleModelMixin's (`_maybe_add_hidden_state`), or, from vLLM 0.20 on, a class's own `aux_hidden_state_layers`
    code (DeepSeek-V2's, Qwen3.5's). Before 0.20 no class had the mixin and the per-class loops skip the last
    layer's state. `vllm_version`: None reads the vLLM this process imported (none imported: 0.20's rule)."""
    if not isinstance(getattr(inner, "aux_hidden_state_layers", None), (tuple, list)):
        return False
    if callable(getattr(inner, "_maybe_add_hidden_state", None)):
        return True
    if vllm_version is None:
        vllm = sys.modules.get("vllm")
        vllm_version = getattr(vllm, "__version__", None)
    return vllm_version is None or vllm_versions.features(vllm_version).aux_code_complete


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

    def __init__(
        self,
        stack: DecoderStack,
        layer_ids: Sequence[int],
        dtype: torch.dtype = torch.float32,
        row_source: RowSource | None = None,  # the engine's row map; None: map rows by (position, token)
        rank: RankFn = tensor_parallel_rank,  # only rank 0 copies rows (module docstring: tensor parallelism)
        from_vllm_aux: bool = True,  # False: layer-output hooks even where vLLM's own aux code exists
        vllm_version: str | None = None,  # the engine's vLLM (collects_aux_states); None: the one imported
    ) -> None:
        n = stack.num_layers
        for k in layer_ids:
            if not 1 <= k <= n:
                raise CaptureError(f"layer id {k} out of range 1..{n} (id k = state entering layer k; id {n} = last layer's output)")
        self.stack = stack
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.row_source = row_source
        self.rank = rank
        # where the states come from: "vllm-aux" (the class's own EAGLE-3 code) or "layer-hooks" (module docstring)
        self.reads = "vllm-aux" if from_vllm_aux and collects_aux_states(stack.inner, vllm_version) else "layer-hooks"
        self._bound: dict[str, int] = {}  # engine request key -> prompt index, per collecting() block
        self._unbound: dict[tuple[int, ...], list[int]] = {}  # prompt tokens -> indices not yet bound
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._original_forward = None
        self._requests: list[_Request] | None = None
        self._segments: list[_Segment] | None = None  # of the forward pass in flight
        self._fired: set[int] = set()
        self._mirroring = False  # a TP rank other than 0 inside collecting(): same forward as rank 0, nothing stored
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
    def collecting(self, prompts: Sequence[Sequence[int]], hidden_size: int,
                   buffer: torch.Tensor | None = None) -> Iterator[list[torch.Tensor]]:
        """Within the block, forward passes fill one [T_i, n_ids, H] tensor per prompt.

        `buffer`: where the states go, one flat tensor of this capture's dtype holding the prompts'
        tensors one after another (e.g. shared memory another process reads); None: fresh tensors.
        On a TP rank other than 0 the block yields [] and the forward passes run untouched.
        """
        if self.rank() != 0:
            # no buffers: _requests stays None, so the hooks pass through; with vLLM's aux code the patch still asks
            # for the same aux states as rank 0 (that code may all-gather them), and drops them
            self._mirroring = self.reads == "vllm-aux"
            try:
                yield []
            finally:
                self._mirroring = False
            return
        n_ids = len(self.layer_ids)
        if buffer is None:
            states = [torch.zeros(len(p), n_ids, hidden_size, dtype=self.dtype) for p in prompts]
        else:
            total = sum(len(p) for p in prompts)
            if buffer.dtype != self.dtype or buffer.numel() != total * n_ids * hidden_size:
                raise CaptureError(f"buffer of {buffer.numel()} {buffer.dtype}; expected {total * n_ids * hidden_size} "
                                   f"{self.dtype} ({total} tokens x {n_ids} layers x {hidden_size})")
            states = list(buffer.view(total, n_ids, hidden_size).split([len(p) for p in prompts]))
        self._requests = [
            _Request(
                tokens=torch.as_tensor(list(p), dtype=torch.int64),
                states=rows,
                coverage=torch.zeros(len(p), n_ids, dtype=torch.int32),
            )
            for p, rows in zip(prompts, states)
        ]
        self._bound, self._unbound = {}, {}
        for i, p in enumerate(prompts):
            self._unbound.setdefault(tuple(int(t) for t in p), []).append(i)
        try:
            yield [r.states for r in self._requests]
            self._check_complete()
        finally:
            self._requests = None
            self._segments = None
            self._bound, self._unbound = {}, {}

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
            if self._mirroring:
                return self._forward_reading_aux(input_ids, positions, *args, **kwargs)
            return self._original_forward(input_ids, positions, *args, **kwargs)
        if self.row_source is not None:
            self._segments = self._map_spans(self.row_source(), input_ids, positions)
        else:
            self._segments = self._map_rows(input_ids, positions)
        self._fired = set()
        if self.reads == "vllm-aux":
            out = self._forward_reading_aux(input_ids, positions, *args, **kwargs)
        else:
            out = self._original_forward(input_ids, positions, *args, **kwargs)
        if len(self._fired) != len(self.layer_ids):
            missing = [self.layer_ids[s] for s in range(len(self.layer_ids)) if s not in self._fired]
            raise CaptureError(f"forward pass ran but the hooks for layer ids {missing} did not fire")
        self._segments = None
        self.forward_passes += 1
        return out

    def _forward_reading_aux(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        """The original forward with the capture's ids added to vLLM's `aux_hidden_state_layers`; stores what it returns.

        vLLM's aux code appends one state per requested id in layer order (`_set_aux_hidden_state_layers`
        sorts them), and the forward then returns (hidden_states, [state per id]); ids asked for before
        (an EAGLE-3 speculator served by this engine) are handed back as the forward would have.
        """
        inner = self.stack.inner
        prior = tuple(inner.aux_hidden_state_layers)
        wanted = tuple(sorted(set(prior) | set(self.layer_ids)))
        own = vars(inner).get("aux_hidden_state_layers", _MISSING)  # an instance attribute, or the class default
        inner.aux_hidden_state_layers = wanted
        try:
            out = self._original_forward(*args, **kwargs)
        finally:
            if own is _MISSING:
                del inner.aux_hidden_state_layers
            else:
                inner.aux_hidden_state_layers = own
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple)) and len(out[1]) == len(wanted)):
            got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
            raise CaptureError(
                f"{type(inner).__name__}.forward, asked for the aux hidden states of ids {list(wanted)}, returned {got}; "
                f"expected (hidden_states, [{len(wanted)} states]) as vLLM's SupportsEagle3 aux code returns "
                "(did that code change? HiddenStateCapture(..., from_vllm_aux=False) reads the layer outputs instead)"
            )
        hidden, aux = out
        by_id = dict(zip(wanted, aux))  # id -> [T, H], the flattened batch
        for slot, k in enumerate(self.layer_ids if self._requests is not None else ()):  # none on other TP ranks
            self._store(slot, by_id[k].detach())
        return (hidden, [by_id[k] for k in prior]) if prior else hidden

    def _store(self, slot: int, state: torch.Tensor) -> None:
        """Copy the rows of `state` [T, H] (the flattened batch) into each request's buffer at slot `slot`."""
        assert self._requests is not None and self._segments is not None
        for seg in self._segments:
            req = self._requests[seg.request]
            rows = state[seg.row : seg.row + seg.length]
            req.states[seg.pos : seg.pos + seg.length, slot].copy_(rows)  # on the buffer's device: no host wait
            req.coverage[seg.pos : seg.pos + seg.length, slot] += 1

    def _map_rows(self, input_ids: torch.Tensor | None, positions: torch.Tensor) -> list[_Segment]:
        """Split the flattened batch into per-request segments by (position, token)."""
        assert self._requests is not None
        if input_ids is None:
            raise CaptureError(
                "the inner forward got no input_ids (embeddings only, as multimodal wrappers do); pass the engine's "
                "row map: HiddenStateCapture(..., row_source=eagle3.capture.vllm_adapter.row_source(llm))"
            )
        ids = input_ids.detach().to("cpu", torch.int64).reshape(-1)
        pos = positions.detach().to("cpu", torch.int64)
        pos = (pos[0] if pos.dim() == 2 else pos).reshape(-1)  # M-RoPE models pass [3, T]
        segments: list[_Segment] = []
        row, total = 0, ids.shape[0]
        while row < total:
            match, length = self._match(ids, pos, row)
            p = int(pos[row])
            self._requests[match].next_pos = p + length
            segments.append(_Segment(request=match, row=row, pos=p, length=length))
            row += length
        self.rows_seen += total
        return segments

    def _match(self, ids: torch.Tensor, pos: torch.Tensor, row: int) -> tuple[int, int]:
        """(prompt, rows) that the rows from `row` on continue: the pending prompt agreeing with the most of them.

        Candidates: prompts whose next uncaptured position is p = pos[row], with the row's token
        at p. Ties are harmless when the tied prompts agree on tokens[:p] (equal states so far);
        tied prompts whose earlier tokens differ are an error, as a wrong pick would go unnoticed.
        """
        assert self._requests is not None
        p = int(pos[row])
        steps = torch.arange(ids.shape[0] - row)
        consecutive = int((pos[row:] == p + steps).cumprod(0).sum())  # rows whose positions run p, p+1, ...
        best: list[int] = []
        best_len = 0
        for i, r in enumerate(self._requests):
            if r.next_pos != p or p >= len(r.tokens):
                continue
            m = min(consecutive, len(r.tokens) - p)
            agree = int((ids[row : row + m] == r.tokens[p : p + m]).cumprod(0).sum())  # leading rows that agree
            if agree > best_len:
                best, best_len = [i], agree
            elif agree == best_len and agree > 0:
                best.append(i)
        if not best:
            raise CaptureError(
                f"row {row} (position {p}, token {int(ids[row])}) belongs to no pending request; refusing to guess"
            )
        first = self._requests[best[0]].tokens[:p]
        if any(not torch.equal(self._requests[i].tokens[:p], first) for i in best[1:]):
            raise CaptureError(
                f"row {row} (position {p}, token {int(ids[row])}) continues {len(best)} prompts whose earlier tokens differ; "
                "the token row map cannot tell them apart: pass row_source=eagle3.capture.vllm_adapter.row_source(llm)"
            )
        return best[0], best_len

    def _map_spans(self, spans: Sequence[RowSpan], input_ids: torch.Tensor | None, positions: torch.Tensor) -> list[_Segment]:
        """Segments from the engine's row map; checked against the ids and positions the forward got."""
        assert self._requests is not None
        pos = positions.detach().to("cpu", torch.int64)
        pos = (pos[0] if pos.dim() == 2 else pos).reshape(-1)  # M-RoPE models pass [3, T]
        ids = None if input_ids is None else input_ids.detach().to("cpu", torch.int64).reshape(-1)
        segments: list[_Segment] = []
        next_row = 0
        for span in spans:
            index = self._bind(span)
            req = self._requests[index]
            if span.row != next_row or span.row + span.length > pos.shape[0]:
                raise CaptureError(
                    f"engine row map: request {span.request_key} claims rows {span.row}..{span.row + span.length - 1}, "
                    f"expected to start at row {next_row} of a {pos.shape[0]}-row batch"
                )
            if span.pos != req.next_pos or span.pos + span.length > len(req.tokens):
                raise CaptureError(
                    f"engine row map: request {span.request_key} at positions {span.pos}..{span.pos + span.length - 1}, "
                    f"but its prompt ({len(req.tokens)} tokens) was captured up to position {req.next_pos}"
                )
            rows = slice(span.row, span.row + span.length)
            want = torch.arange(span.pos, span.pos + span.length)
            if not torch.equal(pos[rows], want) or (ids is not None and not torch.equal(ids[rows], req.tokens[want])):
                raise CaptureError(
                    f"engine row map disagrees with the forward pass at rows {span.row}..{span.row + span.length - 1} "
                    f"(request {span.request_key}): positions or token ids differ; refusing to guess"
                )
            req.next_pos = span.pos + span.length
            segments.append(_Segment(request=index, row=span.row, pos=span.pos, length=span.length))
            next_row += span.length
        self.rows_seen += next_row  # rows past the last span are padding
        return segments

    def _bind(self, span: RowSpan) -> int:
        """The prompt index of engine request `span.request_key`, binding it to an equal pending prompt on first sight."""
        assert self._requests is not None
        if span.request_key in self._bound:
            return self._bound[span.request_key]
        free = self._unbound.get(tuple(int(t) for t in span.prompt))
        if not free:
            raise CaptureError(
                f"engine request {span.request_key} ({len(span.prompt)} prompt tokens) matches no pending prompt; "
                "was it submitted outside this capture, or did the engine change the prompt?"
            )
        index = free.pop(0)
        self._bound[span.request_key] = index
        return index

    def _make_hook(self, slot: int):  # noqa: ANN202
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self._requests is None:
                return
            if self._segments is None:
                raise CaptureError(
                    f"decoder layer for id {self.layer_ids[slot]} ran outside the patched inner forward; "
                    "something bypassed the patch, states would be wrong"
                )
            if self.reads == "layer-hooks":  # else the forward's own aux states are stored when it returns
                self._store(slot, _layer_state(output).detach())  # [T, H] (flattened batch)
            self._fired.add(slot)

        return hook
