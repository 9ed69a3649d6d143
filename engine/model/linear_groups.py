"""Quantized linears that read one input, merged into one kernel call in compiled graphs.

A decoder layer's q, k and v projections read the same normed hidden state, and so do its
gate and up projections: SmolLM2's batch-1 step makes 211 quantized linear calls, 121
once these are merged. Every call quantizes its input rows, allocates its output and
forks and joins the threads, and k and v (192 outputs each) are too small to keep two
threads busy. `GroupSharedInputs`, an Inductor post-grad pass of the compiled forward,
replaces the `pagedserve::quantized_linear(x, h)` calls of a graph that share their `x`
with one `pagedserve::quantized_linear_group(x, [h, ...])`, which quantizes `x` once and
runs every layer's output tiles in one parallel loop (`kernels/group_linear.cpp`) into
one output, the layers' outputs side by side; each former call's result is a slice of
it. (The op returns one tensor, not a list: Inductor's C++ wrapper calls an op with a
list result through Python.)

Invariant: no bit changes. The kernel computes each output element alone, in one fixed
order, from its row of `x` and its layer's weights, whichever call computes it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


class GroupSharedInputs(CustomGraphPass):
    """The post-grad pass described in the module docstring."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        users: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if _is_quantized_linear(node):
                users.setdefault(node.args[0], []).append(node)
        for x, calls in users.items():
            if len(calls) > 1:
                _merge(graph, x, calls)
        graph.lint()

    def uuid(self) -> str:
        """Inductor's cache key for the pass: this file's source."""
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _is_quantized_linear(node: torch.fx.Node) -> bool:
    """Whether `node` calls `pagedserve::quantized_linear` (by name: an unquantized model's
    process never loads the op)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.name() == "pagedserve::quantized_linear"
    )


def _merge(graph: torch.fx.Graph, x: torch.fx.Node, calls: list[torch.fx.Node]) -> None:
    """One group call in place of `calls` (in graph order), before the first of them."""
    results = [call.meta["val"] for call in calls]
    with results[0].fake_mode, graph.inserting_before(calls[0]):
        group = graph.call_function(
            torch.ops.pagedserve.quantized_linear_group.default,
            (x, [call.args[1] for call in calls]),
        )
        group.meta["val"] = torch.cat(results, dim=-1)
        start = 0
        for call, result in zip(calls, results, strict=True):
            end = start + result.shape[-1]
            piece = graph.call_function(torch.ops.aten.slice.Tensor, (group, -1, start, end))
            piece.meta["val"] = group.meta["val"][..., start:end]
            call.replace_all_uses_with(piece)
            start = end
    for call in calls:
        graph.erase_node(call)
