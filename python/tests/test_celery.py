"""distlock.celery: the decorators in-process, and the seed's scenario for
real (two Beat processes, two workers, a Redis broker)."""

import collections
import logging
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
import servers
from distlock.celery import (
    FIRE_TIME_HEADER,
    QUEUED_HEADER,
    DuplicateRun,
    OncePerFireTask,
    SingletonTask,
    fire_time,
    force_release,
    inspect_lock,
    once_per_fire,
    singleton,
    task_skipped,
)

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

    # A base class without its required option is refused when the task is made.
    with pytest.raises(distlock.InvalidInput, match="needs period"):
        @app.task(base=OncePerFireTask, shared=False, lazy=False)
        def no_period():
            return 1


RUST_WORDS = ["stop margin", "JobKey", "lock_core", "distlock_core", "Duration", "::", "PyString", "µs", "ms "]


def assert_python_words(message):
    for word in RUST_WORDS:
        assert word not in message, f"{word!r} in a Python message: {message}"


def test_decorator_above_app_task_is_refused_at_import():
    app = make_app(f"memory://{uuid.uuid4().hex}")
    for decorator in (singleton(ttl=10), once_per_fire(period=60)):
        # A lazy task (a Proxy: the app is not finalized) and a finished one.
        with pytest.raises(TypeError, match=r"above @app.task.*put it below") as caught:
            @decorator
            @app.task(shared=False)
            def lazy():
                pass
        assert "@app.task\n    @" in str(caught.value)
        finished = make_app(f"memory://{uuid.uuid4().hex}")
        finished.finalize()

        def plain():
            pass

        with pytest.raises(TypeError, match="put it below"):
            decorator(finished.task(plain, shared=False))
    with pytest.raises(TypeError, match=r"needs its options: write @singleton\(ttl=60\)"):
        @singleton
        def forgot_parentheses():
            pass


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: singleton(ttl=0), "ttl is 0"),
        (lambda: singleton(ttl="abc"), "ttl must be a number of seconds or a datetime.timedelta, not str"),
        (lambda: singleton(ttl=-5), "ttl is negative"),
        (lambda: singleton(ttl=0.001), "ttl of 0.001 s is too short"),
        (lambda: singleton(ttl=10, key_args="customer"), "key_args must be a list of argument names"),
        (lambda: singleton(ttl=10, key_args=[1]), "key_args must name arguments as strings"),
        (lambda: singleton(ttl=10, on_unavailable="later"), "on_unavailable must be one of"),
        (lambda: singleton(ttl=10, raise_on_duplicate="yes"), "raise_on_duplicate must be True or False"),
        (lambda: singleton(ttl=10, dedup_publish=0), "ttl is 0"),
        (lambda: once_per_fire(period=0), "period is 0"),
        (lambda: once_per_fire(period="1m"), "period must be a number of seconds"),
        (lambda: once_per_fire(period=60, ttl=0), "ttl is 0"),
        (lambda: once_per_fire(period=60, ttl=0.002), "ttl of 0.002 s is too short"),
        (lambda: once_per_fire(period=60, dedup_publish=30), "dedup_publish must be True or False"),
    ],
)
def test_decorator_options_are_checked_when_decorating(make, message):
    with pytest.raises(distlock.InvalidInput, match=message) as caught:
        make()
    assert_python_words(str(caught.value))


def test_key_args_are_checked_when_decorating():
    with pytest.raises(distlock.InvalidInput, match=r"key_args \['custmer'\] are not arguments of"):
        @singleton(ttl=10, key_args=["custmer"])
        def send(customer):
            pass


def test_base_class_options_are_checked_when_the_task_is_made():
    app = make_app(f"memory://{uuid.uuid4().hex}")
    with pytest.raises(distlock.InvalidInput, match="ttl is 0"):
        @app.task(base=SingletonTask, singleton_ttl=0, shared=False, lazy=False)
        def zero():
            pass
    with pytest.raises(distlock.InvalidInput, match="on_unavailable must be one of"):
        @app.task(base=OncePerFireTask, once_per_fire_period=60, once_per_fire_on_unavailable="x",
                  shared=False, lazy=False)
        def bad_policy():
            pass


class Skips:
    """Records the task_skipped signal."""

    def __init__(self):
        self.seen = []
        task_skipped.connect(self.record, weak=False)

    def record(self, sender=None, **info):
        self.seen.append((sender, info["reason"], info["key"]))

    def close(self):
        task_skipped.disconnect(self.record)


@pytest.fixture
def skips():
    recorder = Skips()
    yield recorder
    recorder.close()


