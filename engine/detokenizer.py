"""Incremental detokenization of generated token ids, and stop-string matching on the streamed text."""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context of the first output token, so that leading-space rules
# (SentencePiece's "▁" stripped at the start of a decode) see the same neighbours as a full decode.
PROMPT_CONTEXT = 5
# A UTF-8 character has at most 4 bytes and a (non-skipped) token at least 1, so a character cut at
# a position is resolved (completed or invalid) within the next 3 tokens: if the text up to that
# position survived all of them unchanged, it is final. Text held back for more than MAX_PENDING
# tokens is released at such a position, bounding the decode window (and the work per token) even
# for a long run of invalid bytes.
MAX_PENDING = 6
SETTLE_TOKENS = 3


class IncrementalDetokenizer:
    """Decodes only a small window of recent tokens per step (the vLLM/TGI prefix-offset /
    read-offset technique): the delta is decode(window) minus decode(already-emitted part of the
    window). A trailing U+FFFD means an incomplete UTF-8 sequence: it is held back until completed."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # The Rust decoder directly: no Python-side post-processing, a fraction of the cost.
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
            special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        else:
            self._decode = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
            special = set(getattr(tokenizer, "all_special_ids", ()))
        # Tokens the decode skips never enter the window: they add no bytes, so letting them count among the
        # SETTLE_TOKENS that resolve a cut character would release it early (e.g. as U+FFFD when an end-of-text
        # token falls between the two bytes of "¡").
        self._skipped = frozenset(special) if skip_special_tokens else frozenset()
        # _window holds the context tokens followed by the not-yet-emitted tokens (from _read on).
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)  # decode(_window[:_read])
        self._pieces: list[str] = []
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the newly completed text (possibly empty)."""
        if not token_ids:
            return ""
        self.num_tokens += len(token_ids)
        if self._skipped:
            token_ids = [t for t in token_ids if t not in self._skipped]
            if not token_ids:
                return ""
        self._window.extend(token_ids)
        new_text = self._decode(self._window)
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT):
            return self._emit(new_text, len(self._window))
        if len(self._window) - self._read > MAX_PENDING:
            # Release text up to `settled` only if no later prefix of the window rewrote it. (Length,
            # not prefix, check against the context text: a byte-fallback decoder turns a whole run
            # of byte tokens into U+FFFD once one is invalid, rewriting already-emitted context.)
            settled = len(self._window) - SETTLE_TOKENS
            head = self._decode(self._window[:settled])
            later = [self._decode(self._window[:m]) for m in range(settled + 1, len(self._window))]
            if len(head) >= len(self._prefix_text) and all(t.startswith(head) for t in later + [new_text]):
                return self._emit(head, settled)
        return ""

    def flush(self) -> str:
        """Release held-back text (an unfinished character becomes U+FFFD) when generation ends."""
        new_text = self._decode(self._window)
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text, len(self._window))

    def _emit(self, new_text: str, upto: int) -> str:
        # new_text decodes _window[:upto]; the tokens emitted now become the next left context.
        delta = new_text[len(self._prefix_text):]
        del self._window[: self._read]
        self._read = upto - self._read
        self._prefix_text = self._decode(self._window[: self._read])
        if delta:
            self._pieces.append(delta)
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text. Text that could still be the start of a stop string is
    held back, so emitted text never needs to be retracted. When several stop strings occur, the one
    that ends first wins (the result does not depend on how the text was split into deltas)."""

    def __init__(self, stop: tuple[str, ...], include_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.include_in_output = include_in_output
        self.stopped = False
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        buf = self._held + delta
        if not self.stop:
            return buf, False
        best: tuple[int, int] | None = None  # (end, start) of the earliest-ending match
        for s in self.stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        if best is not None:
            self.stopped = True
            self._held = ""
            return buf[: best[0] if self.include_in_output else best[1]], True
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Return the held-back text when generation ends for a reason other than a stop string."""
        held, self._held = self._held, ""
        return held
