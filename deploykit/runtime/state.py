"""The per-deployment state directory: where `up` renders a deployment and what `down`, `status` and `logs` read.

<root>/<name>/
  rendered/    `deploykit render` output (docker + compose targets, with its manifest): the source of truth the
               runtimes create containers and processes from (plan.json, seccomp.json, nginx.conf, the build context)
  state.json   which runtime runs the deployment, the spec and image it came from, and (local runtime) every
               process: pid, start time, port, log file, config hash
  logs/        local runtime: one log file per process
  salt         random bytes mixed into config hashes, so a hash of the API key in a label or file reveals nothing
  lock         flock: one `up`/`down` per deployment at a time

<root> is --state-dir, else $DEPLOYKIT_STATE_DIR, else $XDG_STATE_HOME/deploykit, else ~/.local/state/deploykit.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import OutputError

STATE_FILE = "state.json"
KIND = "DeploymentState"


def root(override: str | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    if os.environ.get("DEPLOYKIT_STATE_DIR"):
        return Path(os.environ["DEPLOYKIT_STATE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "deploykit"


@dataclass(frozen=True, slots=True)
class Process:
    """One process of a local deployment. `start_time` (clock ticks after boot, /proc/PID/stat field 22) tells our
    process from an unrelated one that got the same pid after a crash or reboot."""

    name: str
    pid: int
    start_time: int
    port: int
    log: str
    config_hash: str
    replica: int | None  # None for the load balancer


@dataclass(frozen=True, slots=True)
class State:
    name: str
    runtime: str  # docker | local
    spec: str = ""  # the spec file `up` was given
    image: str = ""  # docker: the image the containers run
    processes: tuple[Process, ...] = field(default=())  # local runtime only

    def to_json(self) -> str:
        return json.dumps({"apiVersion": "deploykit/v1", "kind": KIND, **asdict(self)}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> State:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise ValueError(f"not a {KIND}")
        procs = tuple(Process(**p) for p in data.get("processes", ()))
        return cls(name=str(data["name"]), runtime=str(data["runtime"]), spec=str(data.get("spec", "")),
                   image=str(data.get("image", "")), processes=procs)

    def with_process(self, p: Process) -> State:
        return replace(self, processes=tuple(sorted((*(q for q in self.processes if q.name != p.name), p),
                                                    key=lambda q: q.name)))

    def without(self, name: str) -> State:
        return replace(self, processes=tuple(q for q in self.processes if q.name != name))


class StateDir:
    def __init__(self, root_dir: Path, name: str):
        self.root, self.name = root_dir, name
        self.path = root_dir / name

    @property
    def rendered(self) -> Path:
        return self.path / "rendered"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def create(self) -> None:
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create the state directory: {e.strerror or e}", path=str(self.path),
                              hint="choose another with --state-dir or DEPLOYKIT_STATE_DIR") from None

    def load(self) -> State | None:
        """The saved state, or None when there is none. A damaged file is reported and treated as absent: what it
        described is found again from the runtime itself (container labels, live processes)."""
        try:
            return State.from_json((self.path / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"deploykit: ignoring damaged {self.path / STATE_FILE}: {e}", file=sys.stderr)
            return None

    def save(self, state: State) -> None:
        """Atomically (temp file + rename): a crash mid-write leaves the previous state, never half a file."""
        self.create()
        fd, tmp = tempfile.mkstemp(prefix=".state-", dir=self.path)
        with os.fdopen(fd, "w") as f:
            f.write(state.to_json())
        os.replace(tmp, self.path / STATE_FILE)

    def salt(self) -> bytes:
        p = self.path / "salt"
        try:
            return bytes.fromhex(p.read_text().strip())
        except (OSError, ValueError):
            self.create()
            value = secrets.token_bytes(16)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(value.hex() + "\n")
            return value

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive per deployment: a second `up` or `down` of the same deployment waits for the first."""
        self.create()
        with open(self.path / "lock", "w") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"deploykit: waiting for another deploykit command on deployment {self.name} to finish",
                      file=sys.stderr)
                fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def known(root_dir: Path) -> list[str]:
    """Deployments that are up (have a state file) under root_dir."""
    try:
        return sorted(p.name for p in root_dir.iterdir() if (p / STATE_FILE).is_file())
    except OSError:
        return []
