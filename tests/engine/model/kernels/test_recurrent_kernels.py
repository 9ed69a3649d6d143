"""The recurrent layers' C++ ops (causal convolution, gated delta rule, Mamba-2's
recurrence) against the torch reference, and the invariance prefix checkpoints rest on: a
sequence computed in one step, in chunks over several steps, or beside other sequences
gives the same bits, and a checkpoint holds exactly the state a run ending there leaves.

They build the kernel (once per machine, cached) and skip, naming the reason, where it
cannot be built."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.model.kernels import recurrent
from engine.model.recurrent import torch_ops
from engine.model.recurrent.state import RecurrentStates, RecurrentStep

REASON = recurrent.unavailable_reason(torch.device("cpu"))
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no C++ kernel: {REASON}")
SLOTS = 6
# The inputs with a row per packed token (the others are per layer).
ROWS = {"x", "q", "k", "v", "g", "beta", "dt", "b", "c"}


def _step(
    states: RecurrentStates,
    lengths: list[int],
    sources: list[int],
    checkpoints: tuple[tuple[int, int], ...] = (),
    slots: list[int] | None = None,
) -> RecurrentStep:
    """Sequence i of `lengths` from slot `sources[i]` into `slots[i]` (default: i);
    checkpoints are (row, slot)."""
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    rows = [row for row, _ in checkpoints] or [-1]
    targets = [slot for _, slot in checkpoints] or [0]
    return RecurrentStep(
        states, starts, torch.tensor(slots or list(range(len(lengths)))), torch.tensor(sources),
        torch.tensor(rows), torch.tensor(targets), use_kernel=True,
    )  # fmt: skip


def _conv(states: RecurrentStates, inputs: dict, step: RecurrentStep, kernel: bool):
    x, weight, bias = inputs["x"], inputs["weight"], inputs["bias"]
    if not kernel:
        return torch_ops.causal_conv(x, weight, bias, 1, step)
    return torch.ops.pagedserve.causal_conv(x, weight, bias, states.conv, 1, *_arrays(step))


def _delta(states: RecurrentStates, inputs: dict, step: RecurrentStep, kernel: bool):
    args = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    if not kernel:
        return torch_ops.gated_delta_rule(*args, 1, step)
    return torch.ops.pagedserve.gated_delta_rule(*args, states.ssm, 1, *_arrays(step))


def _ssd(states: RecurrentStates, inputs: dict, step: RecurrentStep, kernel: bool):
    args = [inputs[name] for name in ("x", "dt", "a", "b", "c", "d")]
    if not kernel:
        return torch_ops.ssd_scan(*args, 1, step)
    return torch.ops.pagedserve.ssd_scan(*args, states.ssm, 1, *_arrays(step))


def _arrays(step: RecurrentStep) -> list[torch.Tensor]:
    return [step.query_start, step.slots, step.sources, step.checkpoint_rows, step.checkpoint_slots]


def _conv_case(rows: int, channels: int, dtype: torch.dtype = torch.float32):
    states = RecurrentStates(torch.randn(2, SLOTS, 3, channels), None)
    inputs = {"x": torch.randn(rows, channels).to(dtype), "weight": torch.randn(4, channels),
              "bias": torch.randn(channels)}  # fmt: skip
    return states, inputs


def _delta_case(rows: int, value_dim: int):
    key_heads, value_heads, key_dim = 2, 4, 32
    q = torch.nn.functional.normalize(torch.randn(rows, key_heads, key_dim), dim=-1)
    inputs = {
        "q": q * key_dim**-0.5,
        "k": torch.nn.functional.normalize(torch.randn(rows, key_heads, key_dim), dim=-1),
        "v": torch.randn(rows, value_heads, value_dim),
        "g": -torch.rand(rows, value_heads),
        "beta": torch.rand(rows, value_heads),
    }
    ssm = torch.randn(2, SLOTS, value_heads, key_dim, value_dim) * 0.1
    return RecurrentStates(torch.zeros(2, SLOTS, 3, 4), ssm), inputs


def _ssd_case(rows: int, head_dim: int):
    heads, groups, state = 4, 2, 16
    inputs = {
        "x": torch.randn(rows, heads, head_dim), "dt": torch.rand(rows, heads),
        "a": -torch.rand(heads), "b": torch.randn(rows, groups, state),
        "c": torch.randn(rows, groups, state), "d": torch.randn(heads),
    }  # fmt: skip
    ssm = torch.randn(2, SLOTS, heads, state, head_dim) * 0.1
    return RecurrentStates(torch.zeros(2, SLOTS, 3, 4), ssm), inputs


Case = Callable[[int, int], tuple[RecurrentStates, dict]]
OPS: dict[str, tuple[Case, Callable, int]] = {
    "conv": (_conv_case, _conv, 48),
    "gated_delta_rule": (_delta_case, _delta, 48),
    "ssd_scan": (_ssd_case, _ssd, 48),
}


def _clone(states: RecurrentStates) -> RecurrentStates:
    return RecurrentStates(states.conv.clone(), None if states.ssm is None else states.ssm.clone())


def _state(states: RecurrentStates) -> torch.Tensor:
    return states.conv if states.ssm is None else states.ssm


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("width", [16, 8, 4])
def test_kernel_matches_the_torch_reference(op: str, width: int) -> None:
    torch.manual_seed(0)
    make, run, _ = OPS[op]
    states, inputs = make(15, 3 * width)
    # Three sequences: from an empty state, from another slot's, from their own slot's;
    # checkpoints after rows of the first and the last.
    step = _step(states, [5, 1, 9], [-1, 4, 2], [(2, 3), (10, 5)])
    expected_states = _clone(states)
    step_ref = _step(expected_states, [5, 1, 9], [-1, 4, 2], [(2, 3), (10, 5)])
    expected = run(expected_states, inputs, step_ref, kernel=False)
    actual = run(states, inputs, step, kernel=True)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_state(states), _state(expected_states), rtol=1e-5, atol=1e-5)


def test_convolution_reads_bf16_rows() -> None:
    torch.manual_seed(0)
    states, inputs = _conv_case(6, 32, torch.bfloat16)
    reference = _clone(states)
    expected = _conv(reference, inputs, _step(reference, [6], [-1]), kernel=False)
    actual = _conv(states, inputs, _step(states, [6], [-1]), kernel=True)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", list(OPS))
def test_chunks_steps_and_neighbours_do_not_change_bits(op: str) -> None:
    """Rows 0-19 of one sequence: in one step alone; in two steps (7 then 13 rows, the
    state in its slot in between) beside another sequence; and a checkpoint after row 6
    equals the state a 7-row run leaves."""
    torch.manual_seed(0)
    make, run, channels = OPS[op]
    states, inputs = make(20, channels)
    whole_states = _clone(states)
    whole = run(whole_states, inputs, _step(whole_states, [20], [-1], [(6, 4)]), True)

    chunked_states = _clone(states)
    head = {name: value[:7] if name in ROWS else value for name, value in inputs.items()}
    tail = {name: value[7:] if name in ROWS else value for name, value in inputs.items()}
    other = make(3, channels)[1]  # a neighbour of three rows, first in the batch
    first = run(chunked_states, head, _step(chunked_states, [7], [-1]), True)
    both = {
        name: torch.cat((other[name], value)) if name in ROWS else value
        for name, value in tail.items()
    }
    neighbour = _step(chunked_states, [3, 13], [-1, 0], slots=[2, 1])
    second = run(chunked_states, both, neighbour, True)[3:]
    assert torch.equal(torch.cat((first, second)), whole)
    assert torch.equal(_state(chunked_states)[1, 1], _state(whole_states)[1, 0])
    short_states = _clone(states)
    run(short_states, head, _step(short_states, [7], [-1]), True)
    assert torch.equal(_state(whole_states)[1, 4], _state(short_states)[1, 0])
