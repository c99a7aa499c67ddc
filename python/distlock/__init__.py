"""distlock: one distributed-lock API over Redis, etcd, PostgreSQL and memory.

The locking itself is the Rust library (``distlock._distlock``); this package
adds the asyncio glue and the Celery helpers (``distlock.celery``).

    import distlock

    locker = distlock.connect("redis://127.0.0.1:6379")
    with locker.lock("nightly-report", ttl=30) as guard:
        write_report(fencing_token=guard.fencing_token)
"""

from ._distlock import (
    ConfigError,
    Corrupted,
    FireOutcome,
    InvalidInput,
    LockError,
    LockGuard,
    LockHeld,
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
