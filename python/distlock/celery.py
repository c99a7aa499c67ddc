"""Celery helpers: singleton tasks, and one run per Beat fire however many
Beat instances fire the schedule.

    from distlock.celery import once_per_fire, singleton

    @app.task
    @once_per_fire(period=60)          # Beat fires it every minute
    def nightly_report(): ...

    @app.task
    @singleton(ttl=300, key_args=["customer"])
    def send_invoice(customer, attempt=0): ...

The decorators go *below* ``@app.task`` (closest to the function); above it
they are refused at import. Every option is checked when decorating.

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

Skips: a run that does not happen is logged (logger ``distlock.celery``),
sent as the signal `task_skipped`, and returns ``None`` -- or raises
`DuplicateRun` with ``raise_on_duplicate=True``, so the task's state is
FAILURE instead of SUCCESS.

Publish-time dedup (``dedup_publish=``): importing this module wraps
``celery.Task.apply_async`` so that a task decorated with ``dedup_publish``
is not even queued while a duplicate is queued or running (singleton), or
when another Beat already sent the same fire (once_per_fire). Other tasks
pass through unchanged. The worker-side lock stays the proof: a message that
was queued anyway (lock server down at publish, marker expired) is still
skipped by the worker.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import math
import os
import threading
import time
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    cast,
)

from celery import Celery, Task, current_app, current_task, signals
from celery.local import Proxy
from celery.utils.dispatch import Signal

import distlock

from . import _distlock

if TYPE_CHECKING:
    from typing import Literal

    OnUnavailable = Literal["raise", "skip", "run", "retry"]
    _TaskBase = Task[Any, Any]
else:
    OnUnavailable = str
    _TaskBase = Task

__all__ = [
    "FIRE_TIME_HEADER",
    "QUEUED_HEADER",
    "DuplicateRun",
    "OncePerFireTask",
    "SingletonTask",
    "fire_time",
    "force_release",
    "inspect_lock",
    "locker",
    "once_per_fire",
    "singleton",
    "task_skipped",
]

logger = logging.getLogger("distlock.celery")

#: The message header holding the time Beat fired the task (Unix seconds).
FIRE_TIME_HEADER = "distlock_fire_time"
#: The message header naming the publish-time marker a message took
#: (``[key, fencing_token]``), cleared by the worker when the run ends.
QUEUED_HEADER = "distlock_queued"

#: Sent for every run that is skipped (or, for ``reason="queued"``, not
#: published): ``sender`` is the task, with ``key`` (the lock key),
#: ``reason`` (``"running"``, ``"fire_already_taken"``,
#: ``"previous_still_running"``, ``"queued"`` or ``"unavailable"``),
#: ``task_id``, ``args`` and ``kwargs``.
task_skipped = Signal(name="distlock_task_skipped")

Seconds = Union[int, float, datetime.timedelta]
F = TypeVar("F", bound=Callable[..., Any])

#: How long a publish-time marker lives by default (seconds): a message lost
#: before a worker ran it blocks its duplicates at most this long.
DEFAULT_DEDUP_SECONDS = 3600.0

_ON_UNAVAILABLE = ("raise", "skip", "run", "retry")

_in_beat = False
_lockers: Dict[str, distlock.Locker] = {}
_lockers_mutex = threading.Lock()
_warned_no_fire_time: set[str] = set()


class DuplicateRun(distlock.LockHeld):
    """A run (or a publish) skipped because a duplicate holds the lock,
    raised instead of returning ``None`` when ``raise_on_duplicate=True``."""


@signals.beat_init.connect(weak=False)
def _mark_beat_process(sender: Any = None, **_: Any) -> None:
    # Celery before 5.5 does not mark Beat's messages; every message this
    # process sends is then a Beat fire.
    global _in_beat
    _in_beat = True


@signals.before_task_publish.connect(weak=False)
def _stamp_fire_time(sender: Any = None, headers: Optional[Dict[str, Any]] = None, **_: Any) -> None:
    if headers is not None and (_in_beat or headers.get("celery_beat_task")):
        headers.setdefault(FIRE_TIME_HEADER, time.time())


@signals.after_setup_logger.connect(weak=False)
@signals.after_setup_task_logger.connect(weak=False)
@signals.worker_process_init.connect(weak=False)
def _logging_configured(**_: Any) -> None:
    # The Rust side forwards only what the `distlock` logger lets through.
    _distlock._refresh_logging()


def locker(app: Optional[Celery] = None) -> distlock.Locker:
    """The ``Locker`` for ``app``'s ``distlock_url`` (or ``DISTLOCK_URL``),
    one per URL and process."""
    app = app or current_app
    url = app.conf.get("distlock_url") or os.environ.get("DISTLOCK_URL")
    if not url:
        raise distlock.ConfigError(
            "configuration error: no lock URL; set the Celery setting distlock_url "
            "(app.conf.distlock_url = 'redis://host:6379') or the DISTLOCK_URL environment variable"
        )
    if not isinstance(url, str):
        raise distlock.ConfigError(
            f"configuration error: distlock_url must be a str such as 'redis://host:6379', not {type(url).__name__}"
        )
    with _lockers_mutex:
        found = _lockers.get(url)
        if found is None:
            found = _lockers[url] = distlock.connect(url)
        return found


def fire_time(request: Any) -> Optional[float]:
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


class _Spec:
    """One decorator's options, checked when it is created."""

    def __init__(
        self,
        kind: str,
        what: str,
        *,
        ttl: Optional[Seconds],
        period: Optional[Seconds],
        key_args: Optional[Sequence[str]],
        raise_on_duplicate: bool,
        on_unavailable: str,
        dedup_publish: Union[bool, Seconds, None],
    ) -> None:
        self.kind = kind
        self.what = what
        if kind == "singleton":
            if ttl is None:
                raise distlock.InvalidInput(f"invalid input: {what} needs ttl, the lock's time to live in seconds")
            _distlock._check_lock_options(ttl)
        else:
            if period is None:
                raise distlock.InvalidInput(f"invalid input: {what} needs period, the schedule's period in seconds")
            _distlock._check_schedule(period, ttl)
        self.ttl = ttl
        self.period = period
        self.key_args = _key_args(key_args, what)
        if not isinstance(raise_on_duplicate, bool):
            raise distlock.InvalidInput(
                f"invalid input: {what}: raise_on_duplicate must be True or False, not {type(raise_on_duplicate).__name__}"
            )
        self.raise_on_duplicate = raise_on_duplicate
        if on_unavailable not in _ON_UNAVAILABLE:
            raise distlock.InvalidInput(
                f"invalid input: {what}: on_unavailable must be one of {', '.join(map(repr, _ON_UNAVAILABLE))}, "
                f"not {on_unavailable!r}"
            )
        self.on_unavailable = on_unavailable
        self.dedup_seconds = self._dedup_seconds(dedup_publish)

    def _dedup_seconds(self, dedup_publish: Union[bool, Seconds, None]) -> Optional[float]:
        if dedup_publish is None or dedup_publish is False:
            return None
        if self.kind == "once_per_fire":
            if dedup_publish is not True:
                raise distlock.InvalidInput(
                    f"invalid input: {self.what}: dedup_publish must be True or False (a fire's marker "
                    "lives as long as the fire's own key: three periods)"
                )
            assert self.period is not None
            seconds = _seconds(self.period) * 3
        elif dedup_publish is True:
            seconds = DEFAULT_DEDUP_SECONDS
        else:
            _distlock._check_lock_options(dedup_publish)
            seconds = _seconds(dedup_publish)
        return max(seconds, 1.0)


