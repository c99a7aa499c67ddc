"""distlock.celery: the decorators in-process, and the seed's scenario for
real (two Beat processes, two workers, a Redis broker)."""

import collections
import math
import os
import signal
import subprocess
import sys
import time
import types
import uuid

import pytest
import redis
from celery import Celery

import distlock
from distlock.celery import FIRE_TIME_HEADER, OncePerFireTask, SingletonTask, fire_time, once_per_fire, singleton

TESTS = os.path.dirname(os.path.abspath(__file__))


def make_app(url):
    app = Celery(f"test_{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.distlock_url = url
    return app


def test_singleton_skips_while_another_run_holds_the_lock():
    app = make_app(f"memory://{uuid.uuid4().hex}")
    runs = []

    @app.task
    @singleton(ttl=10, key_args=["customer"])
    def send_invoice(customer, attempt=0):
        runs.append((customer, attempt, distlock.current_lock().fencing_token))
        return customer

    key = distlock.job_key(send_invoice.name, kwargs={"customer": 7})
    with distlock.connect(app.conf.distlock_url).lock(key, ttl=10):
        assert send_invoice.apply((7,), {"attempt": 1}).get() is None  # skipped
        assert send_invoice.apply(kwargs={"customer": 8}).get() == 8  # other arguments run
    assert send_invoice.apply(kwargs={"customer": 7, "attempt": 2}).get() == 7
    assert [(c, a) for c, a, _ in runs] == [(8, 0), (7, 2)]
    # The lock was released after each run.
    assert send_invoice.apply((7,)).get() == 7


def test_singleton_with_bound_task_and_base_class():
    app = make_app(f"memory://{uuid.uuid4().hex}")
    seen = []

    @app.task(bind=True)
    @singleton(ttl=10)
    def bound(self, x):
        seen.append((self.name, x))
        return x

    @app.task(base=SingletonTask, singleton_ttl=10, singleton_key_args=["x"])
    def based(x, noise=None):
        # Calling itself while holding the lock: the inner run is skipped.
        inner = based.apply((x,), {"noise": "other"}).get() if noise is None else "inner"
        return (x, inner)

    assert bound.apply((3,)).get() == 3
    assert seen == [(bound.name, 3)]
    assert based.apply((1,)).get() == (1, None)


def test_singleton_raises_lock_lost(redis_server):
    namespace = "celery_" + uuid.uuid4().hex[:8]
    app = make_app(f"{redis_server.url}?namespace={namespace}")
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)

    @app.task
    @singleton(ttl=1.5)
    def doomed():
        lock = distlock.current_lock()
        client.delete(f"{namespace}:{{{lock.key}}}:lock")
        assert lock.wait_lost(timeout=30)
        with pytest.raises(distlock.LockLost):
            lock.raise_if_lost()
        return "finished"

    result = doomed.apply()
    assert isinstance(result.result, distlock.LockLost), result.result
    client.close()


def test_once_per_fire_in_process():
    app = make_app(f"memory://{uuid.uuid4().hex}")
    runs = []

    @app.task
    @once_per_fire(period=60)
    def report(region="eu"):
        runs.append(region)
        return region

    fire = {FIRE_TIME_HEADER: 1796040000.25}
    late = {FIRE_TIME_HEADER: 1796040030.0}  # another Beat, late for the same minute
    assert report.apply(headers=fire).get() == "eu"
    assert report.apply(headers=late).get() is None
    assert report.apply(("us",), headers=fire).get() == "us"  # other arguments: another job
    assert report.apply(headers={FIRE_TIME_HEADER: 1796040060.0}).get() == "eu"  # next fire
    assert runs == ["eu", "us", "eu"]


def test_fire_time_sources():
    request = types.SimpleNamespace(headers=None, eta=None, expires=None)
    assert fire_time(request) is None
    request.expires = "2026-11-30T12:00:30+00:00"
    assert fire_time(request) == 1796040030.0
    request.eta = "2026-11-30T12:00:00+00:00"
    assert fire_time(request) == 1796040000.0
    setattr(request, FIRE_TIME_HEADER, 1796040001.5)
    assert fire_time(request) == 1796040001.5


def test_configuration_errors(monkeypatch):
    monkeypatch.delenv("DISTLOCK_URL", raising=False)
    app = make_app(None)

    @app.task
    @singleton(ttl=10)
    def unconfigured():
        return 1

    assert isinstance(unconfigured.apply().result, distlock.ConfigError)
    monkeypatch.setenv("DISTLOCK_URL", f"memory://{uuid.uuid4().hex}")
    assert unconfigured.apply().get() == 1

    with pytest.raises(distlock.InvalidInput, match="not arguments"):
        singleton(ttl=10, key_args=["custmer"])(lambda customer: None)
    with pytest.raises(distlock.InvalidInput, match="list of argument names"):
        once_per_fire(period=10, key_args="customer")(lambda customer: None)

    @app.task(base=OncePerFireTask)
    def no_period():
        return 1

    assert isinstance(no_period.apply().result, distlock.ConfigError)


