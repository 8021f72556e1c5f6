"""The Hugging Face transformers backend of extraction: hidden states through forward hooks.

Owns `HFSource` (a `HiddenStateSource`, see eagle3.capture.source) and `load_hf_target`. It is the
reference the vLLM backend is tested against, the backend for small targets on the CPU, and
the one the throughput benchmark drives on a GPU.

How it captures (prefill only): prompts are sorted by length and cut into chunks of at most
`batch_tokens` padded tokens; each chunk is one forward of the INNER model (the module that
owns the decoder layers, so no lm_head and no [T, V] logits), right-padded, with an attention
mask when lengths differ. A forward hook on decoder layer k-1 keeps layer id k (vLLM's
convention: id k = state entering layer k, id N = the last layer's output before the final
norm); HF layers return the state itself. Row r of a chunk is prompt chunk[r], and because
padding is on the right and the model is causal, that prompt's states are rows [:T] exactly.
States stay on the model's device (extraction copies them to the host on a side stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from eagle3.capture.hooks import CaptureError
from eagle3.capture.layers import DecoderStack, resolve_decoder_stack
from eagle3.gpu.preflight import target_preflight


class HFSource:
    """Hidden states of a transformers model: `capture(prompts, ids)` -> per prompt [T, len(ids), H]."""

    def __init__(self, model: nn.Module, *, batch_tokens: int = 16384, pad_token_id: int = 0) -> None:
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens={batch_tokens}; expected >= 1 (extract.batch_tokens)")
        self.stack: DecoderStack = resolve_decoder_stack(model)
        self.device = next(model.parameters()).device
        self.batch_tokens = batch_tokens
        self.pad_token_id = pad_token_id
        self.forward_passes = 0

    def capture(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        """Per prompt, in prompt order: states [T_i, len(layer_ids), H] on the model's device."""
        ids = list(layer_ids)
        n = self.stack.num_layers
        if not ids or any(not 1 <= k <= n for k in ids):
            raise CaptureError(f"layer ids {ids}: expected ids in 1..{n} (id k = state entering layer k; id {n} = last layer's output)")
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        if empty:
            raise CaptureError(f"prompts {empty[:5]} have no tokens; expected at least one token per prompt")
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for chunk in self._chunks([len(p) for p in prompts]):
            states = self._forward([prompts[i] for i in chunk], ids)  # [B, T_max, n_ids, H]
            for row, i in enumerate(chunk):
                out[i] = states[row, : len(prompts[i])]  # right padding: the prompt's own rows come first -> [T_i, n_ids, H]
        return [s for s in out if s is not None]

    def close(self) -> None:
        """Nothing to undo: hooks live only for the duration of one forward."""

    def _chunks(self, lengths: list[int]) -> list[list[int]]:
        """Prompt indices, longest first, cut so that (rows x longest) <= batch_tokens (one prompt at least)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        chunks: list[list[int]] = []
        for i in order:
            if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= self.batch_tokens:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    def _forward(self, prompts: list[Sequence[int]], ids: list[int]) -> torch.Tensor:
        """One right-padded forward of the inner model; returns [B, T_max, n_ids, H] on the device."""
        lengths = [len(p) for p in prompts]
        t_max = max(lengths)
        tokens = torch.full((len(prompts), t_max), self.pad_token_id, dtype=torch.int64)  # [B, T_max]
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        mask = None
        if min(lengths) != t_max:  # equal lengths: no mask, so attention keeps its plain causal fast path
            mask = (torch.arange(t_max)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)  # [B, T_max]
            mask = self._to_device(mask)
        captured: dict[int, torch.Tensor] = {}
        hooks = [self.stack.layers[k - 1].register_forward_hook(self._hook(slot, k, captured, tokens.shape)) for slot, k in enumerate(ids)]
        try:
            with torch.inference_mode(), _no_packed_sequence_check():
                self.stack.inner(input_ids=self._to_device(tokens), attention_mask=mask, use_cache=False)
        finally:
            for handle in hooks:
                handle.remove()
        missing = [k for slot, k in enumerate(ids) if slot not in captured]
        if missing:
            raise CaptureError(f"the forward ran but the hooks for layer ids {missing} did not fire ({self.stack.path})")
        self.forward_passes += 1
        return torch.stack([captured[slot] for slot in range(len(ids))], dim=2)  # n_ids x [B, T_max, H] -> [B, T_max, n_ids, H]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)  # no host wait for the GPU's queue
        return tensor.to(self.device)

    @staticmethod
    def _hook(slot: int, layer_id: int, captured: dict[int, torch.Tensor], batch_shape: torch.Size):  # noqa: ANN205
        def hook(module: nn.Module, args: object, output: object) -> None:
            state = output[0] if isinstance(output, tuple) else output  # HF layers return the state (older ones a tuple)
            if not isinstance(state, torch.Tensor) or tuple(state.shape[:2]) != tuple(batch_shape):
                shape = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
                raise CaptureError(f"layer id {layer_id}: decoder layer output {shape}, expected [{batch_shape[0]}, {batch_shape[1]}, H]")
            if slot in captured:
                raise CaptureError(f"layer id {layer_id}: the decoder layer ran twice in one forward; states would be ambiguous")
            captured[slot] = state.detach()  # [B, T_max, H]

        return hook


@contextlib.contextmanager
def _no_packed_sequence_check() -> Iterator[None]:
    """Skip transformers' search for packed sequences during our forward. With no attention mask and no cache,
    every forward calls masking_utils.find_packed_sequence_indices(position_ids), whose `.all()` is a host sync:
    the host then waits for the previous batch's kernels before it can queue this one's. A capture batch is never
    packed (one prompt a row, right-padded, with an explicit mask when lengths differ), so the answer is known:
    None, which is what the function returns for unpacked rows. Transformers without the function: nothing to do."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def load_hf_target(model_dir: str, *, dtype: str = "auto", device: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """Load a target folder with transformers for `HFSource` (eval mode; CUDA when available)."""
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda":
        target_preflight(Path(model_dir), 1, 0.0)  # no KV cache: one prefill's activations are small
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()