def _seconds(value: Seconds) -> float:
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return float(value)


def _key_args(key_args: Optional[Sequence[str]], what: str) -> Optional[List[str]]:
    if key_args is None:
        return None
    if isinstance(key_args, (str, bytes)):
        raise distlock.InvalidInput(
            f"invalid input: {what}: key_args must be a list of argument names, not the string {key_args!r}"
        )
    try:
        names = list(key_args)
    except TypeError:
        raise distlock.InvalidInput(
            f"invalid input: {what}: key_args must be a list of argument names, not {type(key_args).__name__}"
        ) from None
    for name in names:
        if not isinstance(name, str):
            raise distlock.InvalidInput(
                f"invalid input: {what}: key_args must name arguments as strings, not {name!r}"
            )
    return names


def _options_or_function(value: Any, decorator: str, example: str) -> None:
    # `@singleton` without parentheses hands the function over as the first
    # option.
    if inspect.isfunction(value) or issubclass(type(value), (Task, Proxy)):
        raise TypeError(f"@{decorator} needs its options: write @{example}, not @{decorator}")


def singleton(
    ttl: Seconds,
    key_args: Optional[Sequence[str]] = None,
    *,
    raise_on_duplicate: bool = False,
    on_unavailable: OnUnavailable = "raise",
    dedup_publish: Union[bool, Seconds] = False,
) -> Callable[[F], F]:
    """Runs the task only while no other run of it (with the same selected
    arguments) holds its lock; a run that finds it held is skipped.

    - ``ttl``: the lock's time to live in seconds, renewed while the task
      runs, so a worker that crashed frees it after at most ``ttl``.
    - ``key_args``: the argument names that make runs distinct (default:
      all arguments).
    - ``raise_on_duplicate``: a skipped run raises `DuplicateRun` (task
      state FAILURE) instead of returning ``None`` (SUCCESS).
    - ``on_unavailable``: when the lock server cannot be reached (or times
      out): ``"raise"`` the error (default), ``"skip"`` the run, ``"run"``
      it without a lock, or ``"retry"`` it with Celery's ``Task.retry``
      (the task's ``default_retry_delay`` and ``max_retries``).
    - ``dedup_publish``: also refuse to *queue* a duplicate while one is
      queued or running: ``True`` (markers live at most an hour) or the
      seconds a marker lives at most (a message lost before it ran blocks
      duplicates that long).

    If the lock is lost mid-run, renewal stops,
    ``distlock.current_lock().raise_if_lost()`` raises, and the task raises
    `distlock.LockLost` when it returns."""
    _options_or_function(ttl, "singleton", "singleton(ttl=60)")
    spec = _Spec(
        "singleton",
        "singleton()",
        ttl=ttl,
        period=None,
        key_args=key_args,
        raise_on_duplicate=raise_on_duplicate,
        on_unavailable=on_unavailable,
        dedup_publish=dedup_publish,
    )
    return _task_decorator(spec)


