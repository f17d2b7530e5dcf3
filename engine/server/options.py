"""Server options: `ServeOptions` and where each value comes from (flags > the plan's replica > DEPLOYKIT_*
environment > defaults), for `python -m engine serve` (flags, plan.json) and `deploykit serve` (a Plan object)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from deploykit import cpulist, memory, modelfiles, placement, quant
from deploykit.errors import DeploykitError
from deploykit.plan import Plan
from deploykit.units import parse_size
from engine.config import EngineConfig
from engine.errors import OptionsError

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str  # a Hugging Face model directory or a .gguf file
    host: str = "127.0.0.1"  # loopback unless told otherwise; the rendered containers pass 0.0.0.0
    port: int = 8000
    metrics_port: int | None = None  # also serve GET /metrics alone on this port (a pod's Prometheus-only port)
    dtype: str = "auto"
    quantization: str = "none"  # deploykit.quant.ON_LOAD: none | q8_0 | q4_0 | dequantize
    compact_weights: bool = True  # bf16 matrices in 12 bits a weight, losslessly (engine/kernels/compact_bf16.h)
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None
    prefix_caching: bool = True  # reuse the KV of identical prompt prefixes across requests
    binding: placement.BindingMode = "auto"  # auto | none | the CPUs (OpenMP thread i on the ith)
    frontend_cpus: tuple[int, ...] | None = None  # () = share the inference CPUs; None = binding auto decides
    mems: tuple[int, ...] | None = None  # NUMA nodes; None = the inference CPUs' nodes
    binding_source: str | None = None  # "plan" / "env" when `binding` came from there (shown in the report)
    reserved_cpus: int | None = None  # binding auto: physical cores for the front end (None: placement's default)
    use_smt: bool = False  # binding auto: an OpenMP thread on every SMT sibling
    threads: int | None = None  # binding auto: at most this many OpenMP threads
    api_key: str | None = field(default=None, repr=False)
    served_model_name: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    stall_timeout: float = 600.0  # seconds without engine progress, requests in flight, before it counts as hung
    sse_keepalive: float = 15.0  # seconds of stream silence before an SSE comment line
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API
    seed: int = 0
    access_log: bool = True
    tool_call_parser: str = "auto"  # how tool calls are written: auto (from the chat template) | hermes | llama3_json
    reasoning_parser: str = "auto"  # <think> blocks -> reasoning_content: auto (the template thinks) | none | ...

    @property
    def model_name(self) -> str:
        return self.served_model_name or modelfiles.served_name(self.model)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            kv_cache_bytes=self.kv_cache_bytes, prefix_caching=self.prefix_caching, seed=self.seed,
                            served_model_name=self.model_name, quantization=self.quantization,
                            compact_weights=self.compact_weights)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="Hugging Face model directory or .gguf file")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000; 0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="also serve GET /metrics alone on this port, so a scraper needs no access to the API port "
                        "(env DEPLOYKIT_METRICS_PORT; default: /metrics on the API port only)")
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32 (default: plan, else auto)")
    p.add_argument("--quantization", default=None, choices=quant.ON_LOAD,
                   help="none: a .gguf's quantized tensors stay in their blocks (int8 kernels), float weights in "
                        "--dtype; q8_0 / q4_0: float weights are quantized on load too; dequantize: every weight in "
                        "--dtype (default: plan, else none; env DEPLOYKIT_QUANTIZATION)")
    p.add_argument("--compact-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="hold bf16 weight matrices in 12 bits a weight, losslessly (the same numbers, 25%% fewer bytes "
                        "for each decode step to read); --no-compact-weights keeps 16 (default: on; env "
                        "DEPLOYKIT_COMPACT_WEIGHTS)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache", default=None, metavar="SIZE", help="KV cache size, e.g. 4GiB")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV cache of prompt prefixes seen before, e.g. a shared system prompt (default: on; "
                        "env DEPLOYKIT_PREFIX_CACHING=0 turns it off)")
    p.add_argument("--binding", default=None, metavar="auto|none|CPULIST",
                   help="engine CPUs: auto (this cpuset), none, or a list like 0-3,8 (env DEPLOYKIT_CPUS)")
    p.add_argument("--frontend-cpus", default=None, metavar="CPULIST",
                   help="CPUs for the HTTP/tokenizer process (env DEPLOYKIT_FRONTEND_CPUS)")
    p.add_argument("--mems", default=None, metavar="NODELIST", help="NUMA memory nodes (env DEPLOYKIT_MEMS)")
    p.add_argument("--reserved-cpus", type=int, default=None, metavar="N",
                   help="binding auto: physical cores kept for the front end (default: 1, or 0 below 4 cores; "
                        "env DEPLOYKIT_RESERVED_CPUS)")
    p.add_argument("--use-smt", action="store_true", default=None,
                   help="binding auto: an OpenMP thread on every SMT sibling (env DEPLOYKIT_USE_SMT=1)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="binding auto: at most N OpenMP threads (env DEPLOYKIT_THREADS)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (env DEPLOYKIT_API_KEY)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--plan", default=None, metavar="PLAN_JSON", help="output of `deploykit plan --format json`")
    p.add_argument("--replica", type=int, default=0, help="which of the plan's replicas this process is")
    p.add_argument("--max-waiting", type=int, default=None, help="queued requests before 429 (default 256)")
    p.add_argument("--max-body", default=None, metavar="SIZE", help="request body limit (default 4MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="seconds SIGTERM waits for in-flight requests (default 30)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="a busy engine silent this long counts as hung: /health turns 503, requests fail, the server "
                        "exits 1 so it is restarted (default 600; 0 = never)")
    p.add_argument("--sse-keepalive", type=float, default=None, metavar="SECONDS",
                   help="send an SSE comment after this much stream silence (default 15; 0 = never)")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated browser origins allowed by CORS (e.g. https://app.example.com, or *)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-access-log", action="store_true")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the tool-call format the model writes: auto (from its chat template: <tool_call> is hermes, "
                        "Llama 3's is llama3_json) | hermes | llama3_json (env DEPLOYKIT_TOOL_CALL_PARSER)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split <think>...</think> into reasoning_content: auto (when the chat template mentions "
                        "</think>) | none | qwen3 | deepseek_r1 (env DEPLOYKIT_REASONING_PARSER)")


def _check_ranges(flags: dict) -> None:
    """Usage errors, reported before any process starts or any model byte is read."""
    checks = [("port", 0, 65535), ("metrics_port", 1, 65535), ("max_model_len", 1, None), ("max_num_seqs", 1, None),
              ("reserved_cpus", 0, None), ("threads", 1, None),
              ("max_num_batched_tokens", 1, None), ("max_waiting", 0, None), ("shutdown_timeout", 0, None),
              ("stall_timeout", 0, None), ("sse_keepalive", 0, None), ("kv_cache_bytes", 1, None)]
    for name, lo, hi in checks:
        value = flags.get(name)
        if value is not None and (value < lo or (hi is not None and value > hi)):
            allowed = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            flag = "--kv-cache" if name == "kv_cache_bytes" else f"--{name.replace('_', '-')}"
            raise OptionsError(f"{flag} must be {allowed}, got {value}")
    if flags.get("dtype") is not None:
        try:
            memory.canonical_dtype(flags["dtype"])
        except ValueError as e:
            raise OptionsError(f"--{e}") from None


def options(model: str, *, plan: Plan | None = None, replica: int = 0, environ: dict | None = None,
            **flags) -> ServeOptions:
    """Explicit flags (None = not given) win, then the plan's replica, then DEPLOYKIT_* environment variables,
    then defaults. `deploykit serve` calls this with a Plan object; `python -m engine serve` with plan.json."""
    env = os.environ if environ is None else environ
    _check_ranges(flags)
    if replica < 0 or (plan is not None and replica >= len(plan.replicas)):
        n = len(plan.replicas) if plan is not None else 0
        raise OptionsError(f"the plan has {n} replica(s); --replica {replica} does not exist")
    given: dict = {"api_key": env.get("DEPLOYKIT_API_KEY") or None}
    if plan is not None:
        r, sv = plan.replicas[replica], plan.serving
        given |= {"dtype": plan.model.dtype, "quantization": plan.model.quantization,
                  "max_model_len": plan.model.max_model_len,
                  "max_num_seqs": sv.max_num_seqs, "max_num_batched_tokens": sv.max_num_batched_tokens,
                  "kv_cache_bytes": r.kv_cache_bytes, "prefix_caching": sv.prefix_caching,
                  "binding": r.cpus, "binding_source": "plan", "frontend_cpus": r.frontend_cpus, "mems": r.mems,
                  "served_model_name": plan.model.served_name}
        if sv.api_key_env:
            key = env.get(sv.api_key_env)
            if not key:
                raise OptionsError(f"the plan requires an API key in ${sv.api_key_env}, which is not set")
            given["api_key"] = key
    else:
        given |= _env_settings(env)
        if given.get("binding") not in (None, "auto", "none"):
            given["binding_source"] = "env"
    given |= _env_settings(env, _ENV_ALWAYS)
    given = {k: v for k, v in given.items() if v is not None}
    explicit = {k: v for k, v in flags.items() if v is not None}
    if explicit.get("binding") not in (None, "auto", "none"):
        explicit["binding_source"] = "explicit"
    elif "binding" in explicit:
        given.pop("binding_source", None)
        # The plan's front-end CPUs and nodes are host ids that belong to its CPU list; with auto/none the process's
        # own cpuset decides them (a pod does not get the CPUs the plan saw).
        if plan is not None:
            given.pop("frontend_cpus", None)
            given.pop("mems", None)
    return ServeOptions(model, **(given | explicit))


# Settings a container can pass as environment variables (a Kubernetes ConfigMap, `docker run --env`), below
# flags and a plan; CPU and node lists are parsed here, at the edge.
_ENV_SETTINGS = {"DEPLOYKIT_CPUS": ("binding", placement.parse_binding),
                 "DEPLOYKIT_FRONTEND_CPUS": ("frontend_cpus", cpulist.parse), "DEPLOYKIT_MEMS": ("mems", cpulist.parse),
                 "DEPLOYKIT_DTYPE": ("dtype", str),
                 "DEPLOYKIT_QUANTIZATION": ("quantization", lambda v: _choice(v, quant.ON_LOAD)),
                 "DEPLOYKIT_MAX_MODEL_LEN": ("max_model_len", int),
                 "DEPLOYKIT_MAX_NUM_SEQS": ("max_num_seqs", int),
                 "DEPLOYKIT_MAX_NUM_BATCHED_TOKENS": ("max_num_batched_tokens", int),
                 "DEPLOYKIT_KV_CACHE": ("kv_cache_bytes", parse_size),
                 "DEPLOYKIT_PREFIX_CACHING": ("prefix_caching", lambda v: _flag(v)),
                 "DEPLOYKIT_SERVED_MODEL_NAME": ("served_model_name", str),
                 "DEPLOYKIT_METRICS_PORT": ("metrics_port", int),
                 "DEPLOYKIT_RESERVED_CPUS": ("reserved_cpus", int), "DEPLOYKIT_THREADS": ("threads", int),
                 "DEPLOYKIT_USE_SMT": ("use_smt", lambda v: _flag(v))}
# Settings a plan does not hold: read from the environment with or without one.
_ENV_ALWAYS = {"DEPLOYKIT_COMPACT_WEIGHTS": ("compact_weights", lambda v: _flag(v)),
               "DEPLOYKIT_TOOL_CALL_PARSER": ("tool_call_parser", lambda v: _choice(v, TOOL_CALL_PARSERS)),
               "DEPLOYKIT_REASONING_PARSER": ("reasoning_parser", lambda v: _choice(v, REASONING_PARSERS))}


def _choice(text: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise ValueError(f"expected one of {', '.join(allowed)}")
    return text


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no", ""):
        return False
    raise ValueError("expected 1/true or 0/false")


def _env_settings(env, table: dict | None = None) -> dict:
    out = {}
    for var, (name, parse) in (_ENV_SETTINGS if table is None else table).items():
        text = env.get(var)
        if text is None or text == "":
            continue
        try:
            out[name] = parse(text)
        except ValueError as e:
            raise OptionsError(f"${var}={text!r} is not valid: {e}") from None
    _check_ranges(out)
    return out


def options_from_args(a: argparse.Namespace, environ: dict | None = None) -> ServeOptions:
    """`python -m engine serve` flags (sizes as text, the plan as a file) -> ServeOptions."""
    plan = None
    if a.plan:
        try:
            with open(a.plan) as f:
                plan = Plan.from_json(f.read())
        except OSError as e:
            raise OptionsError(f"cannot read plan {a.plan}: {e.strerror or e}") from None
        except DeploykitError as e:
            raise OptionsError(f"plan {a.plan}: " + str(e).replace("\n", "; ")) from None
    try:
        kv = parse_size(a.kv_cache) if a.kv_cache is not None else None
        body = parse_size(a.max_body) if a.max_body is not None else None
    except ValueError as e:
        raise OptionsError(str(e)) from None
    binding = _cpus("--binding", a.binding, placement.parse_binding)
    frontend_cpus, mems = _cpus("--frontend-cpus", a.frontend_cpus), _cpus("--mems", a.mems)
    return options(a.model, plan=plan, replica=a.replica, environ=environ, host=a.host, port=a.port,
                   metrics_port=a.metrics_port, dtype=a.dtype, quantization=a.quantization,
                   compact_weights=a.compact_weights,
                   max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                   max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_bytes=kv,
                   prefix_caching=a.prefix_caching, binding=binding,
                   frontend_cpus=frontend_cpus, mems=mems, reserved_cpus=a.reserved_cpus, use_smt=a.use_smt,
                   threads=a.threads, api_key=a.api_key,
                   served_model_name=a.served_model_name, max_waiting=a.max_waiting, max_body_bytes=body,
                   shutdown_timeout=a.shutdown_timeout, stall_timeout=a.stall_timeout, sse_keepalive=a.sse_keepalive,
                   allowed_origins=_origins(a.allowed_origins), seed=a.seed,
                   access_log=False if a.no_access_log else None, tool_call_parser=a.tool_call_parser,
                   reasoning_parser=a.reasoning_parser)


def _cpus(flag: str, text: str | None, parse=cpulist.parse):
    """A CPU or node list flag (or --binding), parsed at the edge; None when not given."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as e:
        raise OptionsError(f"{flag} {text!r}: {e}") from None


def _origins(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in origins:
        if o != "*" and not o.startswith(("http://", "https://")):
            raise OptionsError(f"--allowed-origins: {o!r} is not an origin; write it as scheme://host[:port], e.g. "
                               "https://app.example.com, or * for any")
    return origins
