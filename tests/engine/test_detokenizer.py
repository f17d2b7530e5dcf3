"""Incremental detokenization (byte-level and SentencePiece-style BPE tokenizers built here) and stop strings."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

CORPUS = [
    "Hello world, this is a small test of the tokenizer.",
    "Café crème brûlée à la française, naïve façade, Ünïcödé ñ ß ø å.",
    "日本語のテキストと中文文本混合。한국어 텍스트도 있습니다.",
    "Emoji time 🙂🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷 — “quotes” … done.",
]
FFFD = "\ufffd"


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2/Qwen style: every byte is a token symbol, spaces are part of the following token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A vocabulary this small leaves most accented, CJK and emoji characters split over several byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """Llama style: "▁" marks a word start and is stripped at the start of a decode; unknown
    characters fall back to <0xNN> byte tokens."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    # The byte tokens are ordinary vocabulary entries (as in Llama), so skip_special_tokens keeps them.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False, name_or_path="sentencepiece")


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    return byte_level_bpe() if request.param == "byte_level" else sentencepiece_bpe()


def stream(tok, prompt: list[int], ids: list[int], cuts: list[int], skip: bool = True):
    """Feed ids in chunks split at `cuts`; return (deltas, detokenizer)."""
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    deltas = [det.add(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return deltas, det


token_lists = st.lists(st.integers(0, 10**6), max_size=40)  # taken modulo the vocabulary size
cut_lists = st.lists(st.integers(0, 1000), max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=token_lists, cuts=cut_lists)
def test_random_tokens_stream_to_the_full_decode(tokenizer, ids, cuts):
    ids = [i % len(tokenizer) for i in ids]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    deltas, det = stream(tokenizer, [], ids, cuts)
    tail = det.flush()
    if FFFD not in full:
        assert "".join(deltas) == det.text == full
        assert tail == ""
        assert not any(FFFD in d for d in deltas)
    elif tokenizer.name_or_path != "sentencepiece":
        # Byte-level decoding replaces invalid bytes locally, so even broken output matches. (A
        # byte-fallback decoder turns a whole run of byte tokens into U+FFFD once any is invalid,
        # which a stream that already emitted the valid start of the run cannot reproduce.)
        assert "".join(deltas) + tail == det.text == full


def test_skipped_special_tokens_between_the_bytes_of_a_character():
    """Found by the property test above: seven end-of-text tokens (skipped) between the two bytes of "¡" must not
    count as the tokens that settle the cut character, or it is released as U+FFFD."""
    tok = byte_level_bpe()
    lead, cont = tok.convert_tokens_to_ids("Â"), tok.convert_tokens_to_ids("¡")  # bytes 0xC2, 0xA1
    ids = [lead] + [tok.eos_token_id] * 7 + [cont]
    assert tok.decode(ids, skip_special_tokens=True) == "¡"
    deltas, det = stream(tok, [], ids, list(range(len(ids) + 1)))  # one token per step
    assert "".join(deltas) == det.text == "¡" and det.flush() == ""
    assert det.num_tokens == len(ids)
    # Not skipped, the special token is text of its own and settles the lone byte as U+FFFD, as a full decode does.
    kept, det = stream(tok, [], ids, list(range(len(ids) + 1)), skip=False)
    assert "".join(kept) + det.flush() == tok.decode(ids, skip_special_tokens=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8"), max_size=60), cuts=cut_lists, prompt=st.sampled_from(CORPUS))
@pytest.mark.slow
def test_encoded_text_streams_back_exactly_after_a_prompt(tokenizer, text, cuts, prompt):
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(text)
    prompt_text = tokenizer.decode(prompt_ids)
    full = tokenizer.decode(prompt_ids + ids)
    assert full.startswith(prompt_text)
    deltas, det = stream(tokenizer, prompt_ids, ids, cuts)
    tail = det.flush()  # a literal U+FFFD at the very end is indistinguishable from a cut character
    assert "".join(deltas) + tail == full[len(prompt_text):]
    if FFFD not in text:
        assert tail == ""
        assert not any(FFFD in d for d in deltas)


def test_emoji_split_over_byte_tokens_is_emitted_whole(tokenizer):
    ids = tokenizer.encode(" a🦀b")
    assert len(ids) >= 5  # 🦀 is absent from the corpus: four single-byte tokens
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    deltas = [det.add([i]) for i in ids]
    assert [d for d in deltas if d] == [" a", "🦀", "b"]


def test_leading_space_of_first_output_token_is_kept(tokenizer):
    prompt = tokenizer.encode("Hello")
    out = tokenizer.encode(" world")
    assert tokenizer.decode(prompt + out) == "Hello world"
    det = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(det.add([t]) for t in out) == " world"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode(" Hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    prompt = tokenizer.encode("Hello")
    skipped, _ = stream(tokenizer, prompt, ids, list(range(len(ids))))
    kept, _ = stream(tokenizer, prompt, ids, list(range(len(ids))), skip=False)
    assert "".join(skipped) == " Hi there"
    assert "".join(kept) == f" Hi{tokenizer.eos_token} there"


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call receives."""

    def __init__(self, tok):
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_work_per_token_stays_bounded(tokenizer):
    # 0x80 is a lone continuation byte: every prefix of this output ends in U+FFFD, the worst case
    # for holding text back. The decode window must still stay small.
    lone = next(t for t in range(len(tokenizer))
                if tokenizer.decode([t]) == FFFD and tokenizer.decode([t, t]) == FFFD * 2)
    ids = (tokenizer.encode(" 日本語のテキスト") + [lone] * 50) * 20
    prompt = tokenizer.encode("Hello")
    counting = CountingTokenizer(tokenizer)
    det = IncrementalDetokenizer(counting, prompt)
    for t in ids:
        det.add([t])
    assert max(counting.sizes) <= 16
    assert det.text + det.flush() == tokenizer.decode(prompt + ids)[len("Hello"):]


STOPS = ["</s>", "STOP", "ab", "b c", "日本", "🙂x"]


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, end) of the stop string that is complete earliest when reading text left to right."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            longest = max(hits, key=len)
            return end - len(longest), end
    return None


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(st.sampled_from(STOPS + ["a", "b", " ", "S", "TO", "日", "🙂"]),
                                st.text(max_size=4)), max_size=12),
       stops=st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True),
       include=st.booleans(), cuts=cut_lists)
def test_stop_strings_spanning_deltas(parts, stops, include, cuts):
    text = "".join(parts)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    matcher = StopStringMatcher(tuple(stops), include_in_output=include)
    emitted, hit = [], False
    for a, b in zip(bounds, bounds[1:]):
        out, hit = matcher.feed(text[a:b])
        emitted.append(out)
        if hit:
            break
    match = first_stop(text, tuple(stops))
    if match is None:
        assert not hit
        assert "".join(emitted) + matcher.flush() == text
    else:
        assert hit
        assert "".join(emitted) == text[: match[1] if include else match[0]]
        assert matcher.feed("more text") == ("", True)


def test_stop_string_split_over_tokens_cuts_output(tokenizer):
    ids = tokenizer.encode(" world, STOP here")
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    matcher = StopStringMatcher(("STOP",))
    emitted = []
    for t in ids:
        out, hit = matcher.feed(det.add([t]))
        emitted.append(out)
        if hit:
            break
    assert hit
    assert "".join(emitted) == " world, "


def test_held_back_prefix_is_flushed():
    matcher = StopStringMatcher(("</answer>",))
    assert matcher.feed("42 </ans") == ("42 ", False)
    assert matcher.feed("") == ("", False)
    assert matcher.flush() == "</ans"
    assert matcher.flush() == ""


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher(())
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_token_bytes_follow_the_tokenizers_decoder():
    """Chat logprobs carry each token's bytes: a byte-level BPE piece maps through GPT-2's alphabet, a SentencePiece
    piece is its text with "▁" as a space (not Latin-1), a byte-fallback piece is that byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.tokenizer import token_bytes
    vocab = {"<unk>": 0, "<0xC3>": 1, "▁the": 2, "é": 3, "▁": 4, "t": 5, "h": 6, "e": 7}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=sp)
    assert token_bytes(tok, 2) == b" the" and token_bytes(tok, 3) == "é".encode() and token_bytes(tok, 1) == b"\xc3"
    from engine.tinymodel import train_tokenizer
    bpe = train_tokenizer()
    ids = bpe.encode("Café 🚀", add_special_tokens=False)
    assert b"".join(token_bytes(bpe, i) for i in ids) == "Café 🚀".encode()