def once_per_fire(
    period: Seconds,
    key_args: Optional[Sequence[str]] = None,
    *,
    ttl: Optional[Seconds] = None,
    raise_on_duplicate: bool = False,
    on_unavailable: OnUnavailable = "raise",
    dedup_publish: bool = False,
) -> Callable[[F], F]:
    """For a Beat-scheduled task fired every ``period`` seconds by any number
    of Beat instances: runs it once per fire, skipping the other instances'
    messages for the same fire and any fire whose previous run is still
    going. Fires are told apart by the fire time Beat stamped on the message
    (see the module's doc).

    - ``key_args``: the arguments that make schedule entries distinct
      (default: all).
    - ``ttl``: the time to live of the lock held while a run goes on,
      renewed while it runs (default: ``min(30, period)`` seconds, at least
      1): a worker killed mid-run blocks the next fires at most that long.
    - ``raise_on_duplicate``, ``on_unavailable``: as for `singleton`.
    - ``dedup_publish``: a Beat does not even queue a fire that another Beat
      already sent (the marker lives three periods)."""
    _options_or_function(period, "once_per_fire", "once_per_fire(period=60)")
    spec = _Spec(
        "once_per_fire",
        "once_per_fire()",
        ttl=ttl,
        period=period,
        key_args=key_args,
        raise_on_duplicate=raise_on_duplicate,
        on_unavailable=on_unavailable,
        dedup_publish=dedup_publish,
    )
    return _task_decorator(spec)


def _task_decorator(spec: _Spec) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        _refuse_task(func, spec)
        _check_key_args(func, spec.key_args, spec.what)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            task = _task_running(wrapper)
            return _run(spec, task, func, func, args, kwargs)

        setattr(wrapper, "_distlock_spec", spec)
        return cast(F, wrapper)

    return decorate


