"""A model's chat template as the chat endpoints use it: what it can render, found once by rendering probes (like
llama.cpp's template capabilities: tools, assistant tool calls, content as a list of parts), the tool-call format
and thinking it implies, and chat messages turned into what it expects.

A template that renders tools (Qwen2.5/3, Llama 3.1+, Mistral, Hermes) gets them as `tools`, earlier calls as
`tool_calls` (arguments as objects, which every such template accepts; a string would be encoded twice by the
`tojson` filter of Llama's and Mistral's) and results as `tool` messages. A template that does not (SmolLM2's)
gets the tool format's own instructions in the system message, earlier calls written into the assistant's text
and results as user turns wrapped in <tool_response>: the model is told and shown the format its output is read in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.server import reasoning
from engine.server.errors import bad_request
from engine.server.tools import FORMATS, Format, Function, Hermes, Llama3Json

PROBE = "dk_probe_7c41"
# apply_chat_template's own parameters: a request's chat_template_kwargs must not reach them
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                             "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                             "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message as both chat APIs deliver it (developer already mapped to system)."""
    role: str  # system | user | assistant | tool
    parts: tuple[str, ...] | None = None  # the text parts; None: no content
    listed: bool = False  # the content came as a list of parts
    name: str | None = None
    tool_calls: tuple[tuple[str, str, dict], ...] = ()  # (id, function name, arguments)
    tool_call_id: str | None = None
    reasoning: str | None = None

    @property
    def text(self) -> str:
        return "\n".join(self.parts or ())


@dataclass(frozen=True, slots=True)
class Capabilities:
    tools: bool  # renders `tools` and assistant `tool_calls`
    content_parts: bool  # renders content given as [{"type": "text", "text": ...}] itself


class ChatTemplate:
    def __init__(self, tokenizer, tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
        self.tokenizer = tokenizer
        source = getattr(tokenizer, "chat_template", None)
        self.source = source if isinstance(source, str) else json.dumps(source) if source else ""
        self.format: Format = FORMATS[tool_call_parser] if tool_call_parser != "auto" else self._detect_format()
        self.thinks = (reasoning_parser not in ("auto", "none") or
                       (reasoning_parser == "auto" and reasoning.template_thinks(self.source)))
        self._caps: Capabilities | None = None
        self._added = set(getattr(tokenizer, "get_added_vocab", dict)())

    @property
    def available(self) -> bool:
        return bool(self.source)

    def _detect_format(self) -> Format:
        if Hermes.OPEN in self.source:
            return FORMATS["hermes"]
        if Llama3Json.PYTHON_TAG in self.source or "ipython" in self.source:
            return FORMATS["llama3_json"]
        return FORMATS["hermes"]  # what our instructions teach a template without tools

    @property
    def caps(self) -> Capabilities:
        if self._caps is None:
            tool = {"type": "function", "function": {"name": PROBE, "description": "", "parameters": {}}}
            call = {"id": "c", "type": "function", "function": {"name": PROBE, "arguments": {}}}
            self._caps = Capabilities(
                tools=self._shows([{"role": "user", "content": "hi"}], tools=[tool]) and self._shows(
                    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]),
                content_parts=self._shows([{"role": "user", "content": [{"type": "text", "text": PROBE}]}],
                                          absent="'type'"))
        return self._caps

    def _shows(self, messages: list[dict], absent: str | None = None, **kw) -> bool:
        try:
            out = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        except Exception:  # noqa: BLE001 - a template that cannot take the probe does not have the capability
            return False
        return PROBE in out and (absent is None or absent not in out)

    def tag(self, text: str) -> str:
        """A format tag in a Lark grammar: the token itself when the tokenizer has it as one (llguidance matches
        added tokens only by reference), else the literal text."""
        token = text in self._added and text.startswith("<") and text.endswith(">")
        return text if token else json.dumps(text)  # Lark refers to a token <name> by its own text

    def render(self, messages: list[Message], functions: list[Function], *, add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict) -> str:
        bad = sorted(RESERVED_KWARGS & set(kwargs))
        if bad:
            raise bad_request(f"chat_template_kwargs must not set {', '.join(bad)}: they are request fields or "
                              "the renderer's own parameters", "chat_template_kwargs")
        if continue_final_message and (not messages or messages[-1].role != "assistant"):
            raise bad_request("continue_final_message needs an assistant message last, to continue it",
                              "continue_final_message")
        native = self.caps.tools
        convo = self._messages(messages, native, functions)
        extra = {"tools": [f.openai() for f in functions]} if functions and native else {}
        try:
            return self.tokenizer.apply_chat_template(
                convo, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **extra, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template raises whatever it likes ("roles must alternate")
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None

    def _messages(self, messages: list[Message], native: bool, functions: list[Function]) -> list[dict]:
        out: list[dict] = []
        for m in messages:
            d: dict = {"role": m.role, "content": self._content(m)}
            if m.name is not None:
                d["name"] = m.name
            if m.reasoning is not None:
                d["reasoning_content"] = m.reasoning
            if m.role == "tool" and not native:  # a user turn in the format's words; consecutive results merge
                text = f"<tool_response>\n{m.text}\n</tool_response>"
                if out and out[-1].get("_results"):
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "_results": True})
                continue
            if m.role == "tool" and m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls and native:
                d["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                   for i, n, a in m.tool_calls]
            elif m.tool_calls:
                written = self.format.write([(n, a) for _, n, a in m.tool_calls])
                d["content"] = f"{d['content']}\n{written}" if d["content"] else written
            out.append(d)
        for d in out:
            d.pop("_results", None)
        if functions and not native:
            told = self.format.instructions(functions)
            if out and out[0]["role"] == "system":
                first = out[0]["content"]
                first = (first + [{"type": "text", "text": told}] if isinstance(first, list)
                         else f"{first}\n\n{told}" if first else told)
                out[0] = {**out[0], "content": first}
            else:
                out.insert(0, {"role": "system", "content": told})
        return out

    def _content(self, m: Message):
        """Text parts as the template expects them: the list itself if it renders parts, else joined by
        newlines (what a template reading message['content'] as a string must get)."""
        if m.parts is None:
            return ""  # templates concatenate content: None would fail them
        if m.listed and self.caps.content_parts:
            return [{"type": "text", "text": t} for t in m.parts]
        return m.text
