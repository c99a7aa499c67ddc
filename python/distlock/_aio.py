"""asyncio glue: the Rust side runs an operation on its runtime and calls
back with ``(ok, value)`` from a runtime thread; this module turns that into
an awaitable on the caller's event loop, and cancels the operation (which is
cancel-safe) when the awaiting task is cancelled."""

import asyncio
from typing import TYPE_CHECKING, Any, Generator

if TYPE_CHECKING:
    from ._distlock import LockGuard


def _discard(ok, value):
    # A guard nobody will receive: release it in the background.
    if ok and hasattr(value, "_abandon"):
        value._abandon()


def _settle(future, ok, value):
    if future.cancelled():
        _discard(ok, value)
    elif ok:
        future.set_result(value)
    else:
        future.set_exception(value)


async def run(start):
    """Awaits the operation that ``start(done)`` launches."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def done(ok, value):
        try:
            loop.call_soon_threadsafe(_settle, future, ok, value)
        except RuntimeError:  # the loop was closed meanwhile
            _discard(ok, value)

    handle = start(done)
    try:
        return await future
    except asyncio.CancelledError:
        handle.cancel()
        raise


class AsyncAcquire:
    """What ``Locker.lock_async`` returns: await it for the guard, or use it
    with ``async with`` (released at the end of the block)."""

    __slots__ = ("_start", "_guard")

    def __init__(self, start):
        self._start = start
        self._guard = None

    def __await__(self) -> "Generator[Any, None, LockGuard]":
        return run(self._start).__await__()

    async def __aenter__(self) -> "LockGuard":
        self._guard = await run(self._start)
        return self._guard

    async def __aexit__(self, exc_type, exc, traceback) -> bool:
        return await release(self._guard, exc_type)


async def ready(guard):
    return guard


async def release(guard, exc_type=None):
    """Releases ``guard``; an exception of the block wins over a release
    error."""
    try:
        await run(guard._release_start)
    except Exception:
        if exc_type is None:
            raise
    return False
