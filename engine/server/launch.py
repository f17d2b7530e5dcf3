"""Server start-up and shutdown: binding, the two processes, signals (SIGTERM drains), and the exit code. Where the
options come from is engine/server/options.py.

Exit codes: 0 clean shutdown, 1 the engine process died while serving, 2 bad arguments or plan,
3 start-up failure (port in use, model or tokenizer cannot be loaded).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import socket

from deploykit import cpulist, modelfiles
from deploykit.errors import DeploykitError
from engine import tokenizer as tokenizers
from engine.errors import EXIT_STARTUP, EXIT_USAGE, EngineError, ModelLoadError, exit_code
from engine.server.options import ServeOptions, add_arguments, options, options_from_args

__all__ = ["ServeOptions", "add_arguments", "main", "options", "options_from_args", "run_args", "serve"]

log = logging.getLogger("engine.server")
EXIT_OK, EXIT_ENGINE_DIED = 0, 1
DEATH_LINGER = 1.0  # seconds /health answers 503 after the engine died, so probes record it, before exiting


def resolve_binding(o: ServeOptions):
    from engine import binding
    b = binding.resolve(o.binding, frontend_cpus=o.frontend_cpus, mems=o.mems, reserved=o.reserved_cpus,
                        use_smt=o.use_smt, threads=o.threads)
    return dataclasses.replace(b, source=o.binding_source) if o.binding_source and o.binding != "auto" else b


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(o: ServeOptions) -> int:
    """Run the server until SIGTERM/SIGINT (exit 0 after draining) or engine death (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    problem = modelfiles.missing(o.model)
    if problem:
        log.error("%s", problem)
        return EXIT_STARTUP
    try:
        b = resolve_binding(o)
    except (ValueError, DeploykitError) as e:
        log.error("%s", e)
        return EXIT_USAGE
    try:
        sock = _listen(o.host, o.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", o.host, o.port, e.strerror)
        return EXIT_STARTUP
    from engine.server.worker import EngineProcess
    engine = EngineProcess(o.engine_config(), b)
    engine.start()  # the model loads while this process sets up HTTP
    if b.frontend_cpus:
        try:
            os.sched_setaffinity(0, b.frontend_cpus)
        except OSError as e:  # CPUs outside this cpuset: serve unpinned rather than not at all
            log.warning("cannot pin the front end to CPUs %s: %s", cpulist.format(b.frontend_cpus), e.strerror)
    try:
        return _run(o, b, engine, sock)
    finally:
        engine.stop(timeout=10.0)
        sock.close()


def _run(o: ServeOptions, b, engine, sock: socket.socket) -> int:
    import uvicorn

    from engine.server.api import build_app
    from engine.server.frontend import Frontend, State
    try:
        tokenizer = tokenizers.load(o.model)
    except ModelLoadError as e:
        log.error("%s", e)
        return EXIT_STARTUP
    fe = Frontend(tokenizer, engine, o.model_name, max_num_seqs=o.max_num_seqs, max_waiting=o.max_waiting,
                  stall_timeout=o.stall_timeout, sse_keepalive=o.sse_keepalive or None,
                  tool_call_parser=o.tool_call_parser, reasoning_parser=o.reasoning_parser)
    app = build_app(fe, api_key=o.api_key, max_body_bytes=o.max_body_bytes, allowed_origins=o.allowed_origins,
                    on_shutdown=lambda: engine.stop(timeout=0 if fe.state is State.LOADING else 10.0))
    loop, http = _event_loop_and_parser()
    config = uvicorn.Config(app, log_level="info", access_log=o.access_log, timeout_graceful_shutdown=5, loop=loop,
                            http=http)
    server = _server_class(uvicorn)(config)
    result = EXIT_OK

    def engine_exited(code: int | None) -> None:
        nonlocal result
        result = EXIT_STARTUP if not fe.info else EXIT_ENGINE_DIED
        asyncio.get_running_loop().call_later(DEATH_LINGER, setattr, server, "should_exit", True)

    fe.on_engine_exit = engine_exited
    if o.metrics_port:
        from prometheus_client import start_http_server
        try:  # a thread of this process; it reads the same registry /metrics renders
            start_http_server(o.metrics_port, addr=o.host, registry=fe.metrics.registry)
        except OSError as e:
            log.error("cannot listen on %s:%d for metrics: %s", o.host, o.metrics_port, e.strerror or e)
            return EXIT_STARTUP
    server.on_signal = lambda sig: _on_signal(server, fe, o.shutdown_timeout, sig)
    host, port = sock.getsockname()[:2]
    if not o.api_key and not ipaddress.ip_address(host).is_loopback:
        log.warning("serving on %s with no API key: anyone who can reach this address can use the model; set "
                    "--api-key or DEPLOYKIT_API_KEY (or bind 127.0.0.1)", host)
    log.info("serving %s as '%s' on http://%s:%d; engine pid %d binding (%s): inference CPUs %s (%d OpenMP threads), "
             "memory nodes %s; front end pid %d CPUs %s (%s event loop, %s HTTP parser)", o.model, o.model_name, host,
             port, engine.pid, b.source, cpulist.format(b.cpus) or "unpinned", b.threads,
             cpulist.format(b.mems) or "unbound", os.getpid(), cpulist.format(b.frontend_cpus) or
             "unpinned (shares the cpuset)", loop, http)
    server.run(sockets=[sock])
    return result


def _event_loop_and_parser() -> tuple[str, str]:
    """uvloop and httptools (C) where they import, else asyncio's loop and h11 (pure Python). On a 2-CPU host the
    front end shares the inference CPUs, and every SSE event is a write through this stack: at 16 streams the C pair
    took 127 us of front-end CPU a token against 137-151 us (benchmarks/README.md)."""
    def importable(name: str) -> bool:
        try:
            __import__(name)
        except ImportError:
            return False
        return True

    return ("uvloop" if importable("uvloop") else "asyncio"), ("httptools" if importable("httptools") else "h11")


def _on_signal(server, fe, timeout: float, sig: int) -> None:
    from engine.server.frontend import State
    if server.draining or fe.state is not State.READY:
        log.warning("%s: stopping now, aborting %d request(s)", signal.Signals(sig).name, fe.num_inflight)
        fe.abort_all()
        server.should_exit = True
        return
    server.draining = True
    fe.state = State.DRAINING
    log.info("%s: no new requests; waiting up to %.0f s for %d in flight", signal.Signals(sig).name, timeout,
             fe.num_inflight)
    asyncio.get_running_loop().create_task(_drain(server, fe, timeout))


async def _drain(server, fe, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while fe.num_inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if fe.num_inflight:
        log.warning("shutdown timeout: aborting %d request(s) still in flight", fe.num_inflight)
        fe.abort_all()
    server.should_exit = True


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's own handler closes the listener at once and re-raises the signal after shutdown (exit 143);
        here the first signal drains (503 to new requests meanwhile) and the exit code stays ours."""
        draining = False
        on_signal = staticmethod(lambda sig: None)

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.on_signal, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


def run_args(a: argparse.Namespace) -> int:
    try:
        o = options_from_args(a)
    except EngineError as e:
        logging.getLogger("engine.server").error("%s", e)
        return exit_code(e)
    return serve(o)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine serve", description="OpenAI-compatible CPU server")
    add_arguments(parser)
    return run_args(parser.parse_args(argv))
