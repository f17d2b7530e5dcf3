"""The engine-core process: its step loop (child side) and the handle the front end drives it through (parent side).

IPC is one private socketpair carrying pickled messages (multiprocessing.connection framing), batched:
  parent -> child  ("init", config_kwargs, binding)  once, then ("ops", [op, ...]) with op one of
                   ("add", request_id, prompt_token_ids, SamplingParams) | ("abort", request_id)
                   | ("call", call_id, name) | ("shutdown",)
  child -> parent  ("ready", info) | ("fatal", message)
                   | ("step", outputs, rejects, stats, replies)   at most one per engine step, where
                     outputs = [(request_id, new_token_ids, logprobs | None, finished, finish_reason)],
                     logprobs = [(token_id, logprob, ((token_id, logprob), ...)), ...],
                     rejects = [(request_id, http_status, message)] (refused by the core, or failed in a step),
                     stats = CoreStats fields, replies = [(call_id, result)]
The child runs `python -m engine.server.worker FD` so that binding (OpenMP env, memory policy) happens before
torch is imported; this module must therefore import nothing heavy at top level.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

log = logging.getLogger("engine.server.worker")
_EOF = object()


# ---- child side ----

def _bind(binding) -> tuple[Callable[[], object], Callable[[], dict], Callable[[], None]]:
    """Apply the binding before torch loads. Returns (finish after torch is imported, report, pin the calling
    helper thread): the only place that touches engine.binding's API."""
    try:
        from engine import binding as eb
    except ImportError:
        return (lambda: None), (lambda: {"error": "engine.binding is not available"}), (lambda: None)
    eb.prepare(binding)
    return (lambda: eb.finish(binding)), (lambda: eb.report(binding)), (lambda: eb.pin_helper_thread(binding))


class _Loop:
    def __init__(self, core, conn: Connection, report: Callable[[], dict]):
        self.core, self.conn, self.report = core, conn, report
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: set[str] = set()  # request ids the core holds
        self.running = True

    def receive(self, pin: Callable[[], None]) -> None:
        pin()  # off the OpenMP workers' CPUs
        try:
            while True:
                self.inbox.put(self.conn.recv())
        except (EOFError, OSError):
            self.inbox.put(_EOF)

    def run(self) -> None:
        core = self.core
        while self.running:
            busy = core.has_unfinished_requests()
            msgs = [self.inbox.get()] if not busy else []
            while True:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            rejects, replies = [], []
            for msg in msgs:
                if msg is _EOF:  # the front end is gone: nobody is left to serve
                    return
                for op in msg[1]:
                    self._apply(op, rejects, replies)
            outputs = self._step(rejects) if self.running and core.has_unfinished_requests() else []
            if outputs or msgs or rejects:
                self.conn.send(("step", [_plain(o) for o in outputs], rejects,
                                dataclasses.astuple(core.stats()), replies))

    def _step(self, rejects: list) -> list:
        """One core step. If it raises, the requests it held are in an unknown state: abort all of them (each
        fails with a 500) and keep serving, rather than restarting and failing every client of this replica."""
        try:
            outputs = self.core.step()
        except Exception as e:
            log.exception("engine step failed; aborting the %d request(s) in the engine", len(self.live))
            for rid in self.live:
                with contextlib.suppress(Exception):
                    self.core.abort_request(rid)
                rejects.append((rid, 500, f"the engine failed while running this request: {type(e).__name__}: {e}"))
            self.live.clear()
            return []
        for o in outputs:
            if o.finished:
                self.live.discard(o.request_id)
        return outputs

    def _apply(self, op: tuple, rejects: list, replies: list) -> None:
        kind = op[0]
        if kind == "add":
            try:
                self.core.add_request(op[1], op[2], op[3])
                self.live.add(op[1])
            except Exception as e:  # a request the core refuses fails alone; the loop keeps serving
                if not isinstance(e, ValueError):
                    log.exception("add_request failed for %s", op[1])
                rejects.append((op[1], 400 if isinstance(e, ValueError) else 500, str(e)))
        elif kind == "abort":
            self.core.abort_request(op[1])
            self.live.discard(op[1])
        elif kind == "call":
            replies.append((op[1], self.report() if op[2] == "binding" else None))
        elif kind == "shutdown":
            self.running = False


def _plain(out) -> tuple:
    lps = None if out.logprobs is None else [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
    return out.request_id, out.new_token_ids, lps, out.finished, out.finish_reason


def child_main(fd: int) -> int:
    # Ctrl-C, `timeout`, systemd and shells signal the whole process group; the front end decides when the
    # engine stops (after draining) and tells it over the socket. If the front end dies, EOF ends the loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    conn = Connection(fd)
    try:
        _, config_kwargs, binding = conn.recv()
    except (EOFError, OSError):
        return 1
    finish, report, pin = _bind(binding)
    try:
        from engine.config import EngineConfig  # imports torch: the OpenMP runtime loads with the binding's env
        finish()  # before the model loads: the first parallel region must start the pool the binding pins
        from engine.core import EngineCore
        core = EngineCore(EngineConfig(**config_kwargs))
    except Exception as e:
        from engine.errors import EngineError
        if not isinstance(e, EngineError):  # a known load problem is one clear line (the front end logs it)
            log.exception("engine failed to start")
        conn.send(("fatal", f"engine failed to start: {type(e).__name__}: {e}"))
        return 3
    loop = _Loop(core, conn, report)
    threading.Thread(target=loop.receive, args=(pin,), name="ipc-recv", daemon=True).start()
    conn.send(("ready", {"pid": os.getpid(), "max_model_len": core.max_model_len,
                         "vocab_size": core.spec.vocab_size, "eos_token_ids": list(core.eos_token_ids)}))
    try:
        loop.run()
    except Exception as e:
        log.exception("engine step loop failed")
        try:
            conn.send(("fatal", f"engine step loop failed: {type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    return 0


# ---- parent side ----

class EngineProcess:
    """Starts the child and moves messages; `on_message` / `on_exit` are called on the event loop's thread."""

    def __init__(self, config_kwargs: dict, binding):
        self.config_kwargs = config_kwargs
        self.binding = binding
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.stopping = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        parent, child = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.server.worker", str(child.fileno())],
                                     pass_fds=(child.fileno(),), env=env, close_fds=True)
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send(("init", self.config_kwargs, self.binding))

    def attach(self, loop, on_message: Callable, on_exit: Callable[[int | None], None]) -> None:
        """Read on the event loop itself (no reader thread, so no GIL hand-off per engine step)."""
        fd = self.conn.fileno()

        def readable() -> None:
            try:
                while self.conn.poll():  # every complete message already buffered; EOF also polls true
                    on_message(self.conn.recv())
            except (EOFError, OSError):
                loop.remove_reader(fd)
                waited = loop.run_in_executor(None, self._exit_code)
                waited.add_done_callback(lambda f: on_exit(f.result()))

        loop.add_reader(fd, readable)

    def _exit_code(self) -> int | None:
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def send(self, ops: list) -> None:
        try:
            self.conn.send(("ops", ops))
        except (OSError, ValueError):
            pass  # the child is gone; the reader thread reports the exit

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the child to exit, wait, and kill it if it does not."""
        if self.proc is None:
            return None
        self.stopping = True
        if self.proc.poll() is None:
            self.send([("shutdown",)])
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine process %d did not exit within %.0f s; killing it", self.proc.pid, timeout)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


if __name__ == "__main__":
    code = child_main(int(sys.argv[1]))
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: nothing in it matters, and it must not delay the exit
