"""Writing rendered files into an output directory without ever clobbering what deploykit did not write.

Rules: a non-empty directory without our manifest is refused (unless force); on re-render only files listed in
the previous manifest are replaced or removed, and those the user edited since are refused (unless force);
every file lands via a temp file + rename, and the manifest is written last, so an error leaves the old set.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import OutputError

MANIFEST = "deploykit-manifest.json"


@dataclass(frozen=True, slots=True)
class File:
    path: str  # relative, '/'-separated, no '..'
    data: bytes
    mode: int = 0o644

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True, slots=True)
class Written:
    directory: Path
    written: tuple[str, ...]  # new or changed
    unchanged: tuple[str, ...]
    removed: tuple[str, ...]  # listed in the previous manifest, not rendered any more


def manifest_file(files: tuple[File, ...]) -> File:
    body = {"apiVersion": "deploykit/v1", "kind": "RenderManifest", "generator": f"deploykit {__version__}",
            "files": {f.path: {"sha256": f.sha256, "mode": oct(f.mode)} for f in sorted(files, key=lambda f: f.path)}}
    return File(MANIFEST, (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())


def write(out: str | Path, files: tuple[File, ...], force: bool = False) -> Written:
    """Write `files` (already fully rendered) plus the manifest into `out`."""
    out = Path(out)
    _check_paths(files)
    previous = _previous(out, force)
    in_the_way = [f.path for f in files if (out / f.path).exists() and not (out / f.path).is_file()]
    if in_the_way:
        raise OutputError("a directory (or other non-file) is where a rendered file goes", path=str(out),
                          value=in_the_way, hint="move it away")
    problems = _conflicts(out, files, previous) if not force else []
    if problems:
        raise OutputError(f"refusing to overwrite files deploykit did not write (or that were edited since) in {out}",
                          path=str(out), value=problems, hint="move them away, or pass --force to overwrite them")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the output directory: {e.strerror or e}", path=str(out)) from None
    manifest = manifest_file(files)
    changed = [f for f in files if _current(out / f.path) != (f.data, f.mode)]
    staged: list[tuple[str, Path]] = []
    try:  # stage every file first: a failure here leaves the directory exactly as it was
        for f in (*changed, manifest):
            (out / f.path).parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".deploykit-", dir=out / Path(f.path).parent)
            staged.append((f.path, Path(tmp)))
            with os.fdopen(fd, "wb") as fh:
                fh.write(f.data)
            os.chmod(tmp, f.mode)
        for rel, tmp in staged:
            os.replace(tmp, out / rel)
    except OSError as e:
        for _, tmp in staged:
            tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write rendered files: {e.strerror or e}", path=str(out),
                          hint="check the directory is writable and the disk has room") from None
    names = {f.path for f in files}
    removed = sorted(p for p in previous if p not in names and (out / p).is_file())
    for rel in removed:
        (out / rel).unlink()
    return Written(out, tuple(sorted(f.path for f in changed)),
                   tuple(sorted(names - {f.path for f in changed})), tuple(removed))


def drift(out: str | Path, files: tuple[File, ...]) -> list[str]:
    """What `out` would need to hold exactly `files` plus their manifest, as unified diffs (one per path: a changed
    byte or mode, a missing file, an extra file); [] when it already does. Reads only; for `render --check`."""
    out = Path(out)
    want = {f.path: f for f in (*files, manifest_file(files))}
    have = {p.relative_to(out).as_posix(): p for p in out.rglob("*") if p.is_file()} if out.is_dir() else {}
    diffs = []
    for rel in sorted(set(want) | set(have)):
        f, p = want.get(rel), have.get(rel)
        old = p.read_bytes() if p else b""
        if f is not None and p is not None and old == f.data:
            mode = p.stat().st_mode & 0o7777
            if mode != f.mode:
                diffs.append(f"--- a/{rel}\n+++ b/{rel}\nmode {oct(mode)} -> {oct(f.mode)}\n")
            continue
        a, b = (f"a/{rel}" if p else "/dev/null"), (f"b/{rel}" if f else "/dev/null")
        new = f.data if f else b""
        try:
            lines = difflib.unified_diff(old.decode().splitlines(True), new.decode().splitlines(True), a, b)
            text = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                           for line in lines)
        except UnicodeDecodeError:
            text = f"Binary files {a} and {b} differ\n"
        diffs.append(text)
    return diffs


def _check_paths(files: tuple[File, ...]) -> None:
    seen: set[str] = set()
    for f in files:
        parts = f.path.split("/")
        assert f.path and not f.path.startswith("/") and ".." not in parts and f.path != MANIFEST, f.path
        assert f.path not in seen, f"two renderers produced {f.path}"
        seen.add(f.path)


def _previous(out: Path, force: bool) -> dict[str, str]:
    """{path: sha256} from our manifest in `out`; {} for a new or empty directory."""
    if out.exists() and not out.is_dir():
        raise OutputError("output path exists and is not a directory", path=str(out), hint="choose a directory")
    if not out.is_dir():
        return {}
    try:
        entries = [p.name for p in out.iterdir()]
    except OSError as e:
        raise OutputError(f"cannot read the output directory: {e.strerror or e}", path=str(out)) from None
    if MANIFEST not in entries:
        if entries and not force:
            raise OutputError("output directory is not empty and was not written by deploykit (no "
                              f"{MANIFEST})", path=str(out), value=sorted(entries)[:8],
                              hint="choose a new or empty directory, or pass --force to write into it")
        return {}
    try:
        data = json.loads((out / MANIFEST).read_text())
        entries = {str(p): str(v["sha256"]) for p, v in data["files"].items()}
        # Only plain relative paths inside `out` can be ours: an edited manifest must not steer a deletion
        # or an overwrite outside the directory.
        return {p: h for p, h in entries.items()
                if p and not p.startswith("/") and ".." not in p.split("/") and (out / p).resolve().is_relative_to(
                    out.resolve())}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        if force:
            return {}
        raise OutputError(f"{MANIFEST} is unreadable or damaged", path=str(out / MANIFEST),
                          hint="delete it after checking the directory, or pass --force") from None


def _conflicts(out: Path, files: tuple[File, ...], previous: dict[str, str]) -> list[str]:
    """Paths we would overwrite or delete although the file on disk is not what we last wrote."""
    bad = []
    for rel in sorted({f.path for f in files} | set(previous)):
        p = out / rel
        if not p.exists():
            continue
        if rel not in previous or not p.is_file() or _sha(p) != previous[rel]:
            bad.append(rel)
    return bad


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _current(p: Path) -> tuple[bytes, int] | None:
    try:
        return p.read_bytes(), p.stat().st_mode & 0o7777
    except OSError:
        return None