FIRES = 20


class Processes:
    def __init__(self, directory, env):
        self.directory = directory
        self.env = env
        self.running = {}

    def start(self, name, *args):
        log = os.path.join(self.directory, f"{name}.log")
        self.running[name] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "beat_app", *args, "--loglevel=INFO", f"--logfile={log}"],
            cwd=TESTS,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.directory, f"{name}.err"), "wb"),
            start_new_session=True,
        )

    def log(self, name):
        text = ""
        for suffix in ("log", "err"):
            path = os.path.join(self.directory, f"{name}.{suffix}")
            if os.path.exists(path):
                with open(path, errors="replace") as file:
                    text += file.read()
        return text

    def logs(self):
        return "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in self.running)

    def wait_for(self, condition, what, timeout):
        deadline = time.monotonic() + timeout
        while not condition():
            for name, process in self.running.items():
                if process.poll() is not None:
                    pytest.fail(f"{name} exited ({process.returncode}) while waiting for {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.1)

    def stop(self, *names):
        for name in names or list(self.running):
            process = self.running.pop(name)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def slot_counts(values):
    """How many records each fire (1-second slot of the stamped time) got."""
    counts = collections.Counter()
    for value in values:
        stamp = value.decode().split()[0]
        assert stamp != "None", "a message without the fire time Beat stamps"
        counts[math.floor(float(stamp))] += 1
    return counts


def test_two_beats_run_a_once_per_fire_task_once_per_fire(redis_server, tmp_path):
    base = redis_server.url
    record = redis.Redis.from_url(f"{base}/2")
    broker = redis.Redis.from_url(f"{base}/1")
    record.flushdb()
    broker.flushdb()
    env = {
        **os.environ,
        "PYTHONPATH": TESTS,
        "BEAT_TEST_BROKER": f"{base}/1",
        "BEAT_TEST_RECORD": f"{base}/2",
        "BEAT_TEST_LOCK_URL": f"{base}?namespace=beat_{uuid.uuid4().hex[:8]}",
    }
    processes = Processes(str(tmp_path), env)
    try:
        for worker in ("worker1", "worker2"):
            processes.start(
                worker, "worker", "-n", f"{worker}@%h", "--concurrency=2",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            )
        processes.wait_for(
            lambda: all(" ready." in processes.log(w) for w in ("worker1", "worker2")), "workers", 90
        )
        for beat in ("beat1", "beat2"):
            processes.start(beat, "beat", "-s", str(tmp_path / f"{beat}-schedule"),
                            f"--pidfile={tmp_path / (beat + '.pid')}")

        def fires_seen():
            return len(slot_counts(record.lrange("delivered:beat_app.guarded", 0, -1)))

        # Two more than counted: the first and last seconds may be partial.
        processes.wait_for(lambda: fires_seen() >= FIRES + 2, f"{FIRES + 2} fires", 120)
        processes.stop("beat1", "beat2")

        def drained():
            before = record.llen("delivered:beat_app.guarded") + record.llen("delivered:beat_app.plain")
            time.sleep(1.0)
            after = record.llen("delivered:beat_app.guarded") + record.llen("delivered:beat_app.plain")
            return broker.llen("celery") == 0 and before == after

        processes.wait_for(drained, "the queue to drain", 60)
    finally:
        processes.stop()

    delivered = slot_counts(record.lrange("delivered:beat_app.guarded", 0, -1))
    guarded = slot_counts(record.lrange("ran:beat_app.guarded", 0, -1))
    plain = slot_counts(record.lrange("ran:beat_app.plain", 0, -1))
    fires = sorted(delivered)[1 : FIRES + 1]
    summary = (
        f"over {len(fires)} fires: Beat messages per fire {[delivered[f] for f in fires]}; "
        f"runs per fire with once_per_fire {[guarded[f] for f in fires]} (total {sum(guarded[f] for f in fires)}); "
        f"without it {[plain[f] for f in fires]} (total {sum(plain[f] for f in fires)})"
    )
    print(summary)
    with open(os.environ.get("DISTLOCK_BEAT_SUMMARY", os.devnull), "a") as out:
        out.write(summary + "\n")
    assert len(fires) == FIRES
    # Both Beats fired nearly every fire...
    assert sum(delivered[f] for f in fires) >= FIRES * 2 - 3, summary
    # ...the guarded task ran exactly once for every fire, never twice...
    assert all(guarded[f] == 1 for f in fires), summary
    assert set(guarded) == set(delivered) and max(guarded.values()) == 1, summary
    # ...and the plain one ran once per Beat: twice for most fires.
    assert sum(plain[f] > 1 for f in fires) >= FIRES * 3 // 4, summary
