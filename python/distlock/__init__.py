"""distlock (distribution ``distlock-rs``): one distributed-lock API over Redis, etcd, PostgreSQL and memory.

The locking itself is the Rust library (``distlock._distlock``); this package
adds the asyncio glue and the Celery helpers (``distlock.celery``).

    import distlock

    locker = distlock.connect("redis://127.0.0.1:6379")
    with locker.lock("nightly-report", ttl=30) as guard:
        write_report(fencing_token=guard.fencing_token)

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
    LockInfo,
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
    "LockInfo",
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
