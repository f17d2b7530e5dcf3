"""What `deploykit bench` points at: an OpenAI-compatible URL, or a deployment `deploykit up` started (found from
its state directory: the load balancer's endpoint, each replica's own port and the API key's variable). Also the
server's identity (/version, /v1/models) and each replica's /metrics before and after a level.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeploykitError, TargetError

COUNTER_SUFFIXES = ("_total",)  # Prometheus counters: reported as deltas over a level
GAUGE_WORDS = ("usage", "running", "waiting")  # gauges sampled during a level: reported as their peak
SAMPLE_EVERY = 1.0  # seconds between /metrics samples of each replica during a level


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # base URL, without /v1
    api_key: str | None
    replicas: tuple[tuple[str, str], ...] = ()  # (name, base URL) of each replica of a deployment
    deployment: str | None = None


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def base_url(text: str) -> str:
    """http://host:8000/v1/ -> http://host:8000 (the OpenAI SDK's base_url works as well as the server's)."""
    url = text.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def from_url(url: str, api_key: str | None) -> Target:
    return Target(base_url(url), api_key if api_key is not None else os.environ.get("DEPLOYKIT_API_KEY"))


def from_deployment(target: str, state_dir: str | None, api_key: str | None) -> Target:
    """A spec file or deployment name -> the endpoint `up` printed, from the rendered plan in its state directory."""
    from ..plan import Plan
    from ..runtime.deployment import url
    from ..runtime.lifecycle import resolve
    from ..runtime.state import StateDir, known, root
    base = root(state_dir)
    name = resolve(target, base)
    sd = StateDir(base, name)
    if sd.load() is None:
        raise TargetError(f"deployment {name} is not up", path="SPEC", value=target,
                          hint=f"deploykit up {target} first, or give the endpoint's URL (deployments that are up: "
                               f"{', '.join(known(base)) or 'none'})")
    try:
        plan = Plan.from_json((sd.rendered / "plan.json").read_text())
    except (OSError, DeploykitError) as e:
        raise TargetError(f"cannot read the deployment's plan: {e}", path=str(sd.rendered / "plan.json"),
                          hint=f"deploykit up {target} renders it again") from None
    key_env = plan.serving.api_key_env
    if api_key is None and key_env:
        api_key = os.environ.get(key_env)
        if not api_key:
            raise TargetError(f"deployment {name} wants an API key from ${key_env}, which is not set",
                              hint=f"export {key_env}=... (as for deploykit up), or pass --api-key")
    addr = plan.serving.publish_address
    return Target(url(addr, plan.serving.port), api_key,
                  tuple((r.name, url(addr, r.port)) for r in plan.replicas), name)


def resolve(text: str, state_dir: str | None, api_key: str | None) -> Target:
    if is_url(text):
        return from_url(text, api_key)
    if not Path(text).is_file() and ("/" in text or ":" in text):
        raise TargetError("neither a URL nor a spec file", path="URL|SPEC", value=text,
                          hint=f"give http://{text.split('://')[-1]} for a server, a spec file, or a deployment name")
    return from_deployment(text, state_dir, api_key)


async def identify(client, t: Target) -> dict:
    """GET /version and /v1/models: what answered, and the model ids it serves. Unreachable or not OpenAI-shaped
    is a TargetError."""
    import httpx
    headers = {"Authorization": f"Bearer {t.api_key}"} if t.api_key else {}
    try:
        r = await client.get(t.url + "/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise TargetError(f"no answer from {t.url}: {type(e).__name__}: {e}", path="URL", value=t.url,
                          hint="check the address and that the server is up") from None
    if r.status_code == 401:
        raise TargetError("the server wants an API key", path="--api-key", value=t.api_key and "(given, refused)",
                          hint="pass --api-key KEY or set DEPLOYKIT_API_KEY")
    try:
        models = r.json()
        ids = [m["id"] for m in models["data"]]
    except (ValueError, KeyError, TypeError):
        raise TargetError(f"GET {t.url}/v1/models answered HTTP {r.status_code} without a model list",
                          path="URL", value=t.url, hint="point at an OpenAI-compatible server") from None
    version = None
    try:
        v = await client.get(t.url + "/version", headers=headers)
        version = v.json() if v.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        pass
    return {"url": t.url, "deployment": t.deployment, "version": version, "models": models, "model_ids": ids,
            "replicas": [name for name, _ in t.replicas]}


def pick_model(ids: list[str], asked: str | None) -> str:
    if asked is not None:
        return asked
    if len(ids) == 1:
        return ids[0]
    raise TargetError(f"the server serves {len(ids)} models", path="--model", value=None,
                      allowed=", ".join(ids) or "(none)", hint="name one with --model")


def parse(text: str) -> dict[str, float]:
    from ..runtime.health import parse_metrics
    return parse_metrics(text)


class ReplicaMetrics:
    """Each replica's /metrics around a level: counter deltas (tokens, preemptions, prefix-cache hits...) and the
    peak of gauges such as KV-cache usage, sampled every SAMPLE_EVERY seconds while the level runs."""

    def __init__(self, client, t: Target):
        self.client, self.t = client, t
        self.before: dict[str, dict[str, float]] = {}
        self.peaks: dict[str, dict[str, float]] = {}

    async def _get(self, url: str) -> dict[str, float] | None:
        import httpx
        try:
            r = await self.client.get(url + "/metrics")
            return parse(r.text) if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    async def start(self) -> None:
        self.peaks = {}
        self.before = {name: m for name, u in self.t.replicas if (m := await self._get(u)) is not None}

    async def sample(self) -> None:
        for name, u in self.t.replicas:
            m = await self._get(u)
            for k, v in (m or {}).items():
                if any(w in k for w in GAUGE_WORDS) and not k.endswith(COUNTER_SUFFIXES):
                    peak = self.peaks.setdefault(name, {})
                    peak[k] = max(peak.get(k, v), v)

    async def sampling(self, stop) -> None:
        import asyncio
        while not stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)
            except asyncio.TimeoutError:
                pass

    async def finish(self) -> dict:
        await self.sample()
        out = {}
        for name, u in self.t.replicas:
            after = await self._get(u)
            before = self.before.get(name)
            if after is None or before is None:
                out[name] = {"error": "no /metrics answer"}
                continue
            deltas = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
                      if k.endswith(COUNTER_SUFFIXES) and v - before.get(k, 0.0)}
            out[name] = {"deltas": deltas, "peaks": dict(sorted(self.peaks.get(name, {}).items()))}
        return out