def _refuse_task(func: Any, spec: _Spec) -> None:
    # type(), not isinstance(): a lazy task is a Proxy that would be
    # evaluated (and the app finalized) by isinstance.
    kind = type(func)
    name = spec.what.rstrip("()")
    if issubclass(kind, (Task, Proxy)):
        raise TypeError(
            f"@{name}(...) is placed above @app.task, where it cannot protect the task; "
            f"put it below, closest to the function:\n\n    @app.task\n    @{name}(...)\n    def my_task(...): ..."
        )
    if not callable(func):
        raise TypeError(f"@{name}(...) decorates a function, not {kind.__name__}")


def _spec_of(task: Any) -> Optional[_Spec]:
    """The decorator options of ``task``'s function, if it has any."""
    run: Any = getattr(task, "run", None)
    run = getattr(run, "__func__", run)
    while run is not None:
        spec = getattr(run, "_distlock_spec", None)
        if isinstance(spec, _Spec):
            return spec
        run = getattr(run, "__wrapped__", None)
    return None


def _spec_from_class(cls: type, kind: str, label: str) -> _Spec:
    # Each base class's options are its own attributes, prefixed by its kind.
    def option(name: str) -> Any:
        return getattr(cls, f"{kind}_{name}")

    return _Spec(
        kind,
        f"{label} {cls.__name__}",
        ttl=option("ttl"),
        period=option("period") if kind == "once_per_fire" else None,
        key_args=option("key_args"),
        raise_on_duplicate=option("raise_on_duplicate"),
        on_unavailable=option("on_unavailable"),
        dedup_publish=option("dedup_publish"),
    )


class _LockedTask(_TaskBase):
    """What `SingletonTask` and `OncePerFireTask` share: the spec read from
    the class's options, a run under it, a publish through it."""

    _distlock_kind = ""
    _distlock_label = ""
    _distlock_spec: Optional[_Spec] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A task made by @app.task(base=...) has its own run; an
        # intermediate base class without options is checked when used.
        if "run" in cls.__dict__:
            cls._distlock_spec = cls._spec()

    @classmethod
    def _spec(cls) -> _Spec:
        return _spec_from_class(cls, cls._distlock_kind, cls._distlock_label)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self._distlock_spec or self._spec()
        return _run(spec, self, self.run, super().__call__, args, kwargs)

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        spec = self._distlock_spec or self._spec()
        return _publish(spec, self, _original_apply_async, args, kwargs, rest, options)


class SingletonTask(_LockedTask):
    """A Task base class with the behaviour of `singleton`:
    ``@app.task(base=SingletonTask, singleton_ttl=300, singleton_key_args=["customer"])``.
    The options are checked when the task class is created."""

    _distlock_kind = "singleton"
    _distlock_label = "SingletonTask"

    #: Lock TTL in seconds.
    singleton_ttl: Seconds = 60.0
    #: Arguments that make runs distinct (``None``: all).
    singleton_key_args: Optional[Sequence[str]] = None
    #: Raise `DuplicateRun` instead of returning ``None`` on a skip.
    singleton_raise_on_duplicate: bool = False
    #: ``"raise"``, ``"skip"``, ``"run"`` or ``"retry"``.
    singleton_on_unavailable: str = "raise"
    #: Publish-time dedup: ``False``, ``True`` or the marker's seconds.
    singleton_dedup_publish: Union[bool, Seconds] = False


class OncePerFireTask(_LockedTask):
    """A Task base class with the behaviour of `once_per_fire`:
    ``@app.task(base=OncePerFireTask, once_per_fire_period=60)``. The
    options are checked when the task class is created."""

    _distlock_kind = "once_per_fire"
    _distlock_label = "OncePerFireTask"

    #: The Beat schedule's period in seconds (required).
    once_per_fire_period: Optional[Seconds] = None
    #: Arguments that make schedule entries distinct (``None``: all).
    once_per_fire_key_args: Optional[Sequence[str]] = None
    #: The running lock's TTL (``None``: min(30, period)).
    once_per_fire_ttl: Optional[Seconds] = None
    #: Raise `DuplicateRun` instead of returning ``None`` on a skip.
    once_per_fire_raise_on_duplicate: bool = False
    #: ``"raise"``, ``"skip"``, ``"run"`` or ``"retry"``.
    once_per_fire_on_unavailable: str = "raise"
    #: Publish-time dedup of fires.
    once_per_fire_dedup_publish: bool = False


