"""Attention of the draft's TTT unroll (see eagle3.draft.model): the masks that define it and the kernels that
compute it without them.

Step 0 is causal attention over the step-0 keys. At step j >= 1 a row also sees its own keys of steps 1..j;
their log-sum-exp enters one attention call over the step-0 keys as a "sink" key (ttt_attend).
Packed samples are kept apart by an [L+1, L+1] mask for SDPA, or, on CUDA in bf16/fp16, by torch's varlen
flash attention with every sample as its own sequence and its own sink (DocLayout): no mask, no causal
blocks computed across samples.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def ttt_attention_mask(doc_ids: torch.Tensor, step: int) -> torch.Tensor:
    """Which keys a query at step `step` sees. doc_ids [L] -> bool [L, L*(step+1)].

    Key block 0 holds step-0 keys (causal, same document); block i >= 1 the keys of
    step i, of which a row sees only its own (the diagonal). This dense mask is the
    definition; `Eagle3Draft` computes the same attention without building it.
    """
    length = doc_ids.shape[0]
    rows = torch.arange(length, device=doc_ids.device)
    causal = (rows[:, None] >= rows[None, :]) & (doc_ids[:, None] == doc_ids[None, :])  # [L, L]
    diagonal = rows[:, None] == rows[None, :]  # [L, L]
    return torch.cat([causal] + [diagonal] * step, dim=1)  # [L, L*(step+1)]


def sink_block_mask(doc_ids: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor | None:
    """Mask of the step-0 block with one sink key and one dummy query in front: bool [L+1, L+1].

    None when every row is one document: plain causal attention then (is_causal, flash kernels).
    """
    if doc_ids is None:
        return None
    doc = torch.cat([doc_ids.new_full((1,), -1), doc_ids])  # [L+1]; the sink belongs to no document
    rows = torch.arange(length + 1, device=device)
    mask = (rows[:, None] >= rows[None, :]) & (doc[:, None] == doc[None, :])  # [L+1, L+1]
    mask[:, 0] = True  # every query sees the sink
    return mask


def _find_varlen():
    """torch's variable-length flash attention (torch.nn.attention.varlen, CUDA only) and how this torch spells
    causal and the scale: (fn, causal kwargs, takes scale), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, causal, "scale" in params


_UNSET = object()
_VARLEN = _UNSET  # _find_varlen()'s answer, found on the first CUDA use: importing torch.nn.attention.varlen imports
# torch._dynamo (about 1 s), which an `eagle3` command that never trains (a refused setting, `eagle3 engine list`)
# should not wait for


def _varlen_found():  # noqa: ANN202 - _find_varlen's tuple or None
    global _VARLEN
    if _VARLEN is _UNSET:
        _VARLEN = _find_varlen()
    return _VARLEN


@dataclass(frozen=True)
class DocLayout:
    """Packed samples for variable-length attention: each sample is its own sequence, so no [L, L] mask exists
    and causal blocks across samples are never computed. For the sink steps every sample gets its own sink key
    (and dummy query) in front, at `sinks`; its rows move to `rows_ext` of the extended layout (L + D rows)."""

    cu: torch.Tensor  # int32 [D+1] row offsets of the samples
    cu_ext: torch.Tensor  # int32 [D+1] the same in the extended layout
    rows_ext: torch.Tensor  # int64 [L] row r's place in the extended layout
    sinks: torch.Tensor  # int64 [D] each sample's sink row in the extended layout
    max_len: int  # longest sample + 1 (its sink), rounded up to a power of two: few compiled variants

    @staticmethod
    def build(doc_ids: torch.Tensor) -> DocLayout:
        """doc_ids [L] (0, 0, .., 1, 1, ..: samples in order) -> layout. One host sync for the sample lengths."""
        counts = torch.bincount(doc_ids)  # [D]
        cu = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)  # [D+1]
        docs = torch.arange(counts.shape[0] + 1, device=doc_ids.device, dtype=torch.int32)
        return DocLayout(cu=cu, cu_ext=cu + docs, rows_ext=torch.arange(doc_ids.shape[0], device=doc_ids.device)
                         + doc_ids + 1, sinks=(cu[:-1] + docs[:-1]).long(),
                         max_len=1 << int(counts.max()).bit_length())


