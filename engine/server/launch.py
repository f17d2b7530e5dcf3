"""Server start-up and shutdown: options (flags > plan > environment > defaults), binding, the two processes,
signals (SIGTERM drains), and the exit code.

Exit codes: 0 clean shutdown, 1 the engine process died while serving, 2 bad arguments or plan,
3 start-up failure (port in use, model or tokenizer cannot be loaded).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass, field

from deploykit import cpulist
from deploykit.units import parse_size

log = logging.getLogger("engine.server")
EXIT_OK, EXIT_ENGINE_DIED, EXIT_USAGE, EXIT_STARTUP = 0, 1, 2, 3
DEATH_LINGER = 1.0  # seconds /health answers 503 after the engine died, so probes record it, before exiting


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str
    host: str = "0.0.0.0"
    port: int = 8000
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None
    binding: str = "auto"  # auto | none | CPU list
    frontend_cpus: str | None = None  # CPU list; "" = share the inference CPUs
    mems: str | None = None  # NUMA node list
    binding_source: str | None = None  # "plan" / "env" when `binding` came from there (shown in the report)
    api_key: str | None = field(default=None, repr=False)
    served_model_name: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    seed: int = 0
    access_log: bool = True

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    def engine_config(self) -> dict:
        """EngineConfig keyword arguments; the engine process builds the config (it owns torch)."""
        return {"model": self.model, "dtype": self.dtype, "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "kv_cache_bytes": self.kv_cache_bytes, "seed": self.seed, "served_model_name": self.model_name}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="Hugging Face model directory")
    p.add_argument("--host", default=None, help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000; 0 = any free port)")
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32 (default: plan, else auto)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache", default=None, metavar="SIZE", help="KV cache size, e.g. 4GiB")
    p.add_argument("--binding", default=None, metavar="auto|none|CPULIST",
                   help="engine CPUs: auto (this cpuset), none, or a list like 0-3,8 (env DEPLOYKIT_CPUS)")
    p.add_argument("--frontend-cpus", default=None, metavar="CPULIST",
                   help="CPUs for the HTTP/tokenizer process (env DEPLOYKIT_FRONTEND_CPUS)")
    p.add_argument("--mems", default=None, metavar="NODELIST", help="NUMA memory nodes (env DEPLOYKIT_MEMS)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (env DEPLOYKIT_API_KEY)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--plan", default=None, metavar="PLAN_JSON", help="output of `deploykit plan --format json`")
    p.add_argument("--replica", type=int, default=0, help="which of the plan's replicas this process is")
    p.add_argument("--max-waiting", type=int, default=None, help="queued requests before 429 (default 256)")
    p.add_argument("--max-body", default=None, metavar="SIZE", help="request body limit (default 4MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="seconds SIGTERM waits for in-flight requests (default 30)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-access-log", action="store_true")


class OptionsError(ValueError):
    pass


DTYPES = ("auto", "bfloat16", "float32", "float16")


def _check_ranges(a: argparse.Namespace) -> None:
    """Usage errors, reported before any process starts or any model byte is read."""
    checks = [("--port", a.port, 0, 65535), ("--max-model-len", a.max_model_len, 1, None),
              ("--max-num-seqs", a.max_num_seqs, 1, None),
              ("--max-num-batched-tokens", a.max_num_batched_tokens, 1, None),
              ("--max-waiting", a.max_waiting, 0, None), ("--replica", a.replica, 0, None),
              ("--shutdown-timeout", a.shutdown_timeout, 0, None)]
    for flag, value, lo, hi in checks:
        if value is not None and (value < lo or (hi is not None and value > hi)):
            allowed = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise OptionsError(f"{flag} must be {allowed}, got {value}")
    if a.dtype is not None and a.dtype not in DTYPES:
        raise OptionsError(f"--dtype must be one of {', '.join(DTYPES)}, got {a.dtype!r}")


def missing_model_files(model: str) -> str | None:
    """What a servable Hugging Face model directory lacks, or None."""
    if not os.path.isdir(model):
        return f"model directory {model} does not exist (a local Hugging Face model directory is required)"
    names = set(os.listdir(model))
    lacks = []
    if "config.json" not in names:
        lacks.append("config.json")
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        lacks.append("weights (*.safetensors)")
    if not names & {"tokenizer.json", "tokenizer.model", "vocab.json"}:
        lacks.append("a tokenizer (tokenizer.json)")
    return f"model directory {model} lacks {', '.join(lacks)}" if lacks else None


def options_from_args(a: argparse.Namespace, environ: dict | None = None) -> ServeOptions:
    """Explicit flags win, then the plan's replica, then DEPLOYKIT_* environment variables, then defaults."""
    env = os.environ if environ is None else environ
    _check_ranges(a)
    plan: dict = {}
    replica: dict = {}
    if a.plan:
        try:
            with open(a.plan) as f:
                plan = json.load(f)
            replica = plan["replicas"][a.replica]
        except (OSError, ValueError) as e:
            raise OptionsError(f"cannot read plan {a.plan}: {e}") from None
        except (KeyError, IndexError, TypeError):
            n = len(plan.get("replicas", [])) if isinstance(plan, dict) else 0
            raise OptionsError(f"plan {a.plan} has {n} replica(s); --replica {a.replica} does not exist") from None
    model, serving = plan.get("model") or {}, plan.get("serving") or {}

    def first(*values):
        return next((v for v in values if v is not None), None)

    def cpus(key: str, env_key: str) -> str | None:
        return first(cpulist.format(replica[key]) if key in replica else None, env.get(env_key) or None)

    binding, source = a.binding, "explicit" if a.binding not in (None, "auto", "none") else None
    if binding is None and "cpus" in replica:
        binding, source = cpulist.format(replica["cpus"]), "plan"
    elif binding is None and env.get("DEPLOYKIT_CPUS"):
        binding, source = env["DEPLOYKIT_CPUS"], "env"
    key = a.api_key
    if key is None and serving.get("api_key_env"):
        key = env.get(serving["api_key_env"])
        if not key:
            raise OptionsError(f"the plan requires an API key in ${serving['api_key_env']}, which is not set")
    try:
        kv = first(parse_size(a.kv_cache) if a.kv_cache is not None else None, replica.get("kv_cache_bytes"))
        body = parse_size(a.max_body) if a.max_body is not None else None
    except ValueError as e:
        raise OptionsError(str(e)) from None
    given = {
        "host": a.host, "port": a.port, "dtype": first(a.dtype, model.get("dtype")),
        "max_model_len": first(a.max_model_len, model.get("max_model_len")),
        "max_num_seqs": first(a.max_num_seqs, serving.get("max_num_seqs")),
        "max_num_batched_tokens": first(a.max_num_batched_tokens, serving.get("max_num_batched_tokens")),
        "kv_cache_bytes": kv, "binding": binding, "binding_source": source,
        "frontend_cpus": first(a.frontend_cpus, cpus("frontend_cpus", "DEPLOYKIT_FRONTEND_CPUS")),
        "mems": first(a.mems, cpus("mems", "DEPLOYKIT_MEMS")), "api_key": first(key, env.get("DEPLOYKIT_API_KEY")),
        "served_model_name": first(a.served_model_name, model.get("served_name")), "max_waiting": a.max_waiting,
        "max_body_bytes": body, "shutdown_timeout": a.shutdown_timeout, "seed": a.seed,
    }
    return ServeOptions(a.model, access_log=not a.no_access_log, **{k: v for k, v in given.items() if v is not None})


