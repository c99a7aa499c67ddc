"""The Python API against every backend, each on a real server."""

import asyncio
import datetime
import os
import threading
import time

import pytest

import distlock


def test_lock_excludes_and_releases_on_exit(backend):
    locker = distlock.connect(backend.url)
    other = distlock.connect(backend.url)
    with locker.lock("report", ttl=10) as guard:
        assert guard.key == "report"
        assert not guard.is_lost()
        guard.raise_if_lost()
        with pytest.raises(distlock.LockHeld, match="held by another owner"):
            other.lock("report", ttl=10)
    with other.lock("report", ttl=10) as second:
        assert second.fencing_token > guard.fencing_token
    assert "released" in repr(second)


def test_wait_gets_the_lock_once_released_and_frees_the_gil(backend):
    locker = distlock.connect(backend.url)
    first = locker.lock("handoff", ttl=10)
    ticks = []
    waiting = threading.Event()

    def other_thread():
        waiting.wait()
        # Runs Python while the main thread waits in Rust: the GIL is free.
        for _ in range(5):
            ticks.append(time.monotonic())
            time.sleep(0.02)
        first.release()

    thread = threading.Thread(target=other_thread)
    thread.start()
    waiting.set()
    with distlock.connect(backend.url).lock("handoff", ttl=10, wait=30) as second:
        assert len(ticks) == 5
        assert second.fencing_token > first.fencing_token
    thread.join()


def test_wait_times_out_with_lock_held(backend):
    locker = distlock.connect(backend.url)
    with locker.lock("busy", ttl=10):
        with pytest.raises(distlock.LockHeld, match="after waiting"):
            locker.lock("busy", ttl=10, wait=datetime.timedelta(milliseconds=300))


def test_release_twice_is_a_no_op_and_guard_reports_state(backend):
    locker = distlock.connect(backend.url)
    guard = locker.lock("twice", ttl=10)
    assert "held" in repr(guard)
    guard.release()
    guard.release()
    assert not guard.is_lost()
    assert guard.lost_reason is None
    locker.lock("twice", ttl=10).release()


def test_is_lost_when_the_key_is_deleted_behind_the_guard(server_backend):
    locker = distlock.connect(server_backend.url)
    guard = locker.lock("doomed", ttl=1.5)
    server_backend.delete_lock("doomed")
    assert guard.wait_lost(timeout=30)
    assert guard.is_lost()
    assert "refused" in guard.lost_reason
    with pytest.raises(distlock.LockLost, match="lost"):
        guard.raise_if_lost()
    with pytest.raises(distlock.LockLost):
        guard.release()
    # Someone else can take it now.
    distlock.connect(server_backend.url).lock("doomed", ttl=5).release()


def test_exit_raises_lock_lost_unless_the_block_raised(server_backend):
    locker = distlock.connect(server_backend.url)
    with pytest.raises(distlock.LockLost):
        with locker.lock("exit-lost", ttl=1.5) as guard:
            server_backend.delete_lock("exit-lost")
            assert guard.wait_lost(timeout=30)
    with pytest.raises(KeyError):
        with locker.lock("exit-lost", ttl=1.5) as guard:
            server_backend.delete_lock("exit-lost")
            assert guard.wait_lost(timeout=30)
            raise KeyError("the block's own error wins")


def test_guard_renews_past_its_ttl(backend):
    locker = distlock.connect(backend.url)
    with locker.lock("renewed", ttl=1) as guard:
        # Two TTLs later the lock is still ours: renewal works.
        assert not guard.wait_lost(timeout=2.5)
        with pytest.raises(distlock.LockHeld):
            locker.lock("renewed", ttl=1)


