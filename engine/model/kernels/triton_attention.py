"""Paged attention and the K/V store as Triton kernels, for CUDA.

`paged_attention` has the contract of the C++ kernel (`kernels.paged_attention`): packed
query rows `q [T, H, D]`, one layer's caches `[num_blocks, block_size, Hkv, D]` read in
place through `block_tables`, `query_start` and `context_lens`; decode rows and prefill
chunks, with or without a cached prefix, in one launch. It reads the step's lengths from
device tensors only, so a launch whose tensors keep their shapes can be captured in a CUDA
graph. `store_kv` writes the step's new K/V into their slots and skips negative slots
(padding rows of a captured batch).

How a program works: program `(b, kv_head, tile)` takes `BLOCK_Q` query rows of sequence
`b` (rows `tile * BLOCK_Q` on of its chunk) times every query head of `kv_head`, flattened
into one `[BLOCK_Q * BLOCK_G, D]` tile, and walks the sequence's KV blocks from block 0 with
an online softmax in fp32. Every row folds the same blocks in the same order whatever else
is in its tile or batch: blocks past a row's position are all masked, and folding an
all-masked block leaves its running max, sum and accumulator bit-identical. The tile shape
is fixed for every call, so a decode row and the same row in a prefill chunk go through the
same instructions. fp32 inputs multiply in IEEE fp32 (no TF32); fp16 and bf16 tiles
multiply on tensor cores with fp32 accumulation.

On a machine without CUDA the kernels run through Triton's interpreter
(`TRITON_INTERPRET=1`, set before this module is imported): that is how the tests run
them on the CPU. Neither kernel has run on a GPU in this project yet.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Flattened query rows (rows x heads of a KV head) per program: tl.dot needs 16 or more.
TILE_ROWS = 32


def supports(dtype: torch.dtype, block_size: int) -> bool:
    """Whether the kernels take caches of this dtype and block size (a power of two >= 16)."""
    return dtype in SUPPORTED_DTYPES and block_size >= 16 and block_size & (block_size - 1) == 0


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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

    running_max = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.full([BLOCK_Q * BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    last_position = tl.minimum(first + BLOCK_Q, row_end) - 1 + context_len - row_end
    for block in range(0, last_position // BLOCK_SIZE + 1):
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
        visible = key_position[None, :] <= position[:, None]
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
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
) -> torch.Tensor:
    """Causal attention over a paged KV cache; the C++ kernel's contract (see module doc).

    `max_query_len` bounds the rows of any sequence in this call (1 for pure decode): it
    sets the grid, so a captured launch must pass the same value at every replay. The last
    dimension of q, k_cache and v_cache must be contiguous.
    """
    num_heads, head_dim = q.shape[1:]
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
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
