"""`deploykit up / down / status / logs`: the steps around a runtime (runtime/__init__.py).

up: render the plan into the state directory (the files the runtime then uses), start or replace what changed,
wait until every /health answers 200, and print the endpoint with a curl and an openai snippet. Any failure, and
Ctrl-C or SIGTERM, undoes what this `up` did (the runtime's rollback) unless --keep-on-failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from .. import render
from ..errors import DeploykitError, RuntimeFailure
from ..plan import Plan
from ..render import output
from . import Change, Runtime, choose, health, preflight
from .deployment import Deployment, Member, members, url
from .state import State, StateDir, known, root

RENDER_TARGETS = ("docker", "compose")  # run.sh and compose.yaml stay next to what `up` runs, to take elsewhere
REPORT_EVERY = 5.0  # seconds between "waiting for ..." lines
POLL = 0.5
TAIL = 40  # log lines shown with a member that failed


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- up -----------------------------------------------------------------------------------------------------------

def up(plan: Plan, spec: str, *, runtime: str, state_dir: str | None, timeout: float, keep_on_failure: bool) -> int:
    model = preflight.model_path(plan)
    preflight.api_key(plan)
    base = root(state_dir)
    sd = StateDir(base, plan.name)
    previous = sd.load()
    rt = choose(_runtime(runtime, previous), say, base)
    with sd.lock(), _interrupts_raise():
        previous = sd.load()
        if previous is not None and previous.runtime != rt.name and _running(previous, base):
            raise RuntimeFailure(f"deployment {plan.name} is running on the {previous.runtime} runtime",
                                 value=rt.name, hint=f"deploykit down {plan.name} first, or pass --runtime "
                                                     f"{previous.runtime}")
        written = output.write(sd.rendered, render.render(plan, RENDER_TARGETS), force=True)
        say(f"rendered {len(written.written)} changed file(s) into {sd.rendered}")
        kept = previous if previous is not None and previous.runtime == rt.name else State(plan.name, rt.name)
        sd.save(replace(kept, runtime=rt.name, spec=str(Path(spec).resolve())))
        d = Deployment(plan, sd, model, spec, sd.salt(), rt.name)
        change = Change()
        start = time.monotonic()
        try:
            rt.apply(d, change, say, lambda m: wait_ready(rt, d, change, timeout, say, only=(m,)))
            wait_ready(rt, d, change, timeout, say)
        except (Exception, KeyboardInterrupt) as e:  # a bug still undoes what it started, then shows its traceback
            interrupted = isinstance(e, KeyboardInterrupt)
            if keep_on_failure:
                say(f"{'interrupted' if interrupted else 'up failed'}; left as it is (--keep-on-failure): "
                    f"deploykit status {plan.name} · deploykit logs {plan.name} · deploykit down {plan.name}")
                raise
            undone = True
            # Nothing started or stopped (refused by a check): a running deployment stays exactly as it was.
            if change.created or change.retired or change.network_created:
                say(f"{'interrupted' if interrupted else 'up failed'}: undoing what this up started")
                with _interrupts_ignored():
                    try:
                        rt.rollback(d, change, say)
                    except Exception as undo:  # report, but keep the original error as the one the user sees
                        undone = False
                        say(f"could not undo everything: {undo}; deploykit down {plan.name} removes the rest")
            if undone and previous is None:  # never came up: not a deployment `status` should list
                (sd.path / "state.json").unlink(missing_ok=True)
            raise
        rt.commit(d, change, say)
        sd.save(replace(sd.load() or kept, runtime=rt.name, image=change.image))
    say(f"ready in {time.monotonic() - start:.0f}s: {len(change.created)} started, {len(change.kept)} unchanged, "
        f"{len(change.retired)} replaced or removed")
    print(_endpoint_text(plan, rt.name))
    return 0


def wait_ready(rt: Runtime, d: Deployment, change: Change, timeout: float, say_,
               only: tuple[Member, ...] | None = None) -> None:
    """Every member's (or `only` these) /health answers 200; a member that exits or restarts meanwhile fails at once
    with its log. The load balancer is asked only once every replica is healthy: nginx counts a loading replica's 503
    as a failure and would shut it out for fail_timeout (30 s) after three of them."""
    start = last_report = time.monotonic()
    pending: dict[str, Member] = {m.name: m for m in (only or d.members)}
    states: dict[str, str] = {}
    while True:
        seen = rt.observe(d.name)
        replicas_ready = not any(m.replica is not None for m in pending.values())
        for name, m in list(pending.items()):
            o = seen.get(name)
            if o is None or o.state in ("exited", "dead", "restarting") or o.restarts > change.restarts.get(name, 0):
                what = "is gone" if o is None else f"exited during start-up ({o.detail or o.state})"
                raise RuntimeFailure(f"{name} {what}; its last log lines:\n" + _indent(rt.tail(d.name, name, TAIL)),
                                     hint="fix the error above (it is the engine's own message); "
                                          f"deploykit logs {d.name} shows everything")
            if m.replica is None and not replicas_ready:
                states[name] = "waiting for the replicas"
                continue
            a = rt.fetch(d.plan, m, "/health", timeout=health.HEALTH_TIMEOUT)
            if a.status == 200:
                pending.pop(name)
                say_(f"{name}: healthy after {time.monotonic() - start:.0f}s")
            else:
                states[name] = health.describe(a)
        if not pending:
            return
        now = time.monotonic()
        if now - start > timeout:
            logs = "\n".join(f"{n} ({states.get(n, '?')}), last log lines:\n{_indent(rt.tail(d.name, n, 20))}"
                             for n in pending)
            raise RuntimeFailure(f"not healthy within {timeout:g}s: {', '.join(pending)}\n{logs}",
                                 hint="a large model can need longer to load: --timeout SECONDS; "
                                      f"deploykit logs {d.name} shows everything")
        if now - last_report >= REPORT_EVERY:
            say_(f"waiting ({now - start:.0f}s): " + ", ".join(f"{n} {states.get(n, 'starting')}" for n in pending))
            last_report = now
        time.sleep(POLL)


def _endpoint_text(plan: Plan, runtime: str) -> str:
    base = url(plan.serving.publish_address, plan.serving.port, "/v1")
    name, key = plan.model.served_name, plan.serving.api_key_env
    n = len(plan.replicas)
    auth = f' -H "Authorization: Bearer ${key}"' if key else ""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
    api_key = f'os.environ["{key}"]' if key else '"unused"'
    lines = [
        f"deployment {plan.name} is up on the {runtime} runtime: {n} replica{'s' if n > 1 else ''}"
        + (" behind a load balancer" if plan.serving.load_balancer else ""),
        f"  endpoint: {base}   (model \"{name}\")",
    ]
    if plan.serving.publish_address.strip("[]") in ("0.0.0.0", "::"):
        lines.append(f"  (published on every interface of this host, port {plan.serving.port})")
    lines += [
        "  curl:",
        f"    curl -s {base}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        "  python (pip install openai):",
        "    import os; from openai import OpenAI",
        f"    client = OpenAI(base_url=\"{base}\", api_key={api_key})",
        f"    reply = client.chat.completions.create(model=\"{name}\", "
        "messages=[{\"role\": \"user\", \"content\": \"Hello!\"}])",
        "    print(reply.choices[0].message.content)",
        f"  deploykit status {plan.name} · deploykit logs {plan.name} -f · deploykit down {plan.name}",
    ]
    return "\n".join(lines)


# --- down, status, logs -------------------------------------------------------------------------------------------

def down(target: str | None, *, runtime: str | None, state_dir: str | None, volumes: bool) -> int:
    base = root(state_dir)
    name = resolve(target, base)
    sd = StateDir(base, name)
    state = sd.load()
    rt = choose(runtime or (state.runtime if state else "auto"), say, base)
    with (sd.lock() if sd.path.is_dir() else contextlib.nullcontext()), _interrupts_ignored():
        removed = rt.down(name, volumes, say)
        if volumes:
            sd.remove()
            removed.append(f"removed state directory {sd.path}")
        elif state is not None:
            (sd.path / "state.json").unlink(missing_ok=True)
    for what in removed:
        print(what)
    if not removed:
        print(f"deployment {name}: nothing to remove")
    elif not volumes and sd.path.is_dir():
        print(f"kept {sd.path} (rendered files, logs); --volumes removes it too")
    return 0


def status(target: str | None, *, runtime: str | None, state_dir: str | None, fmt: str, interval: float) -> int:
    from .status import collect, table
    base = root(state_dir)
    name = resolve(target, base)
    sd = StateDir(base, name)
    state = sd.load()
    if state is None:
        raise RuntimeFailure(f"deployment {name} is not up", value=name,
                             hint=f"deploykit up SPEC starts it (deployments that are up: "
                                  f"{', '.join(known(base)) or 'none'})")
    rt = choose(runtime or state.runtime, lambda _: None, base)
    plan = _plan(sd)
    rows = collect(rt, name, plan, interval)
    if fmt == "json":
        print(json.dumps({"deployment": name, "runtime": rt.name, "state_dir": str(sd.path),
                          "endpoint": url(plan.serving.publish_address, plan.serving.port, "/v1") if plan else None,
                          "members": rows}, indent=2, sort_keys=True))
    else:
        print(table(name, rt.name, plan, rows))
    return 0


def logs(target: str | None, member: str | None, *, runtime: str | None, state_dir: str | None, follow: bool,
         tail: int | None) -> int:
    base = root(state_dir)
    if member is None and target is not None and not os.path.isfile(target) and not (base / target).is_dir() \
            and len(known(base)) == 1:
        member, target = target, None  # `deploykit logs 1`: a replica of the only deployment
    name = resolve(target, base)
    sd = StateDir(base, name)
    state = sd.load()
    rt = choose(runtime or (state.runtime if state else "auto"), lambda _: None, base)
    plan = _plan(sd)
    names = [m.name for m in members(plan, rt.name)] if plan else sorted(rt.observe(name))
    if member is not None:
        wanted = {member, f"{name}-{member}"}
        picked = [n for n in names if n in wanted]
        if not picked:
            raise RuntimeFailure("no such replica in this deployment", path="REPLICA", value=member,
                                 allowed=", ".join([*(n.removeprefix(f'{name}-') for n in names), *names]))
        names = picked
    rt.logs(name, names, follow, tail)
    return 0


def resolve(target: str | None, base: Path) -> str:
    """A spec file (its deployment's name), a deployment name, or nothing when exactly one deployment is known."""
    if target is None:
        names = known(base)
        if len(names) == 1:
            return names[0]
        raise RuntimeFailure("which deployment?" if names else f"no deployment is up (state under {base})",
                             value=None, allowed=", ".join(names) or "", hint="name it: deploykit COMMAND NAME (or the "
                                                                               "spec file)")
    if os.path.isfile(target):
        from .. import specfile
        return specfile.load(target).name
    return target


def _runtime(requested: str, previous: State | None) -> str:
    """auto keeps a deployment on the runtime it already runs on."""
    return previous.runtime if requested == "auto" and previous is not None else requested


def _running(state: State, base: Path) -> bool:
    try:
        rt = choose(state.runtime, lambda _: None, base)
    except RuntimeFailure:  # that runtime is gone (Docker stopped): nothing of the deployment runs there
        return False
    return any(o.state == "running" for o in rt.observe(state.name).values())


def _plan(sd: StateDir) -> Plan | None:
    try:
        return Plan.from_json((sd.rendered / "plan.json").read_text())
    except (OSError, DeploykitError):
        return None


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in (text.strip().splitlines() or ["(no output)"]))


@contextlib.contextmanager
def _interrupts_raise() -> Iterator[None]:
    """SIGTERM during `up` is handled like Ctrl-C: undo, then exit."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """Cleaning up must not be cut short by a second Ctrl-C."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
