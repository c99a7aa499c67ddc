"""Type stubs of the extension module (the Rust library)."""

import contextvars
import datetime
from types import TracebackType
from typing import (
    Any,
    Awaitable,
    Callable,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    Union,
    final,
)

from distlock._aio import AsyncAcquire

_Seconds = Union[int, float, datetime.timedelta]
_FireTime = Union[datetime.datetime, int, float, None]

class LockError(Exception):
    """Base class of every distlock error; each subclass is one kind of failure."""

class InvalidInput(LockError):
    """A bad argument (empty or oversized key, non-positive TTL, ...); retrying cannot help."""

class NotHeld(LockError):
    """The lock is no longer held: released, expired, or taken over."""

class LockLost(NotHeld):
    """The guard lost its lock (renewal refused, or the lease ran out) before it was released."""

class LockHeld(LockError):
    """Another owner holds the lock (after waiting up to `wait` seconds, if given)."""

class Unavailable(LockError):
    """The lock server could not be reached or refused the connection; retrying later may help."""

class Timeout(LockError):
    """A server operation did not finish within its timeout; whether it took effect is unknown."""

class Corrupted(LockError):
    """A value at a lock key was not written by distlock; it is reported, never overwritten."""

class ConfigError(LockError):
    """A bad lock URL or a backend this build does not include."""

class Unsupported(LockError):
    """The backend does not implement this optional operation."""

def connect(url: str) -> Locker:
    """Opens a lock client for `url` and returns its `Locker`.

    URLs: ``memory://[name]`` (in-process), ``redis://[user:pw@]host:port[/db]``,
    ``rediss://``, ``etcd://[user:pw@]host:port[,host:port...]``,
    ``postgres://user:pw@host:port/db``; each takes ``namespace=``,
    ``connect_timeout_ms=`` and ``operation_timeout_ms=`` in its query string.
    Raises `ConfigError` for a bad URL, `Unavailable` or `Timeout` if the
    server cannot be reached. A `Locker` used in a forked child process
    reconnects there by itself."""

def job_key(
    name: str,
    args: Optional[Sequence[Any]] = None,
    kwargs: Optional[Mapping[str, Any]] = None,
    only: Optional[Iterable[Union[str, int]]] = None,
) -> str:
    """The stable lock key of a job run: ``name`` without arguments, else
    ``name:<32 hex chars>``, a SHA-256 of the arguments in canonical JSON.

    The arguments are one JSON object: positional ones under their index
    ("0", "1", ...), keyword ones by name; ``only`` keeps just those names or
    indexes. The key equals Rust's
    ``JobKey::new(name).args(&that_object).only(&only).key()``. Raises
    `InvalidInput` for arguments without a JSON form (select others with
    ``only``), and for a name in ``only`` that is not among the arguments."""

def current_lock() -> Optional[LockGuard]:
    """The lock of the job running in this context (`Locker.run_once_per_fire`
    and the `distlock.celery` helpers), or ``None``."""

_current_lock: contextvars.ContextVar[Optional[LockGuard]]

def _check_lock_options(
    ttl: _Seconds,
    wait: Optional[_Seconds] = None,
    max_hold: Optional[_Seconds] = None,
    hold_at_least: Optional[_Seconds] = None,
) -> None:
    """Raises `InvalidInput` for options `Locker.lock` would refuse."""

def _check_schedule(period: _Seconds, ttl: Optional[_Seconds] = None, job_name: Optional[str] = None) -> None:
    """Raises `InvalidInput` for a schedule `Locker.run_once_per_fire` would refuse."""

def _stop_logging() -> None: ...
def _refresh_logging() -> None: ...

