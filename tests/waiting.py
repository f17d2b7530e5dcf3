"""Test synchronisation in one place: wait for a condition instead of sleeping a guessed time and hoping."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, *,
               ignore: tuple[type[BaseException], ...] = (), what: str = "") -> T:
    """Call `predicate` every `interval` seconds until it returns something truthy, and return that. Exceptions of the
    `ignore` types count as "not yet" (e.g. a connection refused while a server starts); any other propagates. After
    `timeout` seconds it raises TimeoutError naming `what` (or the predicate), never returning a falsy value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what or predicate.__qualname__}")
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], Awaitable[T]], timeout: float = 30.0, interval: float = 0.05, *,
                           what: str = "") -> T:
    """wait_until for a coroutine predicate, inside a running event loop (which keeps running between calls)."""
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what or predicate.__qualname__}")
        await asyncio.sleep(interval)
    return value
