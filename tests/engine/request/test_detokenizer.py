"""IncrementalDetokenizer: streamed deltas add up to the decoded text, never a broken char."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.request.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, ids_decoder
from tests.support.tiny_models import build_tokenizer

MULTI_BYTE = "é東京😀—"
ALPHABET = "ab .,\n" + MULTI_BYTE
fast = settings(max_examples=150, deadline=None)


def build_sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer: '▁' word marks, byte fallback, and a decoder that strips
    the leading space of the first word (so decoding a token alone loses its space)."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 4], trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    spec["model"]["byte_fallback"] = True
    decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    spec["decoder"] = json.loads(decoder.__getstate__())
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def byte_level_tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory
) -> PreTrainedTokenizerFast:
    if request.param == "tiny":
        return build_tokenizer(Path(tmp_path_factory.mktemp("tokenizer")))
    from engine.model.loader import resolve_model_folder

    return AutoTokenizer.from_pretrained(resolve_model_folder("default")[0])


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    return build_sentencepiece_tokenizer()


def stream(
    tokenizer, prompt: list[int], output: list[int], chunks: list[int], skip: bool = True
) -> tuple[list[str], list[str], str]:
    """Push `output` in chunks of the given sizes (then one by one); return the deltas, the
    emitted text after each push, and the text after flush()."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas, emitted = [], []
    position = 0
    for size in [*chunks, *[1] * len(output)]:
        if position >= len(output):
            break
        deltas.append(detok.push(output[position : position + size]))
        position += size
        emitted.append("".join(deltas))
    deltas.append(detok.flush())
    return deltas, emitted, "".join(deltas)


def fragment_ids(tokenizer) -> list[int]:
    """Token ids that hold parts of multi-byte characters, to make random ids hit them."""
    return sorted(set(tokenizer.encode(MULTI_BYTE * 2, add_special_tokens=False)))


@fast
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_exactly_the_decoded_text(
    byte_level_tokenizer, data: st.DataObject, skip: bool
) -> None:
    tokenizer = byte_level_tokenizer
    token = st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(fragment_ids(tokenizer)))
    output = data.draw(st.lists(token, max_size=30))
    prompt_text = data.draw(st.text(ALPHABET, max_size=12))
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=10))
    _, emitted, text = stream(tokenizer, prompt, output, chunks, skip)
    final = tokenizer.decode(output, skip_special_tokens=skip)
    assert text == final
    pushed = 0
    for size, shown in zip([*chunks, *[1] * len(output)], emitted, strict=False):
        pushed += size
        # Shown text is never taken back, and nothing decodable is held back: exactly the
        # text so far minus a trailing U+FFFD that more bytes could still complete.
        assert final.startswith(shown)
        decoded = tokenizer.decode(output[:pushed], skip_special_tokens=skip)
        assert shown == decoded.rstrip(REPLACEMENT_CHAR)


@fast
@given(prompt_text=st.text(ALPHABET, max_size=12), text=st.text(ALPHABET, max_size=30))
def test_clean_text_never_streams_a_replacement_char(
    byte_level_tokenizer, prompt_text: str, text: str
) -> None:
    tokenizer = byte_level_tokenizer
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    output = tokenizer.encode(text, add_special_tokens=False)
    deltas, _, final = stream(tokenizer, prompt, output, [])
    assert final == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_multi_byte_characters_are_held_until_complete(byte_level_tokenizer) -> None:
    tokenizer = byte_level_tokenizer
    output = tokenizer.encode("a😀", add_special_tokens=False)
    assert len(output) > 2, "the emoji must span several tokens for this test"
    deltas, _, text = stream(tokenizer, [], output, [])
    assert deltas[0] == "a" and set(deltas[1:-2]) == {""} and deltas[-2] == "😀"
    assert text == "a😀"


def test_prompt_ending_mid_character_gives_no_context(byte_level_tokenizer) -> None:
    tokenizer = byte_level_tokenizer
    ids = tokenizer.encode("x東", add_special_tokens=False)
    _, _, text = stream(tokenizer, ids[:-1], ids[-1:], [])
    assert text == tokenizer.decode(ids[-1:])


def test_flush_emits_a_dangling_partial_character(byte_level_tokenizer) -> None:
    tokenizer = byte_level_tokenizer
    partial = tokenizer.encode("東", add_special_tokens=False)[:-1]
    deltas, _, text = stream(tokenizer, [], partial, [])
    assert set(deltas[:-1]) == {""} and REPLACEMENT_CHAR in deltas[-1]
    assert text == tokenizer.decode(partial)


def test_sentencepiece_words_keep_their_spaces(sentencepiece_tokenizer) -> None:
    tokenizer = sentencepiece_tokenizer
    prompt = tokenizer.encode("The quick")
    output = tokenizer.encode("The quick brown fox 東京 😀 jumps")[2:]
    assert tokenizer.decode(output[:1]) == "brown", "a lone word token loses its space"
    deltas, _, text = stream(tokenizer, prompt, output, [])
    assert text == " brown fox 東京 😀 jumps"
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_skipped_special_tokens_do_not_eat_the_next_space(sentencepiece_tokenizer) -> None:
    tokenizer = sentencepiece_tokenizer
    brown, fox = tokenizer.encode("brown fox")
    eos = tokenizer.eos_token_id
    _, _, text = stream(tokenizer, tokenizer.encode("The"), [brown, eos, eos, fox], [])
    assert text == " brown fox"


def sentencepiece_pieces(tokenizer) -> list[list[int]]:
    """Units of output: each non-byte token, and the byte tokens of whole characters."""
    byte_ids = {tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    ordinary = [[i] for i in range(len(tokenizer)) if i not in byte_ids]
    ordinary = [p for p in ordinary if p[0] not in tokenizer.all_special_ids]
    chars = [[i for i in tokenizer.encode(c) if i in byte_ids] for c in MULTI_BYTE]
    return ordinary + chars


@fast
@given(data=st.data())
def test_sentencepiece_text_is_what_the_output_adds_to_the_prompt(
    sentencepiece_tokenizer, data: st.DataObject
) -> None:
    tokenizer = sentencepiece_tokenizer
    pieces = data.draw(st.lists(st.sampled_from(sentencepiece_pieces(tokenizer)), max_size=20))
    output = [i for piece in pieces for i in piece]
    prompt = tokenizer.encode(data.draw(st.text("ab .", max_size=10)))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=10))
    _, emitted, text = stream(tokenizer, prompt, output, chunks)
    prompt_text = tokenizer.decode(prompt)
    full = tokenizer.decode(prompt + output)
    assert full.startswith(prompt_text)
    assert text == full[len(prompt_text) :]
    assert all(text.startswith(shown) and not shown.endswith(REPLACEMENT_CHAR) for shown in emitted)


def test_the_rust_decode_serves_where_transformers_adds_nothing(
    byte_level_tokenizer, sentencepiece_tokenizer
) -> None:
    """The tests above compare the streamed text with `tokenizer.decode`: through the Rust
    tokenizer's own decode for these tokenizers, and through transformers' where it cleans
    up spaces after decoding."""
    for tokenizer in (byte_level_tokenizer, sentencepiece_tokenizer):
        assert ids_decoder(tokenizer, True).func == tokenizer.backend_tokenizer.decode
    cleaning = copy.deepcopy(sentencepiece_tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert ids_decoder(cleaning, True).func == cleaning.decode
    ids = cleaning.encode("The fox , jumps .", add_special_tokens=False)
    assert ids_decoder(cleaning, True)(ids) == cleaning.decode(ids, skip_special_tokens=True)
