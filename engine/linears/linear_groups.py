"""Linears that read one input, merged into one kernel call in compiled graphs.

A decoder layer's q, k and v projections read the same normed hidden state, and so do its
gate and up projections: SmolLM2's batch-1 step makes 211 linear calls, 121 once these
are merged. Every call allocates its output and forks and joins the threads (the
quantized kernel also quantizes its input rows), and k and v (192 outputs each) are too
small to keep two threads busy. `GroupSharedInputs`, an Inductor post-grad pass of the
compiled forward, replaces the calls of one C++ linear op in a graph that share their `x`
(`pagedserve::quantized_linear(x, h)`, `kernels/group_linear.cpp`, or
`pagedserve::bf16_linear(x, h)`, `kernels/bf16_linear.cpp`) with one call of that op's
group twin (`..._group(x, [h, ...])`), which runs every layer's output tiles in one
parallel loop into one output, the layers' outputs side by side (the quantized one
quantizes `x` once); each former call's result is a slice of it. (The ops return one
tensor, not a list: Inductor's C++ wrapper calls an op with a list result through
Python.)

Invariant: no bit changes. Both kernels compute each output element alone, in one fixed
order, from its row of `x` and its layer's weights, whichever call computes it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


class GroupSharedInputs(CustomGraphPass):
    """The post-grad pass described in the module docstring."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        users: dict[tuple[torch.fx.Node, str], list[torch.fx.Node]] = {}
        for node in graph.nodes:
            group_op = _group_op(node)
            if group_op is not None:
                users.setdefault((node.args[0], group_op), []).append(node)
        for (x, group_op), calls in users.items():
            if len(calls) > 1:
                _merge(graph, x, calls, getattr(torch.ops.pagedserve, group_op).default)
        graph.lint()

    def uuid(self) -> str:
        """Inductor's cache key for the pass: this file's source."""
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


# Each linear op that has a group twin, by name (a process that never loads a kernel
# never defines its ops, so nodes are matched by name), and the twin's name.
GROUP_OPS = {
    "pagedserve::quantized_linear": "quantized_linear_group",
    "pagedserve::bf16_linear": "bf16_linear_group",
}


def _group_op(node: torch.fx.Node) -> str | None:
    """The group twin's name of the linear op that `node` calls, or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return GROUP_OPS.get(target.name())


def _merge(
    graph: torch.fx.Graph, x: torch.fx.Node, calls: list[torch.fx.Node], group_op: Any
) -> None:
    """One `group_op` call in place of `calls` (in graph order), before the first of them."""
    results = [call.meta["val"] for call in calls]
    with results[0].fake_mode, graph.inserting_before(calls[0]):
        group = graph.call_function(group_op, (x, [call.args[1] for call in calls]))
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
