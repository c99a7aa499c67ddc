"""asyncio glue: the Rust side runs an operation on its runtime and calls
back with ``(ok, value)`` from a runtime thread; this module turns that into
an awaitable on the caller's event loop, and cancels the operation (which is
cancel-safe) when the awaiting task is cancelled."""

import asyncio
from types import TracebackType
from typing import Any, Callable, Generator, Generic, Optional, Protocol, Type, TypeVar


class _Handle(Protocol):
    def cancel(self) -> None: ...


_Done = Callable[[bool, Any], None]
_Start = Callable[[_Done], _Handle]
# What an acquisition yields: a LockGuard or a Leadership.
_Held = TypeVar("_Held")


def _discard(ok: bool, value: Any) -> None:
    # A guard (or leadership) nobody will receive: release it in the
    # background.
    if ok and hasattr(value, "_abandon"):
        value._abandon()


def _settle(future: "asyncio.Future[Any]", ok: bool, value: Any) -> None:
    if future.cancelled():
        _discard(ok, value)
    elif ok:
        future.set_result(value)
    else:
        future.set_exception(value)


async def run(start: _Start) -> Any:
    """Awaits the operation that ``start(done)`` launches."""
    loop = asyncio.get_running_loop()
    future: "asyncio.Future[Any]" = loop.create_future()

    def done(ok: bool, value: Any) -> None:
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


class AsyncAcquire(Generic[_Held]):
    """What ``Locker.lock_async`` (``Locker.campaign_async``) returns: await
    it for the guard (the leadership), or use it with ``async with``
    (released, resigned, at the end of the block)."""

    __slots__ = ("_start", "_guard")

    def __init__(self, start: _Start) -> None:
        self._start = start
        self._guard: Optional[_Held] = None

    def __await__(self) -> Generator[Any, None, _Held]:
        guard: _Held = yield from run(self._start).__await__()
        return guard

    async def __aenter__(self) -> _Held:
        guard: _Held = await run(self._start)
        self._guard = guard
        return guard

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool:
        return await release(self._guard, exc_type)


async def ready(guard: _Held) -> _Held:
    return guard


async def release(guard: Any, exc_type: Optional[Type[BaseException]] = None) -> bool:
    """Releases ``guard``; an exception of the block wins over a release
    error."""
    try:
        await run(guard._release_start)
    except Exception:
        if exc_type is None:
            raise
    return False
