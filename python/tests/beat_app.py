"""The seed's setup for real: a Celery app whose Beat schedule fires two tasks
every second, one under `once_per_fire` and one without. Several Beat
processes run this same schedule; every run and every delivered message is
recorded in Redis with the fire time Beat stamped on it."""

import os
import time

import redis
from celery import Celery, current_task, signals

import distlock
from distlock.celery import fire_time, once_per_fire, task_skipped

app = Celery("beat_app", broker=os.environ["BEAT_TEST_BROKER"])
app.conf.distlock_url = os.environ["BEAT_TEST_LOCK_URL"]
app.conf.broker_connection_retry_on_startup = True
if os.environ.get("BEAT_TEST_SCENARIO") == "kill":
    # One long run per fire at most; a worker running it is killed.
    app.conf.beat_schedule = {"slow-every-second": {"task": "beat_app.slow", "schedule": 1.0}}
else:
    app.conf.beat_schedule = {
        "guarded-every-second": {"task": "beat_app.guarded", "schedule": 1.0},
        "plain-every-second": {"task": "beat_app.plain", "schedule": 1.0},
        "deduped-every-second": {"task": "beat_app.deduped", "schedule": 1.0},
    }

_record = redis.Redis.from_url(os.environ["BEAT_TEST_RECORD"])


@signals.task_prerun.connect
def _delivered(sender=None, task=None, **_):
    # Every message a worker starts, before any lock: one per Beat fire.
    _record.rpush(f"delivered:{task.name}", repr(fire_time(task.request)))


@task_skipped.connect
def _skipped(sender=None, reason=None, **_):
    # Every skip by a worker, with its reason: a fire that did not run must
    # say why.
    if reason != "queued":
        _record.rpush(f"skipped:{sender.name}", f"{fire_time(sender.request)!r} {reason}")


def _ran(name):
    lock = distlock.current_lock()
    token = lock.fencing_token if lock is not None else 0
    _record.rpush(f"ran:{name}", f"{fire_time(current_task.request)!r} {os.getpid()} {token}")


@app.task
@once_per_fire(period=1)
def guarded():
    _ran("beat_app.guarded")


@app.task
def plain():
    _ran("beat_app.plain")


@app.task
@once_per_fire(period=1, dedup_publish=True)
def deduped():
    # The second Beat's message for a fire is not even queued.
    _ran("beat_app.deduped")


#: The running lock's TTL of `slow`, in seconds.
SLOW_TTL = 3


@app.task
@once_per_fire(period=1, ttl=SLOW_TTL)
def slow():
    # The start by the lock server's clock (the record is on the same server).
    seconds, micros = _record.time()
    lock = distlock.current_lock()
    _record.rpush("started:beat_app.slow", f"{seconds + micros / 1e6!r} {os.getpid()} {lock.fencing_token}")
    deadline = time.monotonic() + 60
    while not _record.exists("stop:beat_app.slow") and time.monotonic() < deadline:
        time.sleep(0.05)
