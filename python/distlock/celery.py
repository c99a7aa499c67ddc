"""Celery helpers: singleton tasks, and one run per Beat fire however many
Beat instances fire the schedule.

    from distlock.celery import once_per_fire, singleton

    @app.task
    @once_per_fire(period=60)          # Beat fires it every minute
    def nightly_report(): ...

    @app.task
    @singleton(ttl=300, key_args=["customer"])
    def send_invoice(customer, attempt=0): ...

The lock server's URL is the Celery setting ``distlock_url``
(``app.conf.distlock_url = "redis://..."``) or the ``DISTLOCK_URL``
environment variable.

Fire times: importing this module connects a ``before_task_publish`` handler
that stamps every message Celery Beat sends with Beat's clock at sending time
(header ``distlock_fire_time``). Beat imports the app's task modules, so
defining a task with these decorators is enough. Without that header the fire
time is read from the message's ``eta``, then ``expires`` (both the fire time
plus a constant offset, which labels fires just as well), and last from the
worker's clock, with a warning.
"""

import datetime
import functools
import inspect
import logging
import os
import threading
import time

from celery import Task, current_app, current_task, signals

import distlock

from . import _distlock

__all__ = [
    "FIRE_TIME_HEADER",
    "OncePerFireTask",
    "SingletonTask",
    "fire_time",
    "locker",
    "once_per_fire",
    "singleton",
]

logger = logging.getLogger("distlock.celery")

#: The message header holding the time Beat fired the task (Unix seconds).
FIRE_TIME_HEADER = "distlock_fire_time"

_in_beat = False
_lockers = {}
_lockers_mutex = threading.Lock()
_warned_no_fire_time = set()


@signals.beat_init.connect(weak=False)
def _mark_beat_process(sender=None, **_):
    # Celery before 5.5 does not mark Beat's messages; every message this
    # process sends is then a Beat fire.
    global _in_beat
    _in_beat = True


@signals.before_task_publish.connect(weak=False)
def _stamp_fire_time(sender=None, headers=None, **_):
    if headers is not None and (_in_beat or headers.get("celery_beat_task")):
        headers.setdefault(FIRE_TIME_HEADER, time.time())


def locker(app=None):
    """The ``Locker`` for ``app``'s ``distlock_url`` (or ``DISTLOCK_URL``),
    one per URL and process."""
    app = app or current_app
    url = app.conf.get("distlock_url") or os.environ.get("DISTLOCK_URL")
    if not url:
        raise distlock.ConfigError(
            "configuration error: no lock URL; set the Celery setting distlock_url "
            "(app.conf.distlock_url = 'redis://host:6379') or the DISTLOCK_URL environment variable"
        )
    with _lockers_mutex:
        found = _lockers.get(url)
        if found is None:
            found = _lockers[url] = distlock.connect(url)
        return found


def fire_time(request):
    """The fire time of a task request (Unix seconds), or ``None``: the Beat
    stamp, else ``eta``, else ``expires``."""
    stamp = getattr(request, FIRE_TIME_HEADER, None)
    if stamp is None:
        stamp = (getattr(request, "headers", None) or {}).get(FIRE_TIME_HEADER)
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool):
        return float(stamp)
    for name in ("eta", "expires"):
        moment = getattr(request, name, None)
        if isinstance(moment, str):
            moment = datetime.datetime.fromisoformat(moment)
        if isinstance(moment, datetime.datetime):
            return moment.timestamp()
    return None


def singleton(ttl, key_args=None):
    """Runs the task only while no other run of it (with the same selected
    arguments) holds its lock; a run that finds it held is skipped and logged
    and returns ``None``.

    ``ttl`` is the lock's time to live in seconds (renewed while the task
    runs, so a crashed worker frees it after at most ``ttl``). ``key_args``
    names the arguments that make runs distinct (default: all). If the lock is
    lost mid-run, renewal stops, ``distlock.current_lock().raise_if_lost()``
    raises, and the task raises ``LockLost`` when it returns."""
    return _task_decorator(_run_singleton, ttl, key_args)


def once_per_fire(period, key_args=None):
    """For a Beat-scheduled task fired every ``period`` seconds by any number
    of Beat instances: runs it once per fire, skipping (and logging) the
    other instances' messages for the same fire and any fire whose previous
    run is still going. Fires are told apart by the fire time Beat stamped on
    the message (see the module's doc). ``key_args`` selects the arguments
    that make schedule entries distinct (default: all)."""
    return _task_decorator(_run_once_per_fire, period, key_args)


def _task_decorator(runner, setting, key_args):
    def decorate(func):
        _check_key_args(func, key_args)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            task = _task_running(wrapper)
            return runner(task, func, func, setting, key_args, args, kwargs)

        return wrapper

    return decorate


