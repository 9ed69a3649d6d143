"""The `triton` attention backend (`TritonAttention`): paged attention and the K/V store as
Triton kernels, for CUDA.

`paged_attention` has the contract of the C++ kernel (`kernels.paged_attention`): packed
query rows `q [T, H, D]`, one layer's caches `[num_blocks, block_size, Hkv, D]` read in
place through `block_tables`, `query_start` and `context_lens`; decode rows and prefill
chunks, with or without a cached prefix, in one launch; optionally a sliding window, logit
softcapping and per-head attention sinks (see `paged_attention`). It reads the step's
lengths from device tensors only, so a launch whose tensors keep their shapes can be
captured in a CUDA graph. `store_kv` writes the step's new K/V into their slots and skips
negative slots (padding rows of a captured batch).

How a program works: program `(b, kv_head, tile)` takes `BLOCK_Q` query rows of sequence
`b` (rows `tile * BLOCK_Q` on of its chunk) times every query head of `kv_head`, flattened
into one `[BLOCK_Q * BLOCK_G, D]` tile, and walks the sequence's KV blocks from block 0
(with a window: from the block of the lowest position the tile's first row sees) with an
online softmax in fp32. A row gets the same bits whatever else is in its tile or batch: it
folds the blocks it sees in the same order, and folding a block it sees nothing of leaves
its running max, sum and accumulator bit-identical (also before its first visible block,
while its max is still -inf: such a fold shifts by 0, not by -inf). The tile shape is fixed
for every call, so a decode row and the same row in a prefill chunk go through the same
instructions. fp32 inputs multiply in IEEE fp32 (no TF32); fp16 and bf16 tiles multiply on
tensor cores with fp32 accumulation.

On a machine without CUDA the kernels run through Triton's interpreter
(`TRITON_INTERPRET=1`, set before this module is imported): that is how the tests run
them on the CPU. On CUDA they are `auto`'s backend; on an H100 they gave `generate()`'s
fp32 tokens and run-alone-equals-batched bf16 tokens (docs/gpu.md). Not yet tuned on the
card (tile sizes, warps, a split over long contexts).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.model.attention_metadata import AttentionFeatures, PagedAttentionMetadata

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Flattened query rows (rows x heads of a KV head) per program: tl.dot needs 16 or more.
TILE_ROWS = 32


def supports(dtype: torch.dtype, block_size: int) -> bool:
    """Whether the kernels take caches of this dtype and block size (a power of two >= 16)."""
    return dtype in SUPPORTED_DTYPES and block_size >= 16 and block_size & (block_size - 1) == 0


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonAttention:
    """The `triton` backend: `store_kv` and `paged_attention` over one layer of the KV
    tensor. Both read only the metadata's device tensors and `max_query_len`, so the decode
    graphs capture them (`captures`); the compiled forward (the CPU's) does not run them."""

    name = "triton"
    compiles = False
    captures = True

    def __init__(self, device: torch.device) -> None:
        """Nothing to prepare: Triton compiles each kernel at its first launch."""

    @staticmethod
    def unavailable_reason(
        device: torch.device, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        """Why the kernels cannot run for these: off CUDA (unless interpreted), or a dtype
        or block size they do not take."""
        if device.type != "cuda" and not interpreted():
            return "Triton attention runs on CUDA (on the CPU only under TRITON_INTERPRET=1)"
        if not supports(dtype, block_size):
            return (
                "the Triton kernels take fp32, fp16 or bf16 and a power-of-two block_size of "
                f"16 or more, not {dtype} with block_size {block_size}"
            )
        return None

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
    ) -> None:
        k_cache, v_cache = kv_cache[layer]
        store_kv(key, value, k_cache, v_cache, slots)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: PagedAttentionMetadata,
        scale: float,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[layer]
        return paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.context_lens, scale,
            meta.max_query_len, features.sliding_window, features.softcap, features.sinks,
        )  # fmt: skip


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    scale,
    window,
    softcap,
    sinks_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    row_begin = tl.load(query_start_ptr + seq)
    row_end = tl.load(query_start_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)
    first = row_begin + tile * BLOCK_Q
    if first >= row_end:
        return

    flat = tl.arange(0, BLOCK_Q * BLOCK_G)
    row = first + flat // BLOCK_G
    head_in_group = flat % BLOCK_G
    head = kv_head * GROUP + head_in_group
    valid = (row < row_end) & (head_in_group < GROUP)
    # A row's position: the chunk is the last rows of the context.
    position = context_len - row_end + row
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q_offsets = row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=valid[:, None] & dim_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)

    if HAS_SINKS:
        # The sink is one more logit whose probability is dropped: the softmax starts from
        # it (max = sink, sum = exp(sink - sink) = 1) and the accumulator never takes it.
        sink = tl.load(sinks_ptr + head, mask=head_in_group < GROUP, other=0.0)
        running_max = sink.to(tl.float32)
        running_sum = tl.full([BLOCK_Q * BLOCK_G], 1.0, dtype=tl.float32)
    else:
        running_max = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
        running_sum = tl.full([BLOCK_Q * BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    last_position = tl.minimum(first + BLOCK_Q, row_end) - 1 + context_len - row_end
    if HAS_WINDOW:
        # Row p sees positions p - window < t <= p; the tile's first row has the lowest p.
        first_position = first + context_len - row_end
        first_block = tl.maximum(first_position - window + 1, 0) // BLOCK_SIZE
    else:
        first_block = 0
    for block in range(first_block, last_position // BLOCK_SIZE + 1):
        block_id = tl.load(tables_ptr + seq * stride_table + block).to(tl.int64)
        k_offsets = (
            block_id * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        )
        key_position = block * BLOCK_SIZE + slots
        # Slots past the context may hold anything, NaN included: never load them.
        stored = (key_position[:, None] < context_len) & dim_ok[None, :]
        k = tl.load(k_ptr + k_offsets, mask=stored, other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        if IEEE:  # noqa: SIM108 (Triton compiles one branch; an if-expression is not one)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if HAS_SOFTCAP:
            # softcap * tanh(scores / softcap), from one exp of a non-positive argument (no
            # overflow); libdevice's tanh would not run in the interpreter.
            capped = scores / softcap
            decay = tl.exp(-2.0 * tl.abs(capped))
            magnitude = softcap * ((1.0 - decay) / (1.0 + decay))
            scores = tl.where(capped < 0, -magnitude, magnitude)
        visible = key_position[None, :] <= position[:, None]
        if HAS_WINDOW:
            visible = visible & (key_position[None, :] > position[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = new_max
        if HAS_WINDOW:
            # A row that has seen nothing yet (max still -inf: no sink, or a -inf one) and
            # sees nothing here would compute exp(-inf - -inf) = NaN: shift by 0 instead,
            # which leaves its sum and accumulator 0 (a -inf sink's 1 becomes its exp, 0).
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp(running_max - shift)
        weights = tl.exp(scores - shift[:, None])
        running_sum = running_sum * alpha + tl.sum(weights, axis=1)
        v_offsets = (
            block_id * stride_vb + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        )
        v = tl.load(v_ptr + v_offsets, mask=stored, other=0.0)
        if WIDEN:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(weights, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v)
        running_max = new_max

    out = acc / running_sum[:, None]
    out_offsets = row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(
        out_ptr + out_offsets,
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & dim_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a paged KV cache; the C++ kernel's contract (see module doc).

    `max_query_len` bounds the rows of any sequence in this call (1 for pure decode): it
    sets the grid, so a captured launch must pass the same value at every replay. The last
    dimension of q, k_cache and v_cache must be contiguous.

    The options, each off at its default and each a compile-time specialisation of the
    kernel (the default launch runs the code it ran before they existed):

    - `sliding_window`: with W >= 1, the row at position p sees the keys at positions t with
      p - W < t <= p (transformers' `sliding_window_overlay` on top of causal); 0: no window.
      A program starts at the first block its rows can see.
    - `softcap`: with c > 0, each score s = scale * <q, k> becomes c * tanh(s / c) before the
      softmax (Gemma 2's `attn_logit_softcapping`); 0.0: none.
    - `sinks`: a contiguous float32 `[H]` tensor on q's device, one logit per query head that
      joins head h's softmax and whose probability is dropped: exp(sinks[h] - max) adds to
      the denominator only (gpt-oss's `s_aux`); None: none. Read on the device, so a
      captured launch reads its values at replay.
    """
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
    num_heads, head_dim = q.shape[1:]
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if sinks is not None and (
        sinks.shape != (num_heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous()
    ):
        raise ValueError(
            f"sinks must be a contiguous float32 [{num_heads}] tensor, "
            f"got {sinks.dtype} {tuple(sinks.shape)}"
        )
    block_g = triton.next_power_of_2(group)
    block_q = max(1, TILE_ROWS // block_g)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # Triton's interpreter multiplies bf16 tiles wrongly (3.6 to 3.9 at least), so there
    # bf16 tiles are widened to fp32 first: the same products, which are exact in fp32.
    widen = q.dtype == torch.bfloat16 and interpreted()
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start,
        context_lens,
        scale,
        int(sliding_window),
        float(softcap),
        sinks,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim),
        IEEE=q.dtype == torch.float32 or widen,
        WIDEN=widen,
        HAS_WINDOW=sliding_window > 0,
        HAS_SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
    )
    return out


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_k_slot,
    stride_v_slot,
    HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offsets = tl.arange(0, BLOCK)
    inside = offsets < WIDTH
    head, dim = offsets // HEAD_DIM, offsets % HEAD_DIM
    key_offsets = token * stride_key_token + head * stride_key_head + dim
    value_offsets = token * stride_value_token + head * stride_value_head + dim
    key = tl.load(key_ptr + key_offsets, mask=inside)
    value = tl.load(value_ptr + value_offsets, mask=inside)
    tl.store(k_ptr + slot * stride_k_slot + offsets, key, mask=inside)
    tl.store(v_ptr + slot * stride_v_slot + offsets, value, mask=inside)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's `key[i]`, `value[i]` (`[T, Hkv, D]`) into slot `slot_mapping[i]`.

    Caches are `[num_blocks, block_size, Hkv, D]` with contiguous `[Hkv, D]` per slot; key
    and value need only a contiguous last dimension. A negative slot is skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    width = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        v_cache.stride(1),
        HEAD_DIM=head_dim,
        WIDTH=width,
        BLOCK=triton.next_power_of_2(width),
    )
