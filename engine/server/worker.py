"""The engine-core process: its step loop (child side) and the handle the front end drives it through (parent side).

IPC is one private socketpair carrying pickled engine.messages objects (multiprocessing.connection framing):
Init, then Ops batches, from the front end; Ready or Fatal, then at most one StepResult per engine step, back.
The child runs `python -m engine.server.worker FD` so that binding (OpenMP env, memory policy) happens before
torch is imported; this module must therefore import nothing heavy at top level.
"""
from __future__ import annotations

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

from deploykit.binding_report import EngineReport
from engine.errors import EXIT_STARTUP, EngineError, RequestError
from engine.server.channel import Channel
from engine.messages import (AbortRequest, AddRequest, Call, Fatal, Init, Op, Ops, Ready, Rejected, Reply, Shutdown,
                             StepResult)

log = logging.getLogger("engine.server.worker")
_EOF = object()


# ---- child side ----

def _bind(binding) -> tuple[Callable[[], object], Callable[[], EngineReport], Callable[[], None]]:
    """Apply the binding before torch loads. Returns (finish after torch is imported, report, pin the calling
    helper thread): the only place that touches engine.binding's API."""
    from engine import binding as eb
    eb.prepare(binding)
    return (lambda: eb.finish(binding)), (lambda: eb.report(binding)), (lambda: eb.pin_helper_thread(binding))


class _Loop:
    def __init__(self, core, conn: Connection, report: Callable[[], EngineReport]):
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
            rejected: list[Rejected] = []
            replies: list[Reply] = []
            for msg in msgs:
                if msg is _EOF:  # the front end is gone: nobody is left to serve
                    return
                for op in msg.ops:
                    self._apply(op, rejected, replies)
            stepping = self.running and core.has_unfinished_requests()
            outputs = self._step(rejected) if stepping else []
            # After every step, even one that sampled nothing (a prefill chunk): the front end's watchdog reads
            # silence while requests are in flight as a hung engine.
            if stepping or msgs or rejected:
                self.conn.send(StepResult(tuple(outputs), tuple(rejected), core.stats(), tuple(replies)))

    def _step(self, rejected: list[Rejected]) -> list:
        """One core step. If it raises, the requests it held are in an unknown state: abort all of them (each
        fails with a 500) and keep serving, rather than restarting and failing every client of this replica."""
        try:
            outputs = self.core.step()
        except Exception as e:
            log.exception("engine step failed; aborting the %d request(s) in the engine", len(self.live))
            for rid in self.live:
                try:
                    self.core.abort_request(rid)
                except Exception:  # noqa: BLE001 - the core is already inconsistent; fail the rest anyway
                    pass
                rejected.append(Rejected(rid, 500, "the engine failed while running this request: "
                                                   f"{type(e).__name__}: {e}"))
            self.live.clear()
            if self.core.has_unfinished_requests():
                # The core still holds requests nobody can abort: every later step would fail again while /health
                # stays 200. End the process; the front end fails over to 503 and exits, and it is restarted.
                raise RuntimeError("the engine core is inconsistent after a failed step") from e
            return []
        for o in outputs:
            if o.finished:
                self.live.discard(o.request_id)
        return outputs

    def _binding(self) -> EngineReport:
        """The binding report, and how the weights are held (by type in the file: quantized or in the dtype), so a
        scraper sees which kernels this replica runs."""
        model = self.core.model
        pages = getattr(model, "pages", None)
        return dataclasses.replace(self.report(), weights={"bytes": getattr(model, "weight_bytes", None),
                                                           "by_type": getattr(model, "weight_paths", {}),
                                                           "pages": pages.as_dict() if pages else None})

    def _apply(self, op: Op, rejected: list[Rejected], replies: list[Reply]) -> None:
        """One operation; whatever it raises stays with it (the loop and the other requests keep going)."""
        try:
            self._apply_one(op, rejected, replies)
        except Exception as e:
            log.exception("engine operation %s failed", type(op).__name__)
            if isinstance(op, Call):
                replies.append(Reply(op.call_id, {"error": f"{type(e).__name__}: {e}"}))
            elif isinstance(op, AbortRequest) and not self.core.has_unfinished_requests():
                self.live.discard(op.request_id)  # it is gone from the core; otherwise the next step's failure
                # (the core still runs it) aborts or restarts

    def _apply_one(self, op: Op, rejected: list[Rejected], replies: list[Reply]) -> None:
        if isinstance(op, AddRequest):
            try:
                self.core.add_request(op.request_id, list(op.prompt_token_ids), op.params)
                self.live.add(op.request_id)
            except RequestError as e:  # a request the core refuses fails alone; the loop keeps serving
                rejected.append(Rejected(op.request_id, 400, e.message, e.param, e.code))
            except Exception as e:
                log.exception("add_request failed for %s", op.request_id)
                rejected.append(Rejected(op.request_id, 500, f"{type(e).__name__}: {e}"))
        elif isinstance(op, AbortRequest):
            self.core.abort_request(op.request_id)
            self.live.discard(op.request_id)
        elif isinstance(op, Call):
            replies.append(Reply(op.call_id, self._binding() if op.name == "binding" else None))
        elif isinstance(op, Shutdown):
            self.running = False