def resolve_binding(o: ServeOptions):
    from engine import binding
    b = binding.resolve(o.binding, frontend_cpus=o.frontend_cpus, mems=o.mems)
    return dataclasses.replace(b, source=o.binding_source) if o.binding_source and o.binding != "auto" else b


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(o: ServeOptions) -> int:
    """Run the server until SIGTERM/SIGINT (exit 0 after draining) or engine death (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    problem = missing_model_files(o.model)
    if problem:
        log.error("%s", problem)
        return EXIT_STARTUP
    try:
        b = resolve_binding(o)
    except ValueError as e:
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
    from engine.server.frontend import Frontend, State, load_tokenizer
    try:
        tokenizer = load_tokenizer(o.model)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, JSON and tokenizers errors
        log.error("cannot load the tokenizer from %s: %s", o.model, e)
        return EXIT_STARTUP
    fe = Frontend(tokenizer, engine, o.model_name, max_num_seqs=o.max_num_seqs, max_waiting=o.max_waiting)
    app = build_app(fe, api_key=o.api_key, max_body_bytes=o.max_body_bytes,
                    on_shutdown=lambda: engine.stop(timeout=0 if fe.state is State.LOADING else 10.0))
    config = uvicorn.Config(app, log_level="info", access_log=o.access_log, timeout_graceful_shutdown=5)
    server = _server_class(uvicorn)(config)
    exit_code = EXIT_OK

    def engine_exited(code: int | None) -> None:
        nonlocal exit_code
        exit_code = EXIT_STARTUP if not fe.info else EXIT_ENGINE_DIED
        asyncio.get_running_loop().call_later(DEATH_LINGER, setattr, server, "should_exit", True)

    fe.on_engine_exit = engine_exited
    server.on_signal = lambda sig: _on_signal(server, fe, o.shutdown_timeout, sig)
    host, port = sock.getsockname()[:2]
    log.info("serving %s as '%s' on http://%s:%d; engine pid %d binding (%s): inference CPUs %s (%d OpenMP threads), "
             "memory nodes %s; front end pid %d CPUs %s", o.model, o.model_name, host, port, engine.pid, b.source,
             cpulist.format(b.cpus) or "unpinned", b.threads, cpulist.format(b.mems) or "unbound", os.getpid(),
             cpulist.format(b.frontend_cpus) or "unpinned (shares the cpuset)")
    server.run(sockets=[sock])
    return exit_code


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
        options = options_from_args(a)
    except (OptionsError, ValueError) as e:
        logging.getLogger("engine.server").error("%s", e)
        return EXIT_USAGE
    return serve(options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine serve", description="OpenAI-compatible CPU server")
    add_arguments(parser)
    return run_args(parser.parse_args(argv))
