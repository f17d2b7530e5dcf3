"""Synthetic prompts of an exact token length, each a different random word sequence (so no request reuses another's
cached prefix), reproducible from a seed.

A prompt is common English words drawn at random. Its length is measured with, in order of preference: the server's
own tokenizer (`POST /tokenize` of vLLM and ours, `/extras/tokenize` of llama-cpp-python's server), the model's
`tokenizer.json` when it is on this machine (the `tokenizers` package), or, with neither, an estimate of one token
per word that every report labels as such. Words are added or removed until the count is exact (or, failing that,
the closest below it; the report counts prompts off their length).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

# Short, frequent words: one token each in the vocabularies of the usual model families (the count is checked).
WORDS = tuple("""
the of and to in is was for on are with as his they be at one have this from or had by word but what some we can
out other were all there when up use your how said an each she which do their time if will way about many then them
write would like so these her long make thing see him two has look more day could go come did number sound no most
people my over know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too same tell does set
three want air well also play small end put home read hand port large spell add even land here must big high such
follow act why ask men change went light kind off need house picture try us again animal point mother world near
build self earth father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem together next white children begin got walk
example ease paper group always music those both mark often letter until mile river car feet care second book carry
took science eat room friend began idea fish mountain stop once base hear horse cut sure watch color face wood main
""".split())
FILLERS = ("a", "I", "to", "is", "it", "on", "at", "be", "so", "we")  # to close the last token or two
MAX_CALLS = 40  # tokenizer calls per prompt before settling for the closest length below
PARALLEL = 8  # tokenize calls in flight while making prompts

Count = Callable[[str], Awaitable[int]]


@dataclass(frozen=True, slots=True)
class Counter:
    """How prompt lengths are measured: `count(text)` in tokens, and a label for the report."""

    source: str  # "server /tokenize", "local tokenizer PATH", "estimate: ..."
    count: Count
    exact: bool = True


@dataclass(frozen=True, slots=True)
class Prompts:
    texts: tuple[str, ...]
    tokens: int  # the length asked for
    lengths: tuple[int, ...]  # each prompt's measured (or estimated) length
    source: str
    exact: bool

    def to_json(self) -> dict:
        return {"requested_tokens": self.tokens, "source": self.source, "exact": self.exact, "count": len(self.texts),
                "off_length": sum(n != self.tokens for n in self.lengths)}


async def server_counter(client, base: str, model: str, headers: dict) -> Counter | None:
    """The server's tokenizer, when it has an endpoint for it (checked on a sample text)."""
    import httpx
    attempts = (("/tokenize", lambda t: {"model": model, "prompt": t}),  # vLLM, deploykit
                ("/extras/tokenize", lambda t: {"model": model, "input": t}))  # llama-cpp-python's server
    for path, body in attempts:
        try:
            r = await client.post(base + path, json=body("hello world"), headers=headers)
            ok = r.status_code == 200 and isinstance(r.json().get("tokens"), list) and r.json()["tokens"]
        except (httpx.HTTPError, ValueError, AttributeError):
            ok = False
        if ok:
            async def count(text: str, path=path, body=body) -> int:
                r = await client.post(base + path, json=body(text), headers=headers)
                r.raise_for_status()
                return len(r.json()["tokens"])
            return Counter(f"server {path}", count)
    return None


def local_counter(candidates: list[str]) -> Counter | None:
    """A tokenizer.json on this machine (a model directory or the file itself), when `tokenizers` is installed."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    for c in candidates:
        p = Path(c).expanduser()
        f = p / "tokenizer.json" if p.is_dir() else p
        if f.name == "tokenizer.json" and f.is_file():
            tok = Tokenizer.from_file(str(f))

            async def count(text: str, tok=tok) -> int:
                return len(tok.encode(text, add_special_tokens=True).ids)
            return Counter(f"local tokenizer {f}", count)
    return None


def estimate() -> Counter:
    async def count(text: str) -> int:
        return len(text.split())
    return Counter("estimate: one token per word (no /tokenize on the server and no local tokenizer.json; "
                   "--tokenizer DIR makes it exact)", count, exact=False)


async def _one(counter: Counter, tokens: int, rng: random.Random, overhead: int) -> tuple[str, int]:
    """Words until the count is exact. One call when each word is one token (real vocabularies); otherwise a binary
    search for the most words that fit, then short words appended to close the gap (small vocabularies)."""
    seq = [rng.choice(WORDS) for _ in range(2 * tokens)]
    calls = 0

    async def length(k: int) -> int:
        nonlocal calls
        calls += 1
        return await counter.count(" ".join(seq[:k]))

    k = max(1, tokens - overhead)
    n = await length(k)
    if n != tokens:
        lo, hi = 1, k if n > tokens else len(seq)  # the most words with length <= tokens lies in [lo, hi]
        if n < tokens:
            lo = k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if await length(mid) <= tokens:
                lo = mid
            else:
                hi = mid
        k, n = lo, await length(lo)
        for word in FILLERS:  # close a gap of a token or two
            if n >= tokens or calls >= MAX_CALLS:
                break
            seq[k:k] = [word]
            m = await length(k + 1)
            if m <= tokens:
                k, n = k + 1, m
            else:
                del seq[k]
    return " ".join(seq[:k]), n


async def make(counter: Counter, n: int, tokens: int, seed: int, salt: str = "") -> Prompts:
    """n prompts of `tokens` tokens each; prompt i depends only on (seed, salt, i)."""
    try:
        overhead = await counter.count("")  # BOS and the like, added to every prompt
    except Exception:  # noqa: BLE001 - a server may refuse an empty prompt; the fixing rounds absorb it
        overhead = 0
    gate = asyncio.Semaphore(PARALLEL)

    async def one(i: int) -> tuple[str, int]:
        async with gate:
            return await _one(counter, tokens, random.Random(f"{seed}:{salt}:{i}"), overhead)

    made = await asyncio.gather(*(one(i) for i in range(n)))
    return Prompts(tuple(t for t, _ in made), tokens, tuple(k for _, k in made), counter.source, counter.exact)
