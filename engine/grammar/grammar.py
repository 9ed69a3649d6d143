"""Structured outputs through llguidance: constraints compiled to grammars, one matcher per
sample, and the token masks the sampler applies.

llguidance (the grammar engine of llama.cpp and of OpenAI-style structured outputs) was
chosen over xgrammar because it is one small wheel with no further dependencies, while
xgrammar pulls in Triton (+1 GB) on a CPU install; both compute a token mask in
microseconds. Its JSON schemas, regexes, Lark and GBNF grammars cover every constraint
the API offers.

Invariants: a grammar is validated against the model's tokenizer when the request comes
in (`GrammarCompiler.compile`), so a matcher made from it later cannot fail to build; a
sample's matcher has consumed exactly the sample's output tokens so far; the mask allows
the end-of-sequence tokens only where the grammar may end.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from engine.sampling.params import ReasoningBlock, StructuredOutputs

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# JSON without optional whitespace: small models given the freedom of whitespace tend to
# spend their whole budget on newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarCompiler:
    """Compiles `StructuredOutputs` into llguidance grammars for one model: the
    `ConstraintCompiler` of `engine.sampling.logits_constraint`, whose constraints are
    llguidance's matchers themselves.

    Thread-safe. llguidance's view of the tokenizer is built once, when the compiler is
    made, and shared by every grammar: built at the first structured request instead, it
    would hold the GIL on the intake thread and stall every running stream meanwhile
    (`python -m bench.first_structured` measures that stall).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )

    def compile(self, spec: StructuredOutputs, prompt_token_ids: Sequence[int] = ()) -> str:
        """The grammar text of a reply to the prompt `prompt_token_ids` (which decides
        where a reasoning model's reply begins, see `ReasoningBlock`); raises ValueError
        naming what the grammar engine refused."""
        try:
            grammar = _grammar_text(spec)
        except (ValueError, TypeError) as exc:  # llguidance's own parse errors
            raise ValueError(f"structured_outputs: {spec.kind}: {exc}") from None
        if spec.reasoning is not None:
            opening = spec.reasoning.opening(prompt_token_ids)
            if opening != "after":
                grammar = after_reasoning(grammar, spec.reasoning, opening == "inside")
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured_outputs: {spec.kind}: {error.strip()}")
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar` (from `compile`)."""
        return llguidance.LLMatcher(self.ll_tokenizer, grammar)

    def mask_logits(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        matchers: Sequence[llguidance.LLMatcher],
    ) -> None:
        """See `mask_logits`."""
        mask_logits(logits, rows, matchers)


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
    return llguidance.grammar_from("lark", text)


def after_reasoning(answer: str, block: ReasoningBlock, inside: bool) -> str:
    """The grammar `answer` (as `_grammar_text` makes it) after free thinking: text up to
    `</think>` when the reply begins `inside` it, else an optional `<think>` ... `</think>`
    block; whitespace may follow. The answer becomes a subgrammar of its own (llguidance's
    `@name`), so a grammar of any kind composes, JSON schemas and Lark alike.

    The thinking is text: no special token but the `</think>` that ends it, and the first
    `</think>`, token or spelling, ends it, where the reasoning parser splits the reply.
    """
    if answer.lstrip().startswith("{"):
        top = json.loads(answer)
    else:
        top = {"grammars": [{"lark_grammar": answer}]}
    grammars = top["grammars"]
    grammars[0] = {**grammars[0], "name": "answer"}
    end = json.dumps(block.END)
    thought = "thought_text"
    rules = [
        "%llguidance {}",
        f"thought_text[lazy]: /(?s:.*)/ {end}",
        "SPACE: /[ \\t\\r\\n]+/",
    ]
    if block.end_id is not None:
        # Text without the spelt marker, then the marker's token.
        thought = f"thought_text | THOUGHT? <[{block.end_id}]>"
        spelt = block.END.replace("/", "\\/")
        rules.append(f"THOUGHT: /(?s:.+)/ & ~/(?s:.*){spelt}(?s:.*)/")
    rules.append(f"thought: ({thought}) SPACE?")
    if inside:
        rules.append("start: thought @answer")
    else:
        start = json.dumps(block.START)
        if block.start_id is not None:
            start = f"{start} | <[{block.start_id}]>"
        rules += [f"open: {start}", "start: (open thought)? @answer"]
    reply = {"name": "reply", "lark_grammar": "\n".join(rules) + "\n"}
    return json.dumps({**top, "grammars": [reply, *grammars]})


def _grammar_text(spec: StructuredOutputs) -> str:
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS
        )
    if spec.regex is not None:
        return llguidance.grammar_from("regex", spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)


def mask_logits(
    logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[llguidance.LLMatcher]
) -> None:
    """Set to -inf, in place, every logit of row `rows[i]` that `matchers[i]` forbids next."""
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), logits.shape[1])
    for i, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i)
    if list(rows) == list(range(logits.shape[0])):
        apply_token_bitmask(logits, bitmask)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    constrained = logits[index]
    apply_token_bitmask(constrained, bitmask)
    logits[index] = constrained


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of `logits` [rows, vocab] that `bitmask` forbids;
    the allowed ones stay as they are.

    `bitmask` [rows, words] is int32 as llguidance fills it: token t is allowed where bit
    t % 32 of word t // 32 is set; a token past the mask's 32 * words bits is forbidden.
    This is llguidance's `apply_token_bitmask_inplace` in plain tensor ops: llguidance's
    own wraps it in `torch.compile`, which would trace and compile C++ on the engine thread
    at the first constrained step (seconds, every stream frozen) and fail without a
    compiler. The words go to the logits' device (4 bytes per 32 tokens) and are unpacked
    there, every row at once, in a shift, an `and` and a compare; one `masked_fill_` then
    does the rest; on the CPU the fill is most of the cost.
    """
    num_rows, vocab = logits.shape
    if bitmask.shape[0] != num_rows:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {num_rows} rows of logits")
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    forbidden = (((words.unsqueeze(-1) >> shifts) & 1) == 0).view(num_rows, -1)
    covered = min(vocab, forbidden.shape[1])
    logits[:, :covered].masked_fill_(forbidden[:, :covered], float("-inf"))
    logits[:, covered:] = float("-inf")