class SingletonTask(Task):
    """A Task base class with the behaviour of ``singleton``:
    ``@app.task(base=SingletonTask, singleton_ttl=300, singleton_key_args=["customer"])``."""

    #: Lock TTL in seconds.
    singleton_ttl = 60.0
    #: Arguments that make runs distinct (``None``: all).
    singleton_key_args = None

    def __call__(self, *args, **kwargs):
        call = super().__call__
        return _run_singleton(
            self, self.run, call, self.singleton_ttl, self.singleton_key_args, args, kwargs
        )


class OncePerFireTask(Task):
    """A Task base class with the behaviour of ``once_per_fire``:
    ``@app.task(base=OncePerFireTask, once_per_fire_period=60)``."""

    #: The Beat schedule's period in seconds.
    once_per_fire_period = None
    #: Arguments that make schedule entries distinct (``None``: all).
    once_per_fire_key_args = None

    def __call__(self, *args, **kwargs):
        if self.once_per_fire_period is None:
            raise distlock.ConfigError(
                f"configuration error: task {self.name} uses OncePerFireTask without "
                "once_per_fire_period; pass it to @app.task(base=OncePerFireTask, once_per_fire_period=60)"
            )
        call = super().__call__
        return _run_once_per_fire(
            self, self.run, call, self.once_per_fire_period, self.once_per_fire_key_args, args, kwargs
        )


def _run_singleton(task, func, call, ttl, key_args, args, kwargs):
    name = _task_name(task, func)
    key = _job_key(name, func, args, kwargs, key_args)
    try:
        guard = locker(task.app if task else None).lock(key, ttl)
    except distlock.LockHeld:
        logger.info("distlock: skipping %s: another run holds the lock %r", name, key)
        return None
    # Leaving the block releases; a lock lost meanwhile raises LockLost.
    with guard:
        token = _distlock._current_lock.set(guard)
        try:
            return call(*args, **kwargs)
        finally:
            _distlock._current_lock.reset(token)


def _run_once_per_fire(task, func, call, period, key_args, args, kwargs):
    name = _task_name(task, func)
    job = _job_key(name, func, args, kwargs, key_args)
    fired = fire_time(task.request) if task else None
    if fired is None and name not in _warned_no_fire_time:
        _warned_no_fire_time.add(name)
        logger.warning(
            "distlock: %s has no fire time in its message; using this worker's clock. "
            "Import distlock.celery in the Beat process (defining the task there does it).",
            name,
        )
    outcome = locker(task.app if task else None).run_once_per_fire(
        job, period, fired, call, *args, **kwargs
    )
    if outcome.skipped:
        logger.info("distlock: skipping %s: %s", name, outcome.skipped.replace("_", " "))
        return None
    if outcome.lost:
        raise distlock.LockLost(
            f"lock lost: {job!r} was lost while the run of this fire went on ({outcome.lost}); "
            "the run completed, but another instance may have run the same fire"
        )
    return outcome.value


def _task_running(wrapper):
    """The Celery task executing ``wrapper`` now, or ``None`` (called
    directly, or from inside another task)."""
    task = current_task._get_current_object() if current_task else None
    if task is None:
        return None
    run = getattr(task.run, "__func__", task.run)
    while run is not None:
        if run is wrapper:
            return task
        run = getattr(run, "__wrapped__", None)
    return None


def _task_name(task, func):
    return task.name if task is not None else f"{func.__module__}.{func.__qualname__}"


def _check_key_args(func, key_args):
    if key_args is None:
        return
    if isinstance(key_args, str):
        raise distlock.InvalidInput(
            f"invalid input: key_args must be a list of argument names, not the string {key_args!r}"
        )
    names = inspect.signature(func).parameters
    unknown = [name for name in key_args if name not in names]
    if unknown:
        raise distlock.InvalidInput(
            f"invalid input: key_args {unknown} are not arguments of {func.__qualname__}"
            f" (it takes {list(names)})"
        )


def _job_key(name, func, args, kwargs, key_args):
    """The lock key of a run: the task name plus a hash of its arguments
    bound to their parameter names, so f(7) and f(customer=7) share a key."""
    arguments = _named_arguments(func, args, kwargs)
    if not arguments:
        return distlock.job_key(name)
    return distlock.job_key(name, kwargs=arguments, only=key_args)


def _named_arguments(func, args, kwargs):
    try:
        signature = inspect.signature(func)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        named = {str(index): value for index, value in enumerate(args)}
        named.update(kwargs)
        return named
    bound.apply_defaults()
    named = {}
    for parameter_name, value in bound.arguments.items():
        if isinstance(value, Task):
            continue  # the task itself, for bind=True tasks
        if signature.parameters[parameter_name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[parameter_name] = value
    return named