# --- publishing ---------------------------------------------------------------

# (A reload of this module must not wrap the wrapper.)
_original_apply_async: Callable[..., Any] = getattr(Task.apply_async, "_distlock_original", Task.apply_async)


def _apply_async(self: Any, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
    spec = _spec_of(self)
    if spec is None or spec.dedup_seconds is None:
        return _original_apply_async(self, args, kwargs, *rest, **options)
    return _publish(spec, self, _original_apply_async, args, kwargs, rest, options)


# Every task's apply_async; only decorated tasks with dedup_publish change.
setattr(_apply_async, "_distlock_original", _original_apply_async)
setattr(Task, "apply_async", _apply_async)


def _publish(
    spec: _Spec,
    task: Any,
    send: Callable[..., Any],
    args: Any,
    kwargs: Any,
    rest: Tuple[Any, ...],
    options: Dict[str, Any],
) -> Any:
    eager = options.get("always_eager", False) or bool(task.app.conf.task_always_eager)
    # A retry republishes the running message: it is not a duplicate.
    if spec.dedup_seconds is None or eager or options.get("retries"):
        return send(task, args, kwargs, *rest, **options)
    key = _job_key(task.name, _function_of(task), _bound_args(task, args), dict(kwargs or {}), spec.key_args)
    # A copy: the caller's dict (Beat's entry options) stays as it was.
    headers = dict(options.get("headers") or {})
    options["headers"] = headers
    if spec.kind == "once_per_fire":
        if not (_in_beat or headers.get("celery_beat_task")):
            return send(task, args, kwargs, *rest, **options)
        # The fire this message is for, stamped now so worker and marker agree.
        fired = headers.setdefault(FIRE_TIME_HEADER, time.time())
        assert spec.period is not None
        slot = math.floor(fired / _seconds(spec.period))
        marker = f"{key}@sent:{slot}"
    else:
        marker = f"{key}@queued"
    try:
        guard = locker(task.app).lock(marker, ttl=spec.dedup_seconds, hold_at_least=spec.dedup_seconds)
    except distlock.LockHeld:
        return _skip(spec, task, key, "queued", tuple(args or ()), dict(kwargs or {}), marker=marker)
    except (distlock.Unavailable, distlock.Timeout) as error:
        logger.warning("distlock: publishing %s without dedup: the lock server is unavailable (%s)", task.name, error)
        return send(task, args, kwargs, *rest, **options)
    # The marker stays until its time runs out, or the worker clears it.
    token = guard.fencing_token
    guard.release()
    if spec.kind == "singleton":
        headers[QUEUED_HEADER] = [marker, token]
    return send(task, args, kwargs, *rest, **options)


def _clear_queued(task: Any) -> None:
    """Clears the publish-time marker this message took, if it is still
    that one (a marker that expired and was taken again by a newer message
    is left alone)."""
    if task is None:
        return
    queued = getattr(task.request, QUEUED_HEADER, None)
    if queued is None:
        queued = (getattr(task.request, "headers", None) or {}).get(QUEUED_HEADER)
    if not (isinstance(queued, (list, tuple)) and len(queued) == 2):
        return
    marker, token = queued
    try:
        held = locker(task.app).inspect(marker)
        if held is not None and held.fencing_token == token:
            locker(task.app).force_release(marker)
    except distlock.LockError as error:
        logger.warning("distlock: could not clear the publish marker %r: %s; it expires by itself", marker, error)


# --- running --------------------------------------------------------------------


def _run(
    spec: _Spec,
    task: Any,
    func: Callable[..., Any],
    call: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
) -> Any:
    try:
        if spec.kind == "singleton":
            return _run_singleton(spec, task, func, call, args, kwargs)
        return _run_once_per_fire(spec, task, func, call, args, kwargs)
    finally:
        if spec.dedup_seconds is not None and spec.kind == "singleton":
            _clear_queued(task)


def _run_singleton(
    spec: _Spec,
    task: Any,
    func: Callable[..., Any],
    call: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
) -> Any:
    name = _task_name(task, func)
    key = _job_key(name, func, args, kwargs, spec.key_args)
    assert spec.ttl is not None
    try:
        guard = locker(task.app if task else None).lock(key, spec.ttl)
    except distlock.LockHeld:
        return _skip(spec, task, key, "running", args, kwargs, name=name)
    except (distlock.Unavailable, distlock.Timeout) as error:
        return _unavailable(spec, task, key, error, call, args, kwargs, name=name)
    token = _distlock._current_lock.set(guard)
    try:
        result = call(*args, **kwargs)
    except BaseException:
        _distlock._current_lock.reset(token)
        try:
            guard.release()
        except distlock.LockError:
            pass  # the task's own error wins
        raise
    _distlock._current_lock.reset(token)
    try:
        guard.release()
    except distlock.LockLost:
        raise
    except distlock.LockError as error:
        # The run completed; the lock expires by its TTL.
        logger.warning("distlock: %s ran, but releasing its lock %r failed: %s", name, key, error)
    return result


def _run_once_per_fire(
    spec: _Spec,
    task: Any,
    func: Callable[..., Any],
    call: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
) -> Any:
    name = _task_name(task, func)
    job = _job_key(name, func, args, kwargs, spec.key_args)
    fired = fire_time(task.request) if task else None
    if fired is None and name not in _warned_no_fire_time:
        _warned_no_fire_time.add(name)
        logger.warning(
            "distlock: %s has no fire time in its message; using this worker's clock. "
            "Import distlock.celery in the Beat process (defining the task there does it).",
            name,
        )
    assert spec.period is not None
    try:
        outcome = locker(task.app if task else None).run_once_per_fire_with(
            job, spec.period, fired, spec.ttl, call, args, kwargs
        )
    except (distlock.Unavailable, distlock.Timeout) as error:
        return _unavailable(spec, task, job, error, call, args, kwargs, name=name)
    if outcome.skipped:
        return _skip(spec, task, job, outcome.skipped, args, kwargs, name=name)
    if outcome.lost:
        raise distlock.LockLost(
            f"lock lost: {job!r} was lost while the run of this fire went on ({outcome.lost}); "
            "the run completed, but another instance may have run the same fire"
        )
    return outcome.value


_SKIP_WORDS = {
    "running": "another run holds the lock",
    "fire_already_taken": "this fire already ran (or runs) elsewhere",
    "previous_still_running": "the previous fire's run is still going",
    "queued": "a duplicate is already queued or running; not queued",
    "unavailable": "the lock server is unavailable (on_unavailable='skip')",
}


def _skip(
    spec: _Spec,
    task: Any,
    key: str,
    reason: str,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    name: Optional[str] = None,
    marker: Optional[str] = None,
) -> None:
    name = name or getattr(task, "name", None) or key
    logger.info("distlock: skipping %s: %s (%r)", name, _SKIP_WORDS.get(reason, reason), marker or key)
    request = getattr(task, "request", None) if reason != "queued" else None
    task_skipped.send(
        sender=task,
        key=key,
        reason=reason,
        task_id=getattr(request, "id", None),
        args=args,
        kwargs=kwargs,
    )
    if spec.raise_on_duplicate and reason != "unavailable":
        raise DuplicateRun(f"lock held: {name} skipped: {_SKIP_WORDS.get(reason, reason)} (key {key!r})")
    return None


def _unavailable(
    spec: _Spec,
    task: Any,
    key: str,
    error: distlock.LockError,
    call: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    name: str,
) -> Any:
    policy = spec.on_unavailable
    if policy == "skip":
        logger.warning("distlock: %s not run: %s", name, error)
        return _skip(spec, task, key, "unavailable", args, kwargs, name=name)
    if policy == "run":
        logger.warning("distlock: %s runs WITHOUT its lock (on_unavailable='run'): %s", name, error)
        return call(*args, **kwargs)
    if policy == "retry" and task is not None and not task.request.called_directly:
        logger.warning("distlock: %s will be retried by Celery: %s", name, error)
        raise task.retry(exc=error)
    raise error


def _task_running(wrapper: Callable[..., Any]) -> Any:
    """The Celery task executing ``wrapper`` now, or ``None`` (called
    directly, or from inside another task)."""
    task: Any = current_task._get_current_object() if current_task else None  # type: ignore[attr-defined]
    if task is None:
        return None
    run: Any = getattr(task.run, "__func__", task.run)
    while run is not None:
        if run is wrapper:
            return task
        run = getattr(run, "__wrapped__", None)
    return None


def _function_of(task: Any) -> Callable[..., Any]:
    """The user's function of a task (below our wrapper, if any)."""
    run: Any = getattr(task.run, "__func__", task.run)
    while getattr(run, "_distlock_spec", None) is not None and getattr(run, "__wrapped__", None) is not None:
        run = run.__wrapped__
    return cast(Callable[..., Any], run)


def _bound_args(task: Any, args: Any) -> Tuple[Any, ...]:
    """The arguments a run of ``task`` gets: with ``bind=True`` the task
    itself comes first (and is left out of the key)."""
    given: Tuple[Any, ...] = tuple(args or ())
    if getattr(task.run, "__self__", None) is task:
        return (task, *given)
    return given


def _task_name(task: Any, func: Callable[..., Any]) -> str:
    if task is not None:
        return str(task.name)
    return f"{func.__module__}.{func.__qualname__}"


def _check_key_args(func: Callable[..., Any], key_args: Optional[List[str]], what: str) -> None:
    if key_args is None:
        return
    names = inspect.signature(func).parameters
    unknown = [name for name in key_args if name not in names]
    if unknown:
        raise distlock.InvalidInput(
            f"invalid input: {what}: key_args {unknown} are not arguments of {func.__qualname__}"
            f" (it takes {list(names)})"
        )


def _job_key(
    name: str,
    func: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Mapping[str, Any],
    key_args: Optional[List[str]],
) -> str:
    """The lock key of a run: the task name plus a hash of its arguments
    bound to their parameter names, so f(7) and f(customer=7) share a key."""
    arguments = _named_arguments(func, args, kwargs)
    if not arguments:
        return distlock.job_key(name)
    return distlock.job_key(name, kwargs=arguments, only=key_args)


def _named_arguments(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
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


# --- operator calls -------------------------------------------------------------


def _run_key(task: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[_Spec, str]:
    spec = _spec_of(task) or getattr(task, "_distlock_spec", None)
    if not isinstance(spec, _Spec):
        raise distlock.InvalidInput(
            f"invalid input: task {getattr(task, 'name', task)!r} is not decorated with singleton or once_per_fire"
        )
    key = _job_key(task.name, _function_of(task), _bound_args(task, args), kwargs, spec.key_args)
    if spec.kind == "once_per_fire":
        key = f"{key}@running"
    return spec, key


def inspect_lock(task: Any, *args: Any, **kwargs: Any) -> Optional[distlock.LockInfo]:
    """Who holds the lock of ``task`` called with ``args``/``kwargs``
    (once_per_fire: the lock held while a run goes on): ``None`` if nobody,
    else a `distlock.LockInfo`. An operator call: the answer is stale at
    once."""
    _, key = _run_key(task, args, kwargs)
    return locker(task.app).inspect(key)


def force_release(task: Any, *args: Any, **kwargs: Any) -> bool:
    """Deletes the lock of ``task`` called with ``args``/``kwargs`` whoever
    holds it (once_per_fire: the lock held while a run goes on), and its
    publish-time marker (singleton); returns whether a run lock was held.
    For a stuck lock; a run still going learns at its next renewal that it
    lost the lock."""
    spec, key = _run_key(task, args, kwargs)
    the_locker = locker(task.app)
    if spec.kind == "singleton":
        the_locker.force_release(f"{key}@queued")
    return the_locker.force_release(key)
