"""Tool calls in the output formats models are trained on, each with its parser (whole text or streamed), the
grammar that forces a call (tool_choice `required` or a named function), and the instructions that describe the
tools when a model's chat template cannot render them itself:

  hermes       Hermes / Qwen2.5 / Qwen3:  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>  (repeated)
  llama3_json  Llama 3.1+:                {"name": ..., "parameters": {...}}  (several joined by "; ")

Streaming and whole-text parsing are one code path (a whole text is fed as one delta), so a stream always adds up
to the non-streaming answer. Text that is not a well-formed call stays content: nothing the model wrote is lost.
A Hermes call whose JSON opens with `{"name": ..., "arguments": {` streams its arguments as the model writes them
(OpenAI's delta shape: the first piece carries the call's id and name, later ones only text); from then on it is a
call, and what the model writes after the arguments object, before </tool_call>, is dropped. Other calls stream
as one piece when they are complete.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engine import grammar

MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class Function:
    """A function the request offers the model."""
    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: {"type": "object"})  # JSON Schema of the arguments
    strict: bool = False

    def openai(self) -> dict:
        """The chat-completions form templates are written for."""
        fn: dict = {"name": self.name}  # in OpenAI's order: templates print the object as it is
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ArgsPiece:
    """A piece of a call's arguments text as it streams; every call's pieces add up to its `arguments`."""
    index: int  # the call's position among the reply's calls
    id: str
    name: str
    text: str
    first: bool  # the piece that announces the call (with id and name)


@dataclass(slots=True)
class Parsed:
    """What one delta of model text turned into: content, calls completed in it (whole), and the pieces of
    arguments it streamed (for streaming responses)."""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    pieces: list[ArgsPiece] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        self.pieces += other.pieces
        return self


def _call(obj, args_key: str) -> ToolCall | None:
    """{"name": str, args_key: object} -> a call; anything else is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text that may be the start of the
    tag, held back until the next delta settles it."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Format:
    name = ""
    args_key = "arguments"

    def stream(self) -> Stream:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        s = self.stream()
        return s.feed(text).add(s.finish())

    def call_schema(self, fn: Function) -> dict:
        """The JSON Schema of one call of `fn` in this format."""
        return {"type": "object", "properties": {"name": {"const": fn.name}, self.args_key: fn.parameters},
                "required": ["name", self.args_key], "additionalProperties": False}

    def calls_rule(self, functions: list[Function], parallel: bool, tag) -> str:
        """Lark rules `calls: ...` forcing one call (or, with parallel, one or more) of the given functions.
        `tag(text)` spells a format tag: the tokenizer's single token for it when it has one."""
        raise NotImplementedError

    def instructions(self, functions: list[Function]) -> str:
        """How to call the tools, for a template that cannot list them (added to the system message)."""
        raise NotImplementedError

    def write(self, calls: list[tuple[str, dict]]) -> str:
        """Earlier calls (name, arguments) as the model writes them, for a template that cannot render them."""
        raise NotImplementedError


def _any_call(fmt: Format, functions: list[Function]) -> str:
    # one %json with anyOf, not one rule per function: llguidance documents alternatives of %json as unsupported
    return grammar.lark_json({"anyOf": [fmt.call_schema(f) for f in functions]})


def _listing(functions: list[Function]) -> str:
    return "\n".join(json.dumps(f.openai(), ensure_ascii=False) for f in functions)