def test_raise_on_duplicate_and_the_skip_signal(skips):
    app = make_app(f"memory://{uuid.uuid4().hex}")

    @app.task
    @singleton(ttl=10, raise_on_duplicate=True)
    def strict(x):
        return x

    @app.task
    @once_per_fire(period=60)
    def fired():
        return "ran"

    key = distlock.job_key(strict.name, kwargs={"x": 1})
    with distlock.connect(app.conf.distlock_url).lock(key, ttl=10):
        result = strict.apply((1,))
    assert result.state == "FAILURE"
    assert isinstance(result.result, DuplicateRun) and isinstance(result.result, distlock.LockHeld)
    assert "another run holds the lock" in str(result.result)
    assert skips.seen == [(strict, "running", key)]

    fire = {FIRE_TIME_HEADER: 1796040000.0}
    assert fired.apply(headers=fire).get() == "ran"
    assert fired.apply(headers=fire).get() is None
    assert skips.seen[-1] == (fired, "fire_already_taken", fired.name)


UNREACHABLE = "redis://127.0.0.1:1?connect_timeout_ms=200&operation_timeout_ms=200"


def test_on_unavailable_policies(skips, caplog):
    app = make_app(UNREACHABLE)
    runs = []

    def make(policy):
        @app.task(name=f"policy_{policy}", max_retries=2, default_retry_delay=0, shared=False)
        @singleton(ttl=10, on_unavailable=policy)
        def job():
            runs.append((policy, distlock.current_lock()))
            return policy

        return job

    raising, skipping, running, retrying = (make(p) for p in ("raise", "skip", "run", "retry"))
    assert isinstance(raising.apply().result, distlock.Unavailable)
    assert skipping.apply().get() is None
    assert skips.seen == [(skipping, "unavailable", skipping.name)]
    assert running.apply().get() == "run"
    assert runs == [("run", None)]  # ran, without a lock
    caplog.set_level(logging.WARNING, logger="distlock.celery")
    retried = retrying.apply()
    # Celery retried it (twice, its max_retries), then gave up with the error.
    assert isinstance(retried.result, distlock.Unavailable)
    attempts = [r for r in caplog.records if "will be retried by Celery" in r.getMessage()]
    assert len(attempts) == 3, caplog.text
    assert runs == [("run", None)]


def test_once_per_fire_running_lock_ttl_is_settable_and_renewed():
    app = make_app(f"memory://{uuid.uuid4().hex}")
    seen = {}

    @app.task
    @once_per_fire(period=60, ttl=1)
    def long_run():
        lock = distlock.current_lock()
        first = inspect_lock(long_run)
        # Outlive the TTL twice: renewal keeps the lock.
        assert not lock.wait_lost(timeout=2.5)
        seen.update(first=first, later=inspect_lock(long_run), token=lock.fencing_token)
        return "done"

    assert long_run.apply(headers={FIRE_TIME_HEADER: 1796040000.0}).get() == "done"
    # The server held the running lock with the TTL given (not 30 s), and
    # still held it, renewed, after twice that.
    assert seen["first"].fencing_token == seen["token"] and seen["first"].expires_in <= 1.0
    assert seen["later"].fencing_token == seen["token"] and 0 < seen["later"].expires_in <= 1.0
    assert inspect_lock(long_run) is None


def test_inspect_and_force_release_a_task_lock():
    app = make_app(f"memory://{uuid.uuid4().hex}")

    @app.task
    @singleton(ttl=10)
    def stuck(customer):
        return customer

    key = distlock.job_key(stuck.name, kwargs={"customer": 7})
    holder = distlock.connect(app.conf.distlock_url).lock(key, ttl=10)
    assert inspect_lock(stuck, 7).fencing_token == holder.fencing_token
    assert inspect_lock(stuck, customer=8) is None
    assert stuck.apply((7,)).get() is None  # skipped: held
    assert force_release(stuck, 7) is True
    assert inspect_lock(stuck, 7) is None
    assert stuck.apply((7,)).get() == 7
    assert force_release(stuck, 7) is False
    with pytest.raises(distlock.InvalidInput, match="not decorated"):
        inspect_lock(app.task(make_app, name="plain_task", shared=False))