def test_async_lock(backend):
    async def scenario():
        locker = distlock.connect(backend.url)
        async with locker.lock_async("async", ttl=10) as guard:
            assert not guard.is_lost()
            with pytest.raises(distlock.LockHeld):
                await locker.lock_async("async", ttl=10)
            # A waiter cancelled mid-wait leaves nothing held.
            waiter = asyncio.ensure_future(locker.lock_async("async", ttl=10, wait=60))
            await asyncio.sleep(0.2)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        # The cancelled waiter may have been granted the lock as it was
        # released; it gives it back in the background, so wait a little
        # (a lock it kept would stay held for its 10 s TTL).
        second = await locker.lock_async("async", ttl=10, wait=5)
        assert second.fencing_token > guard.fencing_token
        async with second:
            pass
        third = await locker.lock_async("async", ttl=10, wait=5)
        await third.__aexit__(None, None, None)

    asyncio.run(scenario())


def test_async_waiters_hand_off(backend):
    async def scenario():
        locker = distlock.connect(backend.url)
        holder = await locker.lock_async("queue", ttl=10)
        order = []

        async def worker(n):
            async with locker.lock_async("queue", ttl=10, wait=60) as guard:
                order.append((n, guard.fencing_token))
                await asyncio.sleep(0.01)

        workers = [asyncio.ensure_future(worker(n)) for n in range(3)]
        await asyncio.sleep(0.2)
        assert order == []
        await holder.__aexit__(None, None, None)
        await asyncio.gather(*workers)
        tokens = [token for _, token in order]
        assert len(order) == 3 and tokens == sorted(tokens)

    asyncio.run(scenario())


def test_permits_let_n_holders_in_apart_from_the_lock(backend):
    a, b, c = (distlock.connect(backend.url) for _ in range(3))
    with a.lock("pool", ttl=10, permits=2) as first, b.lock("pool", ttl=10, permits=2) as second:
        assert second.fencing_token > first.fencing_token
        with pytest.raises(distlock.LockHeld, match="all 2 permits"):
            c.lock("pool", ttl=10, permits=2)
        # Another number of permits while these are held is refused.
        with pytest.raises(distlock.InvalidInput):
            c.lock("pool", ttl=10, permits=3)
        # The lock of the same name is its own.
        with c.lock("pool", ttl=10):
            pass
    with c.lock("pool", ttl=10, permits=2) as third:
        assert third.fencing_token > second.fencing_token


def test_run_once_per_fire(backend):
    a = distlock.connect(backend.url)
    b = distlock.connect(backend.url)
    fire = datetime.datetime(2026, 11, 30, 12, 0, 0, tzinfo=datetime.timezone.utc)
    calls = []

    def job(x, y=0):
        lock = distlock.current_lock()
        calls.append((x, y, lock.fencing_token))
        lock.raise_if_lost()
        return x + y

    first = a.run_once_per_fire("report", 60, fire, job, 1, y=2)
    assert first.ran and first.value == 3 and first.skipped is None and first.lost is None
    assert first.fencing_token == calls[0][2]
    # Another instance, a little late for the same fire (same minute).
    late = b.run_once_per_fire("report", 60, fire + datetime.timedelta(seconds=20), job, 1, y=2)
    assert not late.ran and late.skipped == "fire_already_taken" and late.value is None
    # The next fire runs.
    nxt = b.run_once_per_fire("report", 60, fire.timestamp() + 60, job, 5)
    assert nxt.ran and nxt.value == 5
    assert len(calls) == 2
    assert distlock.current_lock() is None


def test_run_once_per_fire_propagates_the_job_error_and_keeps_the_fire(backend):
    locker = distlock.connect(backend.url)

    def failing():
        raise ValueError("boom")

    fire = time.time()
    with pytest.raises(ValueError, match="boom"):
        locker.run_once_per_fire("failing", 60, fire, failing)
    again = locker.run_once_per_fire("failing", 60, fire, failing)
    assert again.skipped == "fire_already_taken"


