"""One forward of a transformers model over a packed step, the call every step path makes.

The eager runner, the decode graphs and the compiled forward all run the model through
`model_logits`, so they differ only in how the step's inputs reach it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.attention_metadata import PagedAttentionMetadata


def model_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_index: torch.Tensor,
    metadata: PagedAttentionMetadata,
) -> torch.Tensor:
    """`(input ids [1, T], positions [1, T], logits index [S], metadata) -> logits [S,
    vocab]` in the model's dtype: the step's tokens as one sequence whose attention the
    paged implementation splits by `metadata`, logits only at `logits_index`."""
    output = model(
        input_ids=input_ids,
        position_ids=positions,
        logits_to_keep=logits_index,
        use_cache=False,
        paged_metadata=metadata,
    )
    return output.logits[0]