def test_dedup_at_publish(skips):
    url = f"memory://{uuid.uuid4().hex}"
    app = Celery(f"test_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.distlock_url = url
    queue = "q_" + uuid.uuid4().hex[:8]
    app.conf.task_default_queue = queue

    @app.task
    @singleton(ttl=10, dedup_publish=60, key_args=["customer"])
    def invoice(customer, attempt=0):
        return customer

    @app.task
    @singleton(ttl=10, dedup_publish=True, raise_on_duplicate=True)
    def strict(customer):
        return customer

    @app.task
    @once_per_fire(period=60, dedup_publish=True)
    def report():
        return "report"

    def queued():
        with app.connection_for_write() as connection:
            messages = []
            simple = connection.SimpleQueue(queue)
            while True:
                try:
                    message = simple.get(block=False)
                except simple.Empty:
                    break
                message.ack()
                messages.append(message)
            simple.close()
            return messages

    assert invoice.apply_async((7,)) is not None
    assert invoice.apply_async((7,), {"attempt": 1}) is None  # same customer: not queued
    assert skips.seen[-1][1] == "queued"
    assert invoice.apply_async((8,)) is not None  # another customer
    with pytest.raises(DuplicateRun, match="already queued"):
        strict.apply_async((1,)) and strict.apply_async((1,))
    beat = {"celery_beat_task": True, FIRE_TIME_HEADER: 1796040000.5}
    assert report.apply_async(headers=dict(beat)) is not None
    assert report.apply_async(headers={**beat, FIRE_TIME_HEADER: 1796040030.0}) is None  # same fire, other Beat
    assert report.apply_async(headers={**beat, FIRE_TIME_HEADER: 1796040060.0}) is not None  # next fire
    messages = queued()
    tasks = [message.headers["task"] for message in messages]
    assert tasks.count(invoice.name) == 2 and tasks.count(strict.name) == 1 and tasks.count(report.name) == 2
    # A worker runs the queued invoice for customer 7: the run ends by
    # clearing its marker, so the next publish is queued again.
    first = next(m for m in messages if m.headers["task"] == invoice.name and m.headers["argsrepr"] == "(7,)")
    assert invoice.apply((7,), headers={QUEUED_HEADER: first.headers[QUEUED_HEADER]}).get() == 7
    assert invoice.apply_async((7,)) is not None
    # While a message is queued, its duplicate still is not.
    assert invoice.apply_async((7,)) is None
    queued()


def test_library_events_reach_python_logging(caplog):
    caplog.set_level(logging.DEBUG, logger="distlock")
    distlock._distlock._refresh_logging()
    server = servers.start_redis()
    try:
        locker = distlock.connect(f"{server.url}?operation_timeout_ms=300&connect_timeout_ms=300")
        guard = locker.lock("logged", ttl=1.5)
        with pytest.raises(distlock.LockHeld):
            distlock.connect(server.url).lock("logged", ttl=1.5)
        server.stop()  # renewals now fail, then the lease runs out
        assert guard.wait_lost(timeout=30)
    finally:
        server.stop()

    def logged(text, level):
        return [r for r in caplog.records if text in r.getMessage() and r.levelno == level]

    deadline = time.monotonic() + 30
    while not logged("lock lost", logging.WARNING) and time.monotonic() < deadline:
        time.sleep(0.05)  # records arrive from the extension's logging thread
    assert logged("lock acquired key=logged", logging.INFO), caplog.text
    assert logged("not acquired", logging.INFO), caplog.text
    assert logged("lock renewal failed", logging.WARNING), caplog.text
    lost = logged("lock lost", logging.WARNING)
    assert lost and lost[0].name == "distlock.core" and "key=logged" in lost[0].getMessage(), caplog.text


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

        def delivered_so_far():
            return sum(record.llen(f"delivered:beat_app.{name}") for name in ("guarded", "plain", "deduped"))

        def drained():
            before = delivered_so_far()
            time.sleep(1.0)
            return broker.llen("celery") == 0 and before == delivered_so_far()

        processes.wait_for(drained, "the queue to drain", 60)
    finally:
        names = list(processes.running)
        processes.stop()

    delivered = slot_counts(record.lrange("delivered:beat_app.guarded", 0, -1))
    guarded = slot_counts(record.lrange("ran:beat_app.guarded", 0, -1))
    plain = slot_counts(record.lrange("ran:beat_app.plain", 0, -1))
    deduped_delivered = slot_counts(record.lrange("delivered:beat_app.deduped", 0, -1))
    deduped = slot_counts(record.lrange("ran:beat_app.deduped", 0, -1))
    fires = sorted(delivered)[1 : FIRES + 1]
    why_skipped = collections.defaultdict(set)
    skips = collections.Counter()
    for value in record.lrange("skipped:beat_app.guarded", 0, -1):
        stamp, reason = value.decode().split()
        why_skipped[math.floor(float(stamp))].add(reason)
        skips[reason] += 1
    summary = (
        f"over {len(fires)} fires: Beat messages per fire {[delivered[f] for f in fires]}; "
        f"runs per fire with once_per_fire {[guarded[f] for f in fires]} (total {sum(guarded[f] for f in fires)}); "
        f"without it {[plain[f] for f in fires]} (total {sum(plain[f] for f in fires)}); "
        f"with dedup_publish, messages per fire {[deduped_delivered[f] for f in fires]}, "
        f"runs {[deduped[f] for f in fires]}; guarded messages skipped: {dict(skips)}"
    )
    unrun = sorted(set(delivered) - set(guarded))
    if unrun:
        # What the workers said about the guarded task: why a fire did not run.
        said = [
            f"{name}: {line}"
            for name in names
            for line in processes.log(name).splitlines()
            if "guarded" in line or "Traceback" in line or "rror" in line
        ]
        summary += (
            f"; delivered but never run: {unrun}, skipped for {[sorted(why_skipped[f]) for f in unrun]}; "
            "the workers said:\n" + "\n".join(said[-60:])
        )
    print(summary)
    with open(os.environ.get("DISTLOCK_BEAT_SUMMARY", os.devnull), "a") as out:
        out.write(summary + "\n")
    assert len(fires) == FIRES
    # Both Beats fired nearly every fire...
    assert sum(delivered[f] for f in fires) >= FIRES * 2 - 3, summary
    # Every guarded message either ran or was skipped, saying why.
    assert sum(delivered.values()) == sum(guarded.values()) + sum(skips.values()), summary
    # ...the guarded task never ran twice for a fire...
    assert max(guarded.values()) == 1, summary
    # ...and ran for every fire but one whose message reached a worker while
    # another fire's run went on (two Beats out of phase stamp one tick in
    # two slots, whose messages may start in either order; a cold worker
    # process makes that likelier for the first fire)...
    unexplained = [f for f in unrun if "previous_still_running" not in why_skipped[f]]
    assert not unexplained, summary
    assert sum(guarded[f] == 1 for f in fires) >= FIRES - 2, summary
    # ...and the plain one ran once per Beat: twice for most fires.
    assert sum(plain[f] > 1 for f in fires) >= FIRES * 3 // 4, summary
    # With dedup_publish the second Beat's message is never queued: one
    # message per fire reaches a worker (none ever twice), and it runs.
    assert max(deduped_delivered.values()) == 1, summary
    assert sum(deduped_delivered[f] for f in fires) >= FIRES - 2, summary
    assert max(deduped.values()) == 1 and set(deduped) == set(deduped_delivered), summary


def _dead(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1].startswith("Z")
    except FileNotFoundError:
        return True


def test_two_beats_with_a_worker_killed_mid_run(redis_server, tmp_path):
    """A worker killed with SIGKILL mid-run: the next run starts only once
    the killed run's lock has expired on the server."""
    base = redis_server.url
    record = redis.Redis.from_url(f"{base}/4")
    broker = redis.Redis.from_url(f"{base}/3")
    lock_server = redis.Redis.from_url(base)
    record.flushdb()
    broker.flushdb()
    namespace = f"kill_{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONPATH": TESTS,
        "BEAT_TEST_SCENARIO": "kill",
        "BEAT_TEST_BROKER": f"{base}/3",
        "BEAT_TEST_RECORD": f"{base}/4",
        "BEAT_TEST_LOCK_URL": f"{base}?namespace={namespace}",
    }
    running_key = f"{namespace}:{{beat_app.slow@running}}:lock"
    processes = Processes(str(tmp_path), env)

    def starts():
        return [line.decode().split() for line in record.lrange("started:beat_app.slow", 0, -1)]

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
        processes.wait_for(lambda: len(starts()) >= 1, "the first run", 90)
        first_start, pid, first_token = starts()[0]
        os.kill(int(pid), signal.SIGKILL)
        processes.wait_for(lambda: _dead(int(pid)), "the killed worker process to die", 30)

        def expiry():
            # The server's clock and the lock's time left, read at one instant.
            pipe = lock_server.pipeline(transaction=True)
            pipe.time()
            pipe.pttl(running_key)
            (seconds, micros), left = pipe.execute()
            assert left > 0, f"the killed run's lock is not held on the server ({left})"
            return seconds + micros / 1e6 + left / 1000

        # Nobody renews it any more: its expiry stays put.
        expires_at = expiry()
        time.sleep(0.2)
        assert abs(expiry() - expires_at) < 0.05
        processes.wait_for(lambda: len(starts()) >= 2, "the run after the killed one", 90)
        record.set("stop:beat_app.slow", 1)
        logs = "\n".join(processes.log(w) for w in ("worker1", "worker2"))
    finally:
        processes.stop()

    (_, _, _), (second_start, _, second_token) = starts()[:2]
    summary = (
        f"killed run started {float(first_start):.3f} (token {first_token}), its lock expired at "
        f"{expires_at:.3f} by the server's clock; the next run started {float(second_start):.3f} (token {second_token})"
    )
    print(summary)
    assert float(second_start) >= expires_at, summary
    assert int(second_token) > int(first_token), summary
    # The library's own log events reach the worker's log.
    assert "lock acquired key=beat_app.slow@running" in logs, logs[-3000:]
    assert "previous run still going; skipping this fire" in logs, logs[-3000:]
