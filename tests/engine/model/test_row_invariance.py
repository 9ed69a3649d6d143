"""Every module of the real model's forward gives each token row the same bits whether
the row is computed alone or packed with other sequences' rows.

Hooks record the output of every module (embedding, each projection, norm, rotary
embedding, attention, MLP, decoder layer, LM head) while the engine's model runs three
prompts, one of a single token, first each alone and then packed into one step. A
prompt of one token alone is a one-row step, the case the CPU's linears once computed
differently (see `engine.linears.packed_linear`). The first module whose rows differ is named.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain, pairwise
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM
from engine.model.attention_metadata import PagedAttentionMetadata

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Paged attention keeps keys and values in blocks of"]


@pytest.fixture(
    scope="module",
    params=[
        {"dtype": "bfloat16", "quantization": "none"},
        {"dtype": "float32", "quantization": "none"},
        {"attention_backend": "torch", "quantization": "none"},
        {},  # as served: the checkpoint's int4 in the CPU's dtype
    ],
    ids=["bf16", "fp32", "torch-attention", "served"],
)
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    yield LLM("default", kv_cache_memory="32MiB", max_model_len=256, **request.param)


def run_step(llm: LLM, prompts: list[list[int]], first_blocks: list[int]) -> dict[str, list]:
    """One forward over `prompts` packed in one step, prompt i in the blocks from
    `first_blocks[i]` on; returns every module's output, per prompt, in hook order."""
    engine = llm.engine
    block_size = engine.block_size
    counts = np.array([len(p) for p in prompts])
    starts = np.concatenate(([0], np.cumsum(counts)))
    widths = -(-counts // block_size)
    tables = np.zeros((len(prompts), widths.max()), dtype=np.int64)
    slots = []
    for i, (first, width, count) in enumerate(zip(first_blocks, widths, counts, strict=True)):
        tables[i, :width] = np.arange(first, first + width)
        slots += [first * block_size + t for t in range(count)]
    meta = PagedAttentionMetadata(
        kv_caches=engine.runner.kv_caches,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.from_numpy(tables),
        query_start=torch.from_numpy(starts),
        context_lens=torch.from_numpy(counts),
        query_start_host=starts,
        context_lens_host=counts,
        positions_host=np.concatenate([np.arange(c) for c in counts]),
        max_query_len=int(counts.max()),
    )
    recorded: dict[str, Any] = {}

    def hook(name: str):
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
                return
            if tensor.shape[0] == 1 and tensor.shape[1] == starts[-1]:  # one row per token
                recorded[name] = [tensor[0, a:b].clone() for a, b in pairwise(starts)]

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in engine.model.named_modules() if n]
    try:
        with torch.inference_mode():
            ids = torch.tensor([list(chain.from_iterable(prompts))])
            positions = torch.from_numpy(meta.positions_host)[None]
            engine.model(
                input_ids=ids, position_ids=positions, use_cache=False, paged_metadata=meta
            )
    finally:
        for handle in handles:
            handle.remove()
    return recorded


def test_every_module_is_row_invariant(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS] + [tokenizer.encode("Hello")[:1]]
    first_blocks = [0, 4, 8]
    alone = [run_step(llm, [p], [b]) for p, b in zip(prompts, first_blocks, strict=True)]
    together = run_step(llm, prompts, first_blocks)
    assert len(together) > 5 * llm.engine.model.config.num_hidden_layers  # hooks saw the layers
    for name, rows in together.items():  # in the order the forward ran them
        for i, row in enumerate(rows):
            assert torch.equal(row, alone[i][name][0]), f"{name} differs for prompt {i}"
