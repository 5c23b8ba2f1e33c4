"""Waiting for the thing, not sleeping: the test suite's pollers.

`wait_until` (sync) and `eventually` (async) poll a condition until it holds
and fail after a timeout; `holds_for` (sync) and `consistently` (async) are the
negative check over time that must pass (past a lease): they ask throughout
and fail at the first miss. Free
of side effects on import (tests/etcd.py, which benchmarks reuse, imports it);
tests/conftest.py re-exports them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest


async def eventually(check: Callable[[], Awaitable[object] | object], timeout_s: float = 10.0,
                     what: str | Callable[[], object] = "", interval_s: float = 0.01) -> None:
    """Waits until `check()` (or what it awaits) is true; fails after
    `timeout_s`, saying `what` (or what a callable `what` returns then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s} s: {what() if callable(what) else what or check}")
        await asyncio.sleep(interval_s)


def wait_until(check: Callable[[], object], timeout_s: float = 10.0, what: str | Callable[[], object] = "",
               interval_s: float = 0.02) -> object:
    """Waits until `check()` is truthy and returns that value; fails after
    `timeout_s`, saying `what` (or what a callable `what` returns then: a log's
    tail). The one poller of the synchronous tests, instead of sleeps."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what() if callable(what) else what or check}")
        time.sleep(interval_s)


def holds_for(check: Callable[[], object], seconds: float, what: str = "", interval_s: float = 0.1) -> None:
    """A negative check: `check()` stays truthy for `seconds` (time that must
    pass, e.g. past a lease), asked every `interval_s`; fails at its first miss."""
    deadline = time.monotonic() + seconds
    while True:
        if not check():
            pytest.fail(f"no longer true after {seconds - (deadline - time.monotonic()):.1f} s: {what or check}")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval_s)


async def consistently(check: Callable[[], Awaitable[object] | object], seconds: float, what: str = "",
                       interval_s: float = 0.1) -> None:
    """The async holds_for: `check()` (or what it awaits) stays truthy for
    `seconds`, asked every `interval_s` without blocking the event loop (an
    in-process server keeps serving); fails at its first miss."""
    deadline = time.monotonic() + seconds
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if not result:
            pytest.fail(f"no longer true after {seconds - (deadline - time.monotonic()):.1f} s: {what or check}")
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(interval_s)