def use_varlen(doc_ids: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Packed samples on CUDA, computed in bf16/fp16, with a torch that has varlen flash attention."""
    return (doc_ids is not None and doc_ids.is_cuda and dtype in (torch.bfloat16, torch.float16)
            and _varlen_found() is not None)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
            scale: float) -> torch.Tensor:
    """Causal attention within each sequence of cu. q, k, v [T, heads, d] -> [T, heads, d]."""
    fn, causal, takes_scale = _VARLEN
    if takes_scale:
        return fn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal)
    return fn(q * (scale * math.sqrt(q.shape[-1])), k, v, cu, cu, max_len, max_len, **causal)


def new_ttt_cache(doc_ids: torch.Tensor | None, length: int, device: torch.device, dtype: torch.dtype) -> TTTCache:
    """The cache of one unroll whose attention computes in `dtype`: varlen layout for packed samples on CUDA in
    bf16/fp16, else the sink mask (None: one sample)."""
    if use_varlen(doc_ids, dtype):
        return TTTCache(mask=None, docs=DocLayout.build(doc_ids))
    return TTTCache(mask=sink_block_mask(doc_ids, length, device))


@dataclass
class TTTCache:
    """Keys and values of one unroll: step 0's for every row, and each later step's own."""

    mask: torch.Tensor | None  # sink_block_mask(...) [L+1, L+1], or None for one document (or with docs)
    docs: DocLayout | None = None  # packed samples, varlen attention (CUDA): see new_ttt_cache
    block_keys: torch.Tensor | None = None  # [kvh, L, hd] step-0 keys (after RoPE)
    block_values: torch.Tensor | None = None  # [kvh, L, hd]
    own_keys: list[torch.Tensor] = field(default_factory=list)  # per step >= 1: [kvh, L, hd]
    own_values: list[torch.Tensor] = field(default_factory=list)  # per step >= 1: [kvh, L, hd]


def ttt_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TTTCache, groups: int) -> torch.Tensor:
    """One TTT step's attention, shared by every draft architecture (eagle3.draft.model, eagle3.draft.mla).

    q [heads, L, hd], k and v [kvh, L, hd] (after RoPE; heads = kvh * groups; scores are q.k / sqrt(hd), so a
    draft with another softmax scale multiplies q first) -> [heads, L, hd]; adds k and v to `cache`.

    Step 0 is causal attention over the step-0 keys. At step j >= 1 a row also sees its
    own keys of steps 1..j (ttt_attention_mask). Those j scores per row are computed
    directly; their log-sum-exp s_d enters ONE attention call over the step-0 keys as a
    "sink" key, prepended, whose score for row r is s_d(r) (an extra query dimension holds
    s_d(r)*sqrt(hd), split into hi + lo so bf16 keeps it exact; the sink key holds 1 there)
    and whose value is a one-hot extra dimension. The output's extra dimension is then the
    sink's share p of the softmax, and
        out = out[:hd] + p * (softmax-weighted mean of the row's own values)
    is exactly attention under the dense mask, at the cost of plain causal attention (no
    [L, L*(j+1)] mask; flash kernels on CUDA when the batch is one document).
    """
    heads, length, hd = q.shape
    if cache.block_keys is None:  # step 0
        cache.block_keys, cache.block_values = k, v
        return block_attention(q, None, cache, groups)  # [heads, L, hd]
    cache.own_keys.append(k)
    cache.own_values.append(v)
    kvh = k.shape[0]
    q_groups = q.view(kvh, groups, length, hd)  # [kvh, g, L, hd]
    own_k = torch.stack(cache.own_keys)[:, :, None]  # [j, kvh, 1, L, hd]
    own_v = torch.stack(cache.own_values)[:, :, None]  # [j, kvh, 1, L, hd]
    scores = (q_groups[None].float() * own_k.float()).sum(-1) / math.sqrt(hd)  # [j, kvh, g, L]
    sink_score = torch.logsumexp(scores, dim=0).reshape(heads, length)  # [heads, L]
    weights = torch.softmax(scores, dim=0)[..., None]  # [j, kvh, g, L, 1]
    own_mean = (weights * own_v.float()).sum(0).reshape(heads, length, hd)  # [heads, L, hd]
    out = block_attention(q, sink_score, cache, groups)  # [heads, L, hd + 1]
    return out[..., :hd] + out[..., hd:] * own_mean.to(out.dtype)  # [heads, L, hd]


def _hi_lo(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (fp32) as hi + lo in `dtype`, both exact enough that hi + lo ~ x to ~2^-16 relative in bf16."""
    hi = x.detach().to(dtype)
    return hi, (x - hi.float()).to(dtype)


def block_attention(q: torch.Tensor, sink_score: torch.Tensor | None, cache: TTTCache, groups: int) -> torch.Tensor:
    """Attention over the step-0 keys (causal, same document), plus the sink when given.

    q [heads, L, hd], sink_score [heads, L] or None -> [heads, L, hd] (no sink) or [heads, L, hd+1]
    (the last column is the sink's softmax share).
    """
    keys, values = cache.block_keys, cache.block_values  # [kvh, L, hd]
    hd = q.shape[-1]
    if cache.docs is not None:
        return _block_attention_varlen(q, sink_score, cache.docs, keys, values, groups)
    if sink_score is None:  # step 0: causal (and same-document) attention, no sink
        mask = None if cache.mask is None else cache.mask[1:, 1:]  # [L, L]
        return _sdpa(q, keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0), mask)
    heads, length = q.shape[0], q.shape[1]
    width = -(-(hd + 2) // 8) * 8  # hd + 2 extra dimensions, padded to a multiple of 8 (flash kernels)
    q_ext = q.new_zeros(heads, length + 1, width)  # row 0: a dummy query that sees only the sink
    q_ext[:, 1:, :hd] = q
    hi, lo = _hi_lo(sink_score.float() * math.sqrt(hd), q.dtype)  # [heads, L] each
    q_ext[:, 1:, hd], q_ext[:, 1:, hd + 1] = hi, lo
    k_ext = keys.new_zeros(keys.shape[0], length + 1, width)  # key 0: the sink
    k_ext[:, 1:, :hd] = keys
    k_ext[:, 0, hd : hd + 2] = 1.0  # sink score = (hi + lo) / sqrt(hd) = sink_score
    v_ext = values.new_zeros(values.shape[0], length + 1, width)
    v_ext[:, 1:, :hd] = values
    v_ext[:, 0, hd] = 1.0  # the sink's value: one-hot in column hd
    out = _sdpa(q_ext, k_ext.repeat_interleave(groups, 0), v_ext.repeat_interleave(groups, 0), cache.mask,
                scale=1.0 / math.sqrt(hd))  # [heads, L+1, width]
    return out[:, 1:, : hd + 1]  # drop the dummy query and the padding

def _block_attention_varlen(q: torch.Tensor, sink_score: torch.Tensor | None, docs: DocLayout,
                            keys: torch.Tensor, values: torch.Tensor, groups: int) -> torch.Tensor:
    """block_attention for packed samples as variable-length sequences (one sink per sample)."""
    hd = q.shape[-1]
    heads, length = q.shape[0], q.shape[1]
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)  # [heads, L, hd]
    if sink_score is None:
        out = _varlen(q.transpose(0, 1).contiguous(), keys.transpose(0, 1).contiguous(),
                      values.transpose(0, 1).contiguous(), docs.cu, docs.max_len, 1.0 / math.sqrt(hd))
        return out.transpose(0, 1)  # [heads, L, hd]
    width = -(-(hd + 2) // 8) * 8
    rows, total = docs.rows_ext, length + docs.sinks.shape[0]
    q_ext = q.new_zeros(total, heads, width)  # [L+D, heads, width]; the sink rows: dummy queries
    q_ext[rows, :, :hd] = q.transpose(0, 1)
    hi, lo = _hi_lo(sink_score.float() * math.sqrt(hd), q.dtype)  # [heads, L] each
    q_ext[rows, :, hd], q_ext[rows, :, hd + 1] = hi.t(), lo.t()
    k_ext = keys.new_zeros(total, heads, width)
    k_ext[rows, :, :hd] = keys.transpose(0, 1)
    k_ext[docs.sinks, :, hd : hd + 2] = 1.0
    v_ext = values.new_zeros(total, heads, width)
    v_ext[rows, :, :hd] = values.transpose(0, 1)
    v_ext[docs.sinks, :, hd] = 1.0
    out = _varlen(q_ext, k_ext, v_ext, docs.cu_ext, docs.max_len, 1.0 / math.sqrt(hd))  # [L+D, heads, width]
    return out[rows, :, : hd + 1].transpose(0, 1)  # [heads, L, hd+1]


# The SDPA kernels the draft's attention may use: every one but cuDNN's. torch (2.5+) prefers cuDNN attention on
# Hopper, and cuDNN builds an execution plan for every new sequence length it sees (tens of ms each, forward and
# backward). Training samples of varying length meet a new length nearly every micro-batch: on an H200 that made the
# trainer ~10x slower per token than on samples of one length (benchmarks/train_varlen.py). Flash and
# memory-efficient attention take any length at no per-shape cost.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """[heads, Lq, d] x [heads, Lk, d] -> [heads, Lq, d]; causal when `mask` is None.

    A batch dimension of 1: the fused CUDA kernels want 4-D inputs; without it SDPA falls
    back to its fp32 math path. SDPA_BACKENDS says which kernels (not cuDNN's, and why).
    """
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None], is_causal=mask is None,
            scale=scale,
        )
    return out[0]
