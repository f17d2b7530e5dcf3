"""Reasoning models' thinking, split from the answer: Qwen3 and DeepSeek-R1 write `<think>…</think>` before the
reply (R1-style templates open the block in the prompt already, so only `…</think>` is generated). The thinking
becomes `reasoning_content`, the rest `content`, streamed or whole through one code path.

A block never closed (cut off by max_tokens) is all reasoning. Text before any `<think>` is the answer: a model
told not to think (Qwen3's enable_thinking=false renders an empty block into the prompt) starts with it.
"""
from __future__ import annotations

import re

from engine.server.tools import held_back

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "none", "qwen3", "deepseek_r1")  # --reasoning-parser: both named ones read <think> blocks
_OPEN_AT_END = re.compile(r"<think>(?:(?!</think>).)*\Z", re.S)


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a think block (the generation continues the thinking)."""
    return _OPEN_AT_END.search(prompt[-4096:]) is not None


def template_thinks(template: str | None) -> bool:
    """`auto`: a chat template that writes or strips </think> belongs to a reasoning model."""
    return bool(template) and CLOSE in template


class ThinkSplitter:
    """feed(delta) -> (reasoning, content) increments; finish() flushes what was held back (a possible partial tag).
    States: "start" (before the first visible text), "think", "answer"."""

    def __init__(self, open_in_prompt: bool):
        self.state = "think" if open_in_prompt else "start"
        self.buf = ""
        self.fresh = True  # at the start of a section: leading newlines are layout, not text

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if not head or OPEN.startswith(head):
                    return reasoning, content  # nothing yet, or maybe the start of <think>
                if head.startswith(OPEN):
                    self.buf, self.state, self.fresh = head[len(OPEN):], "think", True
                    continue
                self.state = "answer"
            if self.state == "think":
                if self.fresh:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        return reasoning, content
                    self.fresh = False
                at = self.buf.find(CLOSE)
                if at < 0:  # hold back a possible partial </think> and the newlines that may precede it
                    body = self.buf[: len(self.buf) - held_back(self.buf, CLOSE)]
                    body = body.rstrip("\n")
                    reasoning += body
                    self.buf = self.buf[len(body):]
                    return reasoning, content
                reasoning += self.buf[:at].rstrip("\n")
                self.buf, self.state, self.fresh = self.buf[at + len(CLOSE):], "answer", True
            if self.state == "answer":
                if self.fresh:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        return reasoning, content
                    self.fresh = False
                content += self.buf
                self.buf = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        buf, self.buf = self.buf, ""
        if self.state == "think":
            return buf.rstrip("\n") if not self.fresh else "", ""
        return "", buf if self.state == "answer" else buf.strip()