def test_run_once_per_fire_skips_while_the_previous_run_goes_on(backend):
    locker = distlock.connect(backend.url)
    inner = []

    def slow():
        # The next fire arrives while this run still holds the job.
        inner.append(locker.run_once_per_fire("slow", 1, time.time() + 5, lambda: None))

    assert locker.run_once_per_fire("slow", 1, time.time(), slow).ran
    assert inner[0].skipped == "previous_still_running"


def test_job_lock_cannot_be_released_by_the_job():
    locker = distlock.connect("memory://job-lock")

    def job():
        with pytest.raises(distlock.InvalidInput, match="job runner releases it"):
            distlock.current_lock().release()

    assert locker.run_once_per_fire("job-lock", 60, None, job).ran


def test_fork_child_reconnects_and_leaves_parent_lock_alone(redis_server):
    url = f"{redis_server.url}?namespace=fork"
    locker = distlock.connect(url)
    parent_guard = locker.lock("parent", ttl=10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: use the inherited Locker, drop the parent's guard
        status = 1
        try:
            with locker.lock("child", ttl=10) as guard:
                held = False
                try:
                    locker.lock("parent", ttl=10)
                except distlock.LockHeld:
                    held = True
                os.write(write, f"{guard.fencing_token} {held}".encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    report = os.read(read, 100).decode()
    _, status = os.waitpid(pid, 0)
    assert status == 0, report
    token, parent_held = report.split()
    assert int(token) > 0 and parent_held == "True"
    assert not parent_guard.is_lost()
    parent_guard.release()


def test_job_key_matches_the_rust_pins():
    # The same inputs and expected keys as distlock-core's job_key tests.
    assert (
        distlock.job_key("report", kwargs={"b": [1, {"y": 2, "x": 1}], "a": "é"})
        == "report:7d3c8b032ac468d2d8d4df08d101faa3"
    )
    assert (
        distlock.job_key("tasks.send_invoice", [7], {"month": "2026-11", "retry_id": "x1"}, only=[0, "month"])
        == "tasks.send_invoice:eec490f9a2834d2eaf90d81bfb820aef"
    )
    assert distlock.job_key("report") == "report"
    # Unselected arguments need no JSON form.
    assert distlock.job_key("j", kwargs={"a": 1, "conn": object()}, only=["a"]) == distlock.job_key(
        "j", kwargs={"a": 1}
    )


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda l: l.lock("", 5), distlock.InvalidInput, "empty"),
        (lambda l: l.lock("a\0b", 5), distlock.InvalidInput, "NUL"),
        (lambda l: l.lock("x" * 513, 5), distlock.InvalidInput, "513 bytes"),
        (lambda l: l.lock("k", 0), distlock.InvalidInput, "ttl is 0"),
        (lambda l: l.lock("k", -1), distlock.InvalidInput, "negative"),
        (lambda l: l.lock("k", float("nan")), distlock.InvalidInput, "finite"),
        (lambda l: l.lock("k", "10"), distlock.InvalidInput, "not str"),
        (lambda l: l.lock("k", True), distlock.InvalidInput, "not bool"),
        (lambda l: l.lock("k", 5, wait=-1), distlock.InvalidInput, "wait is negative"),
        (lambda l: l.lock_async("k", -5), distlock.InvalidInput, "negative"),
        (lambda l: l.run_once_per_fire("j", 0, None, print), distlock.InvalidInput, "period is 0"),
        (lambda l: l.run_once_per_fire("j", 1, -5, print), distlock.InvalidInput, "before 1970"),
        (lambda l: l.run_once_per_fire("j", 1, None, 42), distlock.InvalidInput, "not callable"),
        (lambda l: distlock.job_key("j", kwargs={"a": object()}), distlock.InvalidInput, "no JSON form"),
        (lambda l: distlock.job_key("j", kwargs={"a": float("inf")}), distlock.InvalidInput, "finite"),
        (lambda l: distlock.job_key("j", kwargs={"a": 2**70}), distlock.InvalidInput, "64-bit"),
        (lambda l: distlock.job_key("j", kwargs={"a": {1: 2}}), distlock.InvalidInput, "string keys"),
        (lambda l: distlock.job_key("j", args="abc"), distlock.InvalidInput, "list or tuple"),
        (lambda l: distlock.job_key("n" * 500, args=[1]), distlock.InvalidInput, "job name"),
        (lambda l: distlock.job_key("j", kwargs={"a": 1}, only=["nope"]), distlock.InvalidInput,
         r"only names 'nope', which is not among the arguments given \(a\)"),
        (lambda l: distlock.job_key("j", [1], only=[3]), distlock.InvalidInput, "only names '3'"),
        (lambda l: distlock.job_key("j", only=["a"]), distlock.InvalidInput, "no arguments were given"),
        (lambda l: distlock.job_key(5), distlock.InvalidInput, "name must be a str"),
        (lambda l: distlock.connect(6379), distlock.InvalidInput, "url must be a str"),
        (lambda l: l.lock(7, 5), distlock.InvalidInput, "key must be a str"),
        (lambda l: l.lock("x" * 513, 5), distlock.InvalidInput, r"distlock.job_key\(name, args\)"),
        (lambda l: l.lock("k", 0.001), distlock.InvalidInput, "ttl of 0.001 s is too short"),
        (lambda l: l.lock("k", 10, max_hold=0.001), distlock.InvalidInput, "max_hold of 0.001 s is too short"),
        (lambda l: l.lock("k", 10, max_hold=0), distlock.InvalidInput, "max_hold is 0"),
        (lambda l: l.lock("k", 10, permits=0), distlock.InvalidInput, "permits of 0 can never"),
        (lambda l: l.lock("k", 10, permits="3"), distlock.InvalidInput, "permits must be an int"),
        (lambda l: l.lock("k", 10, permits=True), distlock.InvalidInput, "permits must be an int"),
        (lambda l: l.lock("k", 10, permits=2**32), distlock.InvalidInput, "above the limit"),
        (lambda l: l.inspect(None), distlock.InvalidInput, "key must be a str"),
        (lambda l: l.force_release(""), distlock.InvalidInput, "key is empty"),
        (lambda l: l.run_once_per_fire(1, 60, None, print), distlock.InvalidInput, "job_name must be a str"),
        (lambda l: l.run_once_per_fire("j" * 490, 60, None, print), distlock.InvalidInput, "limit is 486"),
        (lambda l: l.run_once_per_fire_with("j", 60, None, 0.001, print, ()), distlock.InvalidInput,
         "ttl of 0.001 s is too short"),
    ],
)
def test_bad_input_raises_typed_errors(call, error, message):
    locker = distlock.connect("memory://bad-input")
    with pytest.raises(error, match=message) as caught:
        call(locker)
    assert isinstance(caught.value, distlock.LockError)
    assert str(caught.value).startswith("invalid input: ")
    # Worded for Python: no Rust type, path or duration syntax.
    for rust in ("stop margin", "JobKey", "distlock_core", "Duration", "::", "PyString", "µs"):
        assert rust not in str(caught.value), str(caught.value)