def child_main(fd: int) -> int:
    # Ctrl-C, `timeout`, systemd and shells signal the whole process group; the front end decides when the
    # engine stops (after draining) and tells it over the socket. If the front end dies, EOF ends the loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    conn = Connection(fd)
    try:
        init: Init = conn.recv()
    except (EOFError, OSError):
        return 1
    finish, report, pin = _bind(init.binding)
    try:
        # engine.binding.finish imports torch (its OpenMP runtime loads with the binding's environment) and starts
        # the pool the binding pins, before the model loads.
        finish()
        from engine.core import EngineCore
        core = EngineCore(init.config)
    except Exception as e:
        if not isinstance(e, EngineError):  # a known load problem is one clear line (the front end logs it)
            log.exception("engine failed to start")
        conn.send(Fatal(f"engine failed to start: {type(e).__name__}: {e}"))
        return EXIT_STARTUP
    loop = _Loop(core, conn, report)
    threading.Thread(target=loop.receive, args=(pin,), name="ipc-recv", daemon=True).start()
    conn.send(Ready(pid=os.getpid(), max_model_len=core.max_model_len, vocab_size=core.model_config.vocab_size,
                    eos_token_ids=tuple(core.eos_token_ids)))
    try:
        loop.run()
    except Exception as e:
        log.exception("engine step loop failed")
        try:
            conn.send(Fatal(f"engine step loop failed: {type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    return 0


# ---- parent side ----

class EngineProcess:
    """Starts the child and moves messages through a non-blocking Channel; `on_message` / `on_exit` are called on
    the event loop's thread."""

    def __init__(self, config, binding):
        self.config = config  # engine.config.EngineConfig
        self.binding = binding
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
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
        self.channel = Channel(parent)
        self.channel.send_blocking(Init(self.config, self.binding))

    def attach(self, loop, on_message: Callable, on_exit: Callable[[int | None], None]) -> None:
        """Read on the event loop itself (no reader thread, so no GIL hand-off per engine step)."""
        def gone() -> None:
            waited = loop.run_in_executor(None, self._exit_code)
            waited.add_done_callback(lambda f: on_exit(f.result()))

        self.channel.attach(loop, on_message, gone)

    def _exit_code(self) -> int | None:
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def send(self, ops: list[Op]) -> None:
        if self.channel is not None:
            self.channel.send(Ops(tuple(ops)))  # never blocks; dropped once the child is gone (EOF reports it)

    def kill(self) -> None:
        """SIGKILL: for an engine that stopped answering (the watchdog); its socket's EOF reports the exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the child to exit, wait, and kill it if it does not."""
        if self.proc is None:
            return None
        self.stopping = True
        if self.proc.poll() is None:
            self.send([Shutdown()])
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
