"""distlock (distribution ``distlock-rs``): one distributed-lock API over Redis, etcd, PostgreSQL and memory.

The locking itself is the Rust library (``distlock._distlock``); this package
adds the asyncio glue and the Celery helpers (``distlock.celery``).

    import distlock

    locker = distlock.connect("redis://127.0.0.1:6379")
    with locker.lock("nightly-report", ttl=30) as guard:
        write_report(fencing_token=guard.fencing_token)

Holder identity: ``locker.lock(key, ttl, holder="worker-3:4242")`` stores a
label with the lock for people; ``locker.inspect(key).holder`` reads it back
(``None`` on a backend that stores no labels). A label is a non-empty str of
at most 128 UTF-8 bytes without control characters (else `InvalidInput`),
and never proof of ownership: only the guard can renew or release its lock.

Leader election: one candidate of a key leads at a time, the others stand
by, and anyone can see who leads. A leadership is the lock ``key`` labelled
with the candidate's identity; its term is the lock's fencing token, so
terms only grow::

    with locker.campaign("scheduler", "instance-a", ttl=10) as leadership:
        # Leading until the block ends (resigns: the next candidate is
        # woken at once) or leadership is lost.
        while not leadership.is_lost():
            schedule_jobs(term=leadership.term)

    locker.leader("scheduler")      # Leader(identity='instance-a', term=7) or None
    for leader in locker.observe("scheduler", poll_interval=1):
        print(leader)               # None (vacant), then each new leader

``campaign`` waits however long it takes (``timeout=`` to give up with
`LockHeld`); ``identity=None`` is ``"<host name>:<pid>"``. The asyncio forms
are ``async with locker.campaign_async(...)``, ``await
locker.leader_async(key)`` and ``async for leader in locker.observe(key)``.
Blocking calls release the GIL; Ctrl-C or cancelling the task stops a
campaign with nothing held.

The library's log events (acquire, skip, renewal failure, lost, release)
go to Python's ``logging``, on the loggers ``distlock.core``,
``distlock.redis``, ... under ``distlock``.
"""

import atexit as _atexit

from . import _distlock
from ._distlock import (
    ConfigError,
    Corrupted,
    FireOutcome,
    InvalidInput,
    LockError,
    LockGuard,
    LockHeld,
    Leader,
    LeaderWatch,
    Leadership,
    LockInfo,
    PermitInfo,
    LockLost,
    Locker,
    NotHeld,
    Timeout,
    Unavailable,
    Unsupported,
    connect,
    current_lock,
    job_key,
)

__all__ = [
    "ConfigError",
    "Corrupted",
    "FireOutcome",
    "InvalidInput",
    "LockError",
    "LockGuard",
    "LockHeld",
    "Leader",
    "LeaderWatch",
    "Leadership",
    "LockInfo",
    "PermitInfo",
    "LockLost",
    "Locker",
    "NotHeld",
    "Timeout",
    "Unavailable",
    "Unsupported",
    "connect",
    "current_lock",
    "job_key",
]

# Log records are handed to Python from a thread of the extension; it must
# stop taking the GIL before the interpreter shuts down.
_atexit.register(_distlock._stop_logging)