def test_the_shortest_ttl_the_message_names_is_accepted():
    # Checked without a server: whether a 10 ms lease arrives in time
    # depends on the machine's load.
    distlock._distlock._check_lock_options(0.01)
    distlock._distlock._check_lock_options(10, max_hold=0.01)


def test_inspect_and_force_release(backend):
    locker = distlock.connect(backend.url)
    assert locker.inspect("stuck") is None
    guard = locker.lock("stuck", ttl=1.5)
    info = locker.inspect("stuck")
    assert info.fencing_token == guard.fencing_token
    assert info.expires_in is None or 0 < info.expires_in <= 1.5
    assert "LockInfo(fencing_token=" in repr(info)
    assert locker.force_release("stuck") is True
    assert locker.inspect("stuck") is None
    # The holder learns it at its next renewal.
    assert guard.wait_lost(timeout=30)
    assert locker.force_release("stuck") is False
    with distlock.connect(backend.url).lock("stuck", ttl=5) as again:
        assert again.fencing_token > guard.fencing_token


@pytest.mark.parametrize(
    "url, error, message",
    [
        ("zookeeper://127.0.0.1:2181", distlock.ConfigError, "unknown lock URL scheme"),
        ("not a url", distlock.ConfigError, "not a lock URL"),
        ("etcds://127.0.0.1:1?connect_timeout_ms=300", (distlock.Unavailable, distlock.Timeout), "etcd"),
        ("memory://?namespace=a/b", None, None),
        ("redis://127.0.0.1:1?connect_timeout_ms=300", distlock.Unavailable, "redis"),
        ("postgres://postgres@127.0.0.1:1/postgres?connect_timeout_ms=300", (distlock.Unavailable, distlock.Timeout), "PostgreSQL"),
        ("redis://127.0.0.1:6379?namespace=bad/ns", distlock.ConfigError, "namespace"),
    ],
)
def test_bad_urls_raise_typed_errors(url, error, message):
    if error is None:
        distlock.connect(url)  # memory names are free-form
        return
    with pytest.raises(error, match=message):
        distlock.connect(url)