class Hermes(Format):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def stream(self) -> Stream:
        return _TaggedStream(self.OPEN, self.CLOSE)

    def calls_rule(self, functions: list[Function], parallel: bool, tag) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (f"calls: call{more}\ncall: {tag(self.OPEN)} \"\\n\" call_body \"\\n\" {tag(self.CLOSE)}\n"
                f"call_body: {_any_call(self, functions)}")

    def instructions(self, functions: list[Function]) -> str:
        return ("You can call functions. To call one, answer with a block like this, one block per call:\n"
                f'{self.OPEN}\n{{"name": "function name", "arguments": {{"parameter": "value"}}}}\n{self.CLOSE}\n'
                f"The functions (JSON Schema), one per line:\n<tools>\n{_listing(functions)}\n</tools>")

    def write(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(f"{self.OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{self.CLOSE}"
                         for n, a in calls)


class Llama3Json(Format):
    name = "llama3_json"
    args_key = "parameters"
    PYTHON_TAG = "<|python_tag|>"  # a special token: skipped by the detokenizer, stripped here if it shows

    def stream(self) -> Stream:
        return _JsonStream(self.args_key, self.PYTHON_TAG)

    def calls_rule(self, functions: list[Function], parallel: bool, tag) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"calls: call{more}\ncall: {_any_call(self, functions)}"

    def instructions(self, functions: list[Function]) -> str:
        return ("You can call functions. To call one, answer with only a JSON object "
                '{"name": function name, "parameters": {argument name: value}}; separate several calls with "; ".\n'
                f"The functions (JSON Schema), one per line:\n{_listing(functions)}")

    def write(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


FORMATS: dict[str, Format] = {f.name: f for f in (Hermes(), Llama3Json())}


class Stream:
    def __init__(self):
        self.count = 0  # calls announced so far

    def feed(self, delta: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError

    def _whole(self, out: Parsed, call: ToolCall) -> None:
        """A call complete at once: one piece with all its arguments."""
        out.calls.append(call)
        out.pieces.append(ArgsPiece(self.count, call.id, call.name, call.arguments, True))
        self.count += 1


# the head of a Hermes call whose arguments are an object: they can stream from its `{`
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class _Args:
    """The arguments object of a call being streamed: where it starts in the buffer, how much was sent, and a
    brace count (outside strings) that finds where it closes."""

    __slots__ = ("call", "start", "sent", "end", "scanned", "depth", "in_str", "esc")

    def __init__(self, call: ToolCall, start: int):
        self.call, self.start, self.sent, self.end = call, start, start, None
        self.scanned, self.depth, self.in_str, self.esc = start, 0, False, False

    def scan(self, text: str, limit: int) -> None:
        i = self.scanned
        while self.end is None and i < limit:
            ch = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch == "{":
                self.depth += 1
            elif ch == "}":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            i += 1
        self.scanned = i

    def piece(self, text: str, limit: int, index: int) -> ArgsPiece | None:
        """The arguments text after what was sent, up to `limit` (or the object's close)."""
        self.scan(text, limit)
        upto = self.end if self.end is not None else limit
        if upto <= self.sent:
            return None
        piece = text[self.sent:upto]
        self.sent = upto
        return ArgsPiece(index, self.call.id, self.call.name, piece, False)


class _TaggedStream(Stream):
    """Content until an opening tag; each tagged block's JSON becomes a call when its closing tag arrives (its
    arguments stream before that when the block opens as a call). A possible partial tag at the end of a delta is
    held back until the next one settles it."""

    def __init__(self, open_tag: str, close_tag: str):
        super().__init__()
        self.open, self.close = open_tag, close_tag
        self.buf = ""
        self.in_call = False
        self.args: _Args | None = None  # the call whose arguments are streaming
        self.called = False  # after a call, whitespace (between calls, before the end) is not content

    def _stream_args(self, out: Parsed, limit: int) -> None:
        if self.args is None:
            m = _HEAD.match(self.buf)
            if m is None:
                return
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return
            self.args = _Args(ToolCall(call_id(), name, ""), m.end())
            self.count += 1
            out.pieces.append(ArgsPiece(self.count - 1, self.args.call.id, name, "", True))
        piece = self.args.piece(self.buf, limit, self.count - 1)
        if piece is not None:
            out.pieces.append(piece)

    def _end_args(self, out: Parsed, limit: int) -> None:
        """The streamed call is complete: its arguments are the object (or, cut short, all there is)."""
        a, self.args = self.args, None
        piece = a.piece(self.buf, limit, self.count - 1)
        if piece is not None:
            out.pieces.append(piece)
        out.calls.append(ToolCall(a.call.id, a.call.name, self.buf[a.start:a.sent]))
        self.called = True

    def feed(self, delta: str) -> Parsed:
        out = Parsed()
        self.buf += delta
        while True:
            if not self.in_call:
                if self.called:
                    self.buf = self.buf.lstrip()
                at = self.buf.find(self.open)
                if at < 0:
                    keep = held_back(self.buf, self.open)
                    out.content += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out.content += self.buf[:at]
                self.buf, self.in_call = self.buf[at + len(self.open):], True
            at = self.buf.find(self.close)
            if at < 0:
                self._stream_args(out, len(self.buf) - held_back(self.buf, self.close))
                return out
            self._stream_args(out, at)
            if self.args is not None:
                self._end_args(out, at)
                self.buf, self.in_call = self.buf[at + len(self.close):], False
                continue
            body, self.buf, self.in_call = self.buf[:at], self.buf[at + len(self.close):], False
            call = _parse_json_call(body, "arguments")
            if call is None:
                out.content += self.open + body + self.close
            else:
                self._whole(out, call)
                self.called = True

    def finish(self) -> Parsed:
        out = Parsed()
        if self.in_call and self.args is not None:  # cut short (max_tokens): the arguments written so far
            self._end_args(out, len(self.buf))
            self.buf, self.in_call = "", False
            return out
        buf, self.buf = self.buf, ""
        if not self.in_call:
            out.content = buf.strip() if self.called else buf
            return out
        call = _parse_json_call(buf, "arguments")  # cut short (max_tokens) yet whole: still a call
        if call is None:
            out.content = self.open + buf
        else:
            self._whole(out, call)
        return out


def _parse_json_call(body: str, args_key: str) -> ToolCall | None:
    try:
        return _call(json.loads(body), args_key)
    except ValueError:
        return None


class _JsonStream(Stream):
    """A reply whose first non-space character is `{` is held to the end and read as calls (objects joined by ";"
    or whitespace); if it is not all calls it is content after all. Any other reply streams as content."""

    def __init__(self, args_key: str, prefix: str):
        super().__init__()
        self.args_key, self.prefix = args_key, prefix
        self.buf = ""
        self.mode: str | None = None  # None: undecided, "json", "content"

    def feed(self, delta: str) -> Parsed:
        if self.mode == "content":
            return Parsed(content=delta)
        self.buf += delta
        if self.mode is None:
            head = self.buf.lstrip()
            if head.startswith(self.prefix):
                head = head[len(self.prefix):].lstrip()
            if not head or self.prefix.startswith(head):
                return Parsed()  # only spaces or part of the prefix so far
            self.mode = "json" if head.startswith("{") else "content"
            if self.mode == "content":
                buf, self.buf = self.buf, ""
                return Parsed(content=buf)
        return Parsed()

    def finish(self) -> Parsed:
        buf, self.buf = self.buf, ""
        if self.mode != "json":
            return Parsed(content=buf)
        text = buf.strip().removeprefix(self.prefix).strip()
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(text):
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return Parsed(content=buf)
            call = _call(obj, self.args_key)
            if call is None:
                return Parsed(content=buf)
            calls.append(call)
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
        out = Parsed()
        for call in calls:
            self._whole(out, call)
        return out