@final
class Locker:
    """A connection to one lock server; create it with `connect`. Safe to
    share between threads."""

    def lock(
        self,
        key: str,
        ttl: _Seconds,
        wait: Optional[_Seconds] = None,
        *,
        max_hold: Optional[_Seconds] = None,
        hold_at_least: Optional[_Seconds] = None,
        permits: Optional[int] = None,
        holder: Optional[str] = None,
    ) -> LockGuard:
        """Takes the lock `key` for `ttl` seconds (by the server's clock),
        renewed in the background every ttl/3 until released, and returns its
        guard (a context manager). Raises `LockHeld` if another owner holds
        it, after waiting up to `wait` seconds if given (woken by the server
        when it is released). `max_hold` stops renewal that long after
        acquisition; `hold_at_least` keeps the lock until then even if
        released sooner. With `permits=N` it takes one of N permits of the
        semaphore `key` instead (at most N holders at once; a semaphore's
        names are its own, apart from the locks'). `holder` labels the lock
        for people (`inspect` shows it as `LockInfo.holder`): a non-empty
        str of at most 128 UTF-8 bytes without control characters, else
        `InvalidInput`; never proof of ownership, and not stored by a backend
        without holder labels. The GIL is released while waiting."""

    def lock_async(
        self,
        key: str,
        ttl: _Seconds,
        wait: Optional[_Seconds] = None,
        *,
        max_hold: Optional[_Seconds] = None,
        hold_at_least: Optional[_Seconds] = None,
        permits: Optional[int] = None,
        holder: Optional[str] = None,
    ) -> AsyncAcquire[LockGuard]:
        """`lock` for asyncio: ``guard = await locker.lock_async(...)`` or
        ``async with locker.lock_async(...) as guard:``. Cancelling the
        awaiting task leaves no lock held."""

    def run_once_per_fire(
        self,
        job_name: str,
        period: _Seconds,
        fire_time: _FireTime,
        func: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> FireOutcome:
        """Runs ``func(*args, **kwargs)`` for the fire of `job_name` at
        `fire_time` (the time the scheduler fired, by its clock; ``None``:
        now) unless another instance already took that fire or the previous
        run is still going. Fires are whole periods since the Unix epoch; the
        fire's key is kept for three periods so late instances skip it.
        `func` runs in the calling thread; `current_lock()` is its lock. A
        Python function cannot be stopped from outside, so if the lock is
        lost it runs to its end and the outcome says `lost`. Exceptions of
        `func` propagate (the fire counts as taken). The lock held while
        `func` runs has a TTL of min(30 s, period); see
        `run_once_per_fire_with` to set it."""

    def run_once_per_fire_with(
        self,
        job_name: str,
        period: _Seconds,
        fire_time: _FireTime,
        ttl: Optional[_Seconds],
        func: Callable[..., Any],
        args: Tuple[Any, ...],
        kwargs: Optional[Mapping[str, Any]] = None,
    ) -> FireOutcome:
        """`run_once_per_fire` with the TTL of the lock held while `func`
        runs (renewed meanwhile; ``None``: min(30 s, period), at least 1 s),
        and `func`'s arguments passed as a tuple and a dict."""

    def inspect(self, key: str) -> Optional[LockInfo]:
        """Who holds `key`: ``None`` if nobody. An operator call (status
        pages, stuck locks): the answer is stale as soon as it arrives, so
        never decide whether to run a job by it. `Unsupported` if the
        backend has no operator calls."""

    def campaign(
        self,
        key: str,
        identity: Optional[str],
        ttl: _Seconds,
        timeout: Optional[_Seconds] = None,
    ) -> Leadership:
        """Campaigns for leadership of the election `key` as `identity` and
        returns the `Leadership` once this candidate leads (a context
        manager: leaving the block resigns). A leadership is the lock `key`
        labelled with `identity`, renewed every ttl/3; its term is the lock's
        fencing token. Waits however long it takes (``timeout=None``), woken
        by the server when the leader resigns or when its lease runs out;
        raises `LockHeld` if another candidate still leads after `timeout`
        seconds. `identity` is a label for people (`Leader.identity`): a
        non-empty str of at most 128 UTF-8 bytes without control characters,
        else `InvalidInput`; ``None`` is ``"<host name>:<pid>"``. Do not also
        take the lock `key` for other work. The GIL is released while
        waiting; Ctrl-C stops the campaign and leaves nothing held."""

    def campaign_async(
        self,
        key: str,
        identity: Optional[str],
        ttl: _Seconds,
        timeout: Optional[_Seconds] = None,
    ) -> AsyncAcquire[Leadership]:
        """`campaign` for asyncio: ``leadership = await
        locker.campaign_async(...)`` or ``async with
        locker.campaign_async(...) as leadership:``. Cancelling the awaiting
        task stops the campaign and leaves nothing held."""

    def leader(self, key: str) -> Optional[Leader]:
        """Who leads the election `key` now: ``None`` if nobody. Stale as
        soon as it arrives (for people and dashboards); `observe` follows
        changes. `Unsupported` if the backend has no operator calls."""

    def leader_async(self, key: str) -> Awaitable[Optional[Leader]]:
        """`leader` for asyncio: ``leader = await locker.leader_async(key)``."""

    def observe(self, key: str, poll_interval: Optional[_Seconds] = None) -> LeaderWatch:
        """Follows who leads the election `key`: iterate the `LeaderWatch`
        (``for`` or ``async for``) for each change, a `Leader` or ``None``
        (vacant). The first step answers at once; terms only grow. Woken by
        the server where the backend notifies changes (every backend; PostgreSQL
        not behind a transaction pooler without listen_url), else
        by reading at the leader's expiry and every `poll_interval` seconds
        (default 1)."""

    def inspect_permits(self, key: str) -> List[PermitInfo]:
        """The live permits of the semaphore `key` (``lock(key, ttl,
        permits=N)``), oldest first, each a `PermitInfo`; empty if none is
        held. An operator call: the answer is stale as soon as it arrives.
        Raises `Unsupported` on a backend without it."""

    def force_release(self, key: str) -> bool:
        """Deletes the lock at `key` whoever holds it, waking its waiters;
        returns whether one was held. The holder learns at its next renewal
        that it lost the lock. An operator call, for stuck locks."""

@final
class LockInfo:
    """Who holds a lock, as `Locker.inspect` read it."""

    fencing_token: int
    """The holder's fencing token."""
    expires_in: Optional[float]
    """Seconds left on the holder's lease by the server's clock (renewal
    extends it), or ``None`` if the backend does not tell."""
    holder: Optional[str]
    """The label the holder gave (`Locker.lock`'s ``holder``, a campaign's
    ``identity``), or ``None`` if it gave none or the backend stores no
    labels. For people: never proof of ownership."""

@final
class PermitInfo:
    """One live permit of a semaphore, as `Locker.inspect_permits` read it."""

    fencing_token: int
    """The permit's fencing token."""
    expires_in: Optional[float]
    """Seconds left on the permit's lease by the server's clock (renewal
    extends it), or ``None`` if the backend does not tell."""
    limit: int
    """The number of permits the semaphore is held under."""
    holder: Optional[str]
    """The label the holder gave (`Locker.lock`'s ``holder``), or ``None``
    if it gave none or the backend stores no permit labels. For people:
    never proof of ownership."""

@final
class LockGuard:
    """A held lock: renews itself in the background, tells when it is lost,
    and releases on `release()` or at the end of a ``with`` / ``async with``
    block (leaving the block raises `LockLost` if the lock was lost
    meanwhile, unless the block raised). A guard dropped without release is
    released in the background."""

    @property
    def key(self) -> str:
        """The key held."""
    @property
    def fencing_token(self) -> int:
        """Strictly greater than every earlier token for this key; pass it to
        the resource you protect so it can refuse stale writers."""
    @property
    def lost_reason(self) -> Optional[str]:
        """Why the lock was lost, or ``None``."""
    def is_lost(self) -> bool:
        """Whether the lock is known or assumed lost (renewal refused, or the
        lease ran out before a renewal succeeded)."""
    def raise_if_lost(self) -> None:
        """Raises `LockLost` if the lock is lost; call it before each write."""
    def wait_lost(self, timeout: Optional[_Seconds] = None) -> bool:
        """Blocks (GIL released) until the lock is lost or `timeout` seconds
        passed; returns `is_lost()`."""
    def release(self) -> None:
        """Stops renewal and releases. Raises `LockLost` if the lock was lost
        meanwhile; releasing twice does nothing."""
    def __enter__(self) -> LockGuard: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...
    async def __aenter__(self) -> LockGuard: ...
    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...

@final
class Leadership:
    """This candidate leads (`Locker.campaign`): renews itself in the
    background, tells when leadership is lost (before another candidate can
    lead), and resigns on `resign()` or at the end of a ``with`` / ``async
    with`` block (leaving the block raises `LockLost` if leadership was lost
    meanwhile, unless the block raised). A leadership dropped without
    resigning resigns in the background."""

    @property
    def key(self) -> str:
        """The election's key."""
    @property
    def term(self) -> int:
        """Strictly greater than every earlier leader's term (it is the
        lock's fencing token); pass it to what the leader writes so a deposed
        leader's late writes can be refused."""
    @property
    def identity(self) -> str:
        """The label this candidate campaigned with."""
    @property
    def lost_reason(self) -> Optional[str]:
        """Why leadership was lost, or ``None``."""
    def is_lost(self) -> bool:
        """Whether leadership is known or assumed lost."""
    def raise_if_lost(self) -> None:
        """Raises `LockLost` if leadership is lost; call it before each write."""
    def wait_lost(self, timeout: Optional[_Seconds] = None) -> bool:
        """Blocks (GIL released) until leadership is lost or `timeout`
        seconds passed; returns `is_lost()`."""
    def resign(self) -> None:
        """Steps down at once and wakes the next candidate. Raises `LockLost`
        if leadership was lost meanwhile; resigning twice does nothing."""
    def __enter__(self) -> Leadership: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...
    async def __aenter__(self) -> Leadership: ...
    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...

@final
class Leader:
    """Who leads an election, as the server said (`Locker.leader`,
    `LeaderWatch`). Equal when identity and term are."""

    identity: Optional[str]
    """The leader's label, or ``None`` if the backend stores no labels.
    For people: never proof of anything."""
    term: int
    """The leadership's term (its lock's fencing token), greater than every
    earlier leader's."""

@final
class LeaderWatch:
    """Follows who leads an election (`Locker.observe`). Each step of
    ``for`` (blocking, GIL released) or ``async for`` is the next change: a
    `Leader`, or ``None`` when vacant. The first step answers at once; later
    steps wait for a change. A leader of an older term than one already
    reported is never reported, and changes between two reads may be
    skipped (it reports states, not every transition). The iteration never
    ends by itself; a server error is raised from the step and the next
    step goes on. Stopping a step (Ctrl-C, task cancellation) loses nothing."""

    @property
    def key(self) -> str:
        """The election's key."""
    def __iter__(self) -> LeaderWatch: ...
    def __next__(self) -> Optional[Leader]: ...
    def __aiter__(self) -> LeaderWatch: ...
    def __anext__(self) -> Awaitable[Optional[Leader]]: ...

@final
class FireOutcome:
    """How one `Locker.run_once_per_fire` call ended on this instance."""

    ran: bool
    """Whether `func` ran here."""
    value: Any
    """What `func` returned (``None`` if it did not run)."""
    skipped: Optional[str]
    """``"fire_already_taken"`` or ``"previous_still_running"``; ``None`` if it ran."""
    lost: Optional[str]
    """Why the lock was lost while `func` ran, or ``None``."""
    fencing_token: Optional[int]
    """The fencing token of the run."""
    duration: Optional[float]
    """How long `func` ran, in seconds."""