def test_unreachable_etcd_is_unavailable_in_bounded_time():
    with pytest.raises((distlock.Unavailable, distlock.Timeout)):
        distlock.connect("etcd://127.0.0.1:1?connect_timeout_ms=300&operation_timeout_ms=300")


def test_exceptions_form_one_hierarchy():
    for kind in [
        distlock.InvalidInput, distlock.NotHeld, distlock.LockLost, distlock.LockHeld,
        distlock.Unavailable, distlock.Timeout, distlock.Corrupted, distlock.ConfigError,
        distlock.Unsupported,
    ]:
        assert issubclass(kind, distlock.LockError)
        assert kind.__module__ == "distlock"
    assert issubclass(distlock.LockLost, distlock.NotHeld)


def test_hold_at_least_keeps_the_lock_after_release(backend):
    locker = distlock.connect(backend.url)
    locker.lock("at-least", ttl=5, hold_at_least=30).release()
    with pytest.raises(distlock.LockHeld):
        locker.lock("at-least", ttl=5)


def test_max_hold_stops_renewal(backend):
    locker = distlock.connect(backend.url)
    guard = locker.lock("at-most", ttl=1, max_hold=0.5)
    assert guard.wait_lost(timeout=30)
    # max_hold ends renewal, so the lease runs out (lost inside the stop margin).
    assert "run out" in guard.lost_reason


def test_inspect_permits_shows_each_permit_and_its_label(backend):
    a, b, operator = (distlock.connect(backend.url) for _ in range(3))
    assert operator.inspect_permits("labelled-pool") == []
    with a.lock("labelled-pool", ttl=10, permits=3, holder="worker-a:1") as first, b.lock(
        "labelled-pool", ttl=10, permits=3
    ) as second:
        permits = operator.inspect_permits("labelled-pool")
        assert sorted(p.fencing_token for p in permits) == sorted(
            [first.fencing_token, second.fencing_token]
        )
        by_token = {p.fencing_token: p for p in permits}
        # Every backend stores permit labels; a label is only ever shown
        # for the permit whose holder gave it.
        assert by_token[first.fencing_token].holder == "worker-a:1"
        assert by_token[second.fencing_token].holder is None
        for permit in permits:
            assert permit.limit == 3
            assert permit.expires_in is None or 0 < permit.expires_in <= 10
        assert "PermitInfo(fencing_token=" in repr(permits[0])
        # The lock of the same key is another thing: still free.
        assert operator.inspect("labelled-pool") is None
    assert operator.inspect_permits("labelled-pool") == []
