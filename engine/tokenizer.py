"""A model's tokenizer, loaded the same way by the offline engine and the HTTP front end (torch-free), and the raw
bytes a token stands for.

A .gguf file carries its tokenizer and chat template in its metadata. transformers converts them (importing torch,
so in a child process when this one has not loaded torch) into a plain tokenizer directory, cached under the
user's cache directory keyed by the file's SHA-256: nothing is ever written next to the user's file.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from deploykit import modelfiles
from engine.errors import ModelLoadError


def load(model: str):
    """The tokenizer of a Hugging Face model directory or a .gguf file. PreTrainedTokenizerFast does not import
    torch (AutoTokenizer may); the fallback serves directories without tokenizer.json."""
    directory = gguf_tokenizer_dir(model) if modelfiles.is_gguf(model) else model
    try:
        from transformers import PreTrainedTokenizerFast
        if os.path.isfile(os.path.join(directory, "tokenizer.json")):
            return PreTrainedTokenizerFast.from_pretrained(directory)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, JSON and tokenizers errors
        raise ModelLoadError(f"cannot load a tokenizer from {model} (expected tokenizer.json / tokenizer_config.json "
                             f"saved with save_pretrained): {type(e).__name__}: {e}") from None


# ---- GGUF ----

def cache_root() -> Path:
    if os.environ.get("DEPLOYKIT_CACHE"):
        return Path(os.environ["DEPLOYKIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deploykit"


def file_sha256(path: str) -> str:
    """SHA-256 of a file, remembered per (path, size, mtime, inode) so a multi-GB model is hashed once."""
    st = os.stat(path)
    memo = cache_root() / "gguf" / "hashes.json"
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(functools.partial(f.read, 1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        known = known if isinstance(known, dict) else {}
        known[key] = digest
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache only costs hashing again next time
    return digest


def gguf_tokenizer_dir(path: str) -> str:
    """The converted tokenizer of a .gguf file: made on first use, then reused (keyed by the file's hash)."""
    try:
        digest = file_sha256(path)
        out = cache_root() / "gguf" / digest[:32]
        if (out / "tokenizer.json").is_file():
            return str(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f"{digest[:32]}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # replicas starting together convert once
            if not (out / "tokenizer.json").is_file():
                shutil.rmtree(out, ignore_errors=True)  # a conversion cut short (disk full, killed) left it
                _convert_into(path, out)
        return str(out)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"converting the tokenizer stored in {path} took over 10 minutes; giving up") from None
    except OSError as e:
        raise ModelLoadError(f"cannot prepare the tokenizer of {path} under {cache_root()}: {e.strerror or e} "
                             "(set DEPLOYKIT_CACHE to a writable directory)") from None


def _convert_into(path: str, out: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        if "torch" in sys.modules:
            convert(path, str(staging))
        else:  # transformers' GGUF reader imports torch; keep it out of a torch-free process
            done = subprocess.run([sys.executable, "-m", "engine.tokenizer", path, str(staging)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise ModelLoadError(f"cannot read the tokenizer stored in {path}: "
                                     f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def convert(path: str, out: str) -> None:
    """transformers' GGUF tokenizer conversion, saved as a plain tokenizer directory (with the chat template)."""
    from transformers import PreTrainedTokenizerFast
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                      gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - unsupported tokenizer models raise ValueError/KeyError/...
        raise ModelLoadError(f"transformers cannot convert the tokenizer in {path}: {type(e).__name__}: {e}") from None
    tok.save_pretrained(out)


# ---- token bytes ----

@functools.cache
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's printable stand-ins for bytes
    return {ch: b for b, ch in bytes_to_unicode().items()}


_BYTE_LEVEL: dict[int, tuple[object, bool]] = {}  # id(tokenizer) -> (tokenizer, decodes byte-level pieces)


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder reads pieces as GPT-2 byte-level text (else: SentencePiece-style pieces,
    where "▁" is a space and other characters are themselves)."""
    hit = _BYTE_LEVEL.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        found = False
        if backend is not None:
            found = '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))
        hit = _BYTE_LEVEL[id(tokenizer)] = (tokenizer, found)
    return hit[1]


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes a token stands for (a piece may be part of a UTF-8 character, whose decoded text is only
    U+FFFD): byte-level BPE pieces through GPT-2's byte alphabet, SentencePiece's <0xNN> byte-fallback pieces as
    that byte, other SentencePiece pieces as their text with "▁" as a space."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if _byte_level(tokenizer):
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return tokenizer.decode([token_id], skip_special_tokens=False).encode()  # an added (special) token
    return piece.replace("\u2581", " ").encode()


if __name__ == "__main__":  # the child process of _convert_into: python -m engine.tokenizer FILE.gguf OUT_DIR
    try:
        convert(sys.argv[1], sys.argv[2])
    except ModelLoadError as e:
        print(e, file=sys.stderr)
        sys.exit(3)
