"""One bench run against one endpoint: identify the server, make the prompts, warm up, then each concurrency level
in turn (with the replicas' /metrics around it when the target is a deployment), into one JSON document.

What was measured is kept in a `Partial` as it arrives, so Ctrl-C (which cancels the requests in flight) still
yields a document of the finished requests, marked interrupted.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field

from . import client, prompts, report, stats, target


DEFAULT_WAVES = 4  # without --requests or --duration: 4 x concurrency requests per level
MIN_REQUESTS = 8


@dataclass(frozen=True, slots=True)
class Settings:
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int | None = None  # per level; None: `duration`, or DEFAULT_WAVES waves of `concurrency` requests
    duration: float | None = None  # seconds per level
    prompt_tokens: int = 256
    max_tokens: int = 128
    chat: bool = False
    seed: int = 0
    warmup: int = 2  # requests before the first level, not counted
    model: str | None = None  # default: the endpoint's only model
    tokenizer: str | None = None  # a local tokenizer.json (or its directory) when the server has no /tokenize
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0

    def requests_at(self, concurrency: int) -> int | None:
        if self.requests is not None or self.duration is not None:
            return self.requests
        return max(MIN_REQUESTS, DEFAULT_WAVES * concurrency)

    def prompts_needed(self) -> int:
        """Distinct prompts for every request of every level (duration: a guess of 2 requests per stream and second;
        a level that outruns it reuses prompts and says so)."""
        return sum(n if (n := self.requests_at(c)) is not None else max(MIN_REQUESTS, round(2 * c * self.duration))
                   for c in self.concurrency)


@dataclass(slots=True)
class Partial:
    """What a run has measured so far."""

    settings: Settings
    server: dict = field(default_factory=dict)
    prompts: dict = field(default_factory=dict)
    levels: list[dict] = field(default_factory=list)
    current: list = field(default_factory=list)  # results of the level running now
    current_concurrency: int | None = None
    model: str | None = None
    made: prompts.Prompts | None = None  # the prompts, for a sweep to reuse on every candidate

    def document(self, interrupted: bool = False) -> dict:
        levels = list(self.levels)
        if interrupted and self.current:
            s = stats.summarize(self.current_concurrency, self.current, max_tokens=self.settings.max_tokens,
                                interrupted=True)
            levels.append(report.level(s, self.current, None))
        settings = {**asdict(self.settings), "model": self.model or self.settings.model,
                    "concurrency": list(self.settings.concurrency)}
        return report.document(settings, self.server, self.prompts, levels, interrupted=interrupted)


async def make_prompts(http, t: target.Target, s: Settings, model: str, count: int, salt: str = "") -> prompts.Prompts:
    headers = {"Authorization": f"Bearer {t.api_key}"} if t.api_key else {}
    counter = (await prompts.server_counter(http, t.url, model, headers)
               or prompts.local_counter([c for c in (s.tokenizer, model) if c]) or prompts.estimate())
    return await prompts.make(counter, count, s.prompt_tokens, s.seed, salt)


async def measure(t: target.Target, s: Settings, partial: Partial, *, progress: report.Progress,
                  shared_prompts: prompts.Prompts | None = None) -> dict:
    """The whole run; `shared_prompts` (a sweep's) skips making them again."""
    async with client.new_client(60.0, 4) as http:
        partial.server = await target.identify(http, t)
        model = target.pick_model(partial.server["model_ids"], s.model)
        partial.model = model
        made = shared_prompts or await make_prompts(http, t, s, model, s.prompts_needed(), "run")
        warm = await make_prompts(http, t, s, model, s.warmup, "warmup") if s.warmup else None
        partial.made, partial.prompts = made, made.to_json()
        w = client.Workload(t.url, model, s.max_tokens, chat=s.chat, api_key=t.api_key, ignore_eos=s.ignore_eos,
                            extra_body=s.extra_body, timeout=s.timeout)
        if warm:
            progress.level(f"warm-up ({s.warmup})", s.warmup)
            done = await client.run_level(w, warm.texts, concurrency=min(s.warmup, max(s.concurrency)),
                                          requests=s.warmup, on_result=progress.done)
            partial.prompts["warmup_errors"] = [r.error for r in done if r.error]
        used, n = 0, len(made.texts)
        metrics = target.ReplicaMetrics(http, t) if t.replicas else None
        for c in s.concurrency:
            partial.current, partial.current_concurrency = [], c
            progress.level(f"concurrency {c}", s.requests_at(c))
            first = used
            texts = [made.texts[(first + i) % n] for i in range(n)]  # after the last level's: none is seen twice
            stop = asyncio.Event()
            sampler = None
            if metrics:
                await metrics.start()
                sampler = asyncio.create_task(metrics.sampling(stop))
            cpu = client.cpu_seconds()
            await client.run_level(w, texts, concurrency=c, requests=s.requests_at(c), duration=s.duration,
                                   sink=partial.current, on_result=progress.done)
            cpu = client.cpu_seconds() - cpu
            used += len(partial.current)
            m = None
            if metrics:
                stop.set()
                await sampler
                m = await metrics.finish()
            summary = stats.summarize(c, partial.current, max_tokens=s.max_tokens)
            # this process's own CPU over the level: on a host it shares with the server, CPU the server lacked
            summary["client_cpu_s"] = cpu
            summary["client_cpu_share"] = cpu / summary["wall_s"] if summary["wall_s"] > 0 else None
            summary["prompts_reused"] = max(0, used - n) - max(0, first - n)  # duration runs that outran the pool
            partial.levels.append(report.level(summary, partial.current, m))
            partial.current = []
    return partial.document()
