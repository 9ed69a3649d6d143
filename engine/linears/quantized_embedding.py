"""An embedding table held in a group-quantized format: a GGUF's token embedding as stored.

llama.cpp keeps `token_embd` in its file's type and dequantizes the rows a batch looks
up; so does this layer (`pagedserve::quantized_embedding`, `kernels/group_linear.cpp`), so
a 1B model's 128,256 x 2,048 table takes 6.6 bits a weight (Q6_K) rather than 32. The table
is a `QuantizedLinear`'s weight, read through its registered handle (a constant in compiled
graphs, as the linears' are, rather than tensors whose sizes a graph would trace): the
model's LM head itself where it is tied to the embedding (Llama 3.2 1B and 3B, Qwen2.5 3B),
else a layer of its own that is never called as a linear. Rows come out as GGML
dequantizes them, in fp32, rounded once to the model's dtype, then times the embedding's
own scale where the model has one (Gemma's `embed_scale`), as transformers' scaled
embedding computes it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.linears.quantized_linear import QuantizedLinear

_fake_registered = False


class QuantizedEmbedding(nn.Module):
    """`table.weight[ids]` (times `embed_scale` where set), in `dtype`."""

    def __init__(
        self, table: QuantizedLinear, dtype: torch.dtype, embed_scale: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        _register_fake()
        self.table = table
        self.dtype = dtype
        self.num_embeddings = table.out_features
        self.embedding_dim = table.in_features
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.pagedserve.quantized_embedding(ids, self.table.handle).to(self.dtype)
        if self.embed_scale is None:
            return rows
        return rows * self.embed_scale.to(self.dtype)

    @property
    def weight(self):
        """The packed table (`group_linear.PackedWeight`)."""
        return self.table.weight

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.bits}-bit codes"


def _register_fake() -> None:
    global _fake_registered
    if not _fake_registered:
        torch.library.register_fake("pagedserve::quantized_embedding")(_fake_embedding)
        _fake_registered = True


def _fake_embedding(ids: torch.Tensor, handle: int) -> torch.Tensor:
    from engine.linears.opaque_linear import layer

    return ids.new_empty(*ids.shape, layer(handle).in_features, dtype=torch.float32)
