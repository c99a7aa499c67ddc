"""Holder labels and leader election through the Python API, on every
backend's real server."""

import asyncio
import threading

import pytest

import distlock


# The backends known to store holder labels; the others may show none.
LABELLED = {"memory", "redis", "etcd", "postgres"}


def assert_label(backend, got, label):
    """`got` is the label given where the backend stores labels (a backend
    without holder labels shows none)."""
    if backend.name in LABELLED:
        assert got == label
    else:
        assert got in (label, None)


def test_holder_label_round_trips_through_inspect(backend):
    locker = distlock.connect(backend.url)
    with locker.lock("labelled", ttl=10, holder="worker-3:4242 ünïcode") as guard:
        info = locker.inspect("labelled")
        assert info.fencing_token == guard.fencing_token
        assert_label(backend, info.holder, "worker-3:4242 ünïcode")
        if info.holder is not None:
            assert 'holder="worker-3:4242 ünïcode"' in repr(info)
    # A lock taken without a label shows none, also after a labelled one.
    with locker.lock("labelled", ttl=10):
        assert locker.inspect("labelled").holder is None

    async def scenario():
        async with locker.lock_async("labelled", ttl=10, holder="async-worker"):
            assert_label(backend, locker.inspect("labelled").holder, "async-worker")

    asyncio.run(scenario())


def test_a_label_is_not_ownership(backend):
    a, b = distlock.connect(backend.url), distlock.connect(backend.url)
    with a.lock("same-label", ttl=10, holder="twin"):
        with pytest.raises(distlock.LockHeld):
            b.lock("same-label", ttl=10, holder="twin")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda l: l.lock("k", 5, holder=""), "holder is empty"),
        (lambda l: l.lock("k", 5, holder="two\nlines"), r"holder contains the control character '\\n'"),
        (lambda l: l.lock("k", 5, holder="x" * 129), "holder is 129 bytes in UTF-8, the limit is 128"),
        (lambda l: l.lock("k", 5, holder=42), "holder must be a str"),
        (lambda l: l.lock_async("k", 5, holder="\x00"), "control character"),
        (lambda l: l.campaign("k", "", 5), "identity is empty"),
        (lambda l: l.campaign("k", "tab\there", 5), "identity contains the control character"),
        (lambda l: l.campaign("k", "é" * 65, 5), "identity is 130 bytes"),
        (lambda l: l.campaign("k", b"bytes", 5), "identity must be a str"),
        (lambda l: l.campaign_async("k", "", 5), "identity is empty"),
        (lambda l: l.campaign("", "a", 5), "key is empty"),
        (lambda l: l.campaign("k", "a", 0), "ttl is 0"),
        (lambda l: l.campaign("k", "a", 5, timeout=-1), "timeout is negative"),
        (lambda l: l.leader(""), "key is empty"),
        (lambda l: l.leader_async(None), "key must be a str"),
        (lambda l: l.observe("k", poll_interval="1"), "poll_interval must be"),
    ],
)
def test_bad_labels_and_election_arguments_raise_invalid_input(call, message):
    locker = distlock.connect("memory://bad-election")
    with pytest.raises(distlock.InvalidInput, match=message) as caught:
        call(locker)
    assert str(caught.value).startswith("invalid input: ")
    for rust in ("HolderId", "set none", "distlock_core", "::", "Duration"):
        assert rust not in str(caught.value), str(caught.value)


def test_leader_names_the_identity_and_term(backend):
    locker = distlock.connect(backend.url)
    assert locker.leader("board") is None
    with locker.campaign("board", "instance-a", ttl=10) as leadership:
        assert leadership.key == "board"
        assert leadership.identity == "instance-a"
        assert not leadership.is_lost() and leadership.lost_reason is None
        leadership.raise_if_lost()
        leader = distlock.connect(backend.url).leader("board")
        assert leader.term == leadership.term
        assert_label(backend, leader.identity, "instance-a")
        assert "Leader(identity=" in repr(leader) and "held" in repr(leadership)
        # The leadership is the lock `key`, labelled.
        info = locker.inspect("board")
        assert info.fencing_token == leadership.term
        assert_label(backend, info.holder, "instance-a")
    # Leaving the block resigned.
    assert "resigned" in repr(leadership)
    assert locker.leader("board") is None
    leadership.resign()  # twice does nothing


def test_default_identity_is_host_and_pid(backend):
    import os

    with distlock.connect(backend.url).campaign("anon", None, ttl=10) as leadership:
        assert leadership.identity.endswith(f":{os.getpid()}")


def test_resign_hands_over_to_a_waiting_candidate(backend):
    a, b = distlock.connect(backend.url), distlock.connect(backend.url)
    first = a.campaign("handover", "a", ttl=10)
    second = []

    def candidate():
        second.append(b.campaign("handover", "b", ttl=10))

    thread = threading.Thread(target=candidate)
    thread.start()
    # Whatever b does meanwhile, a leads until it resigns.
    assert a.leader("handover").term == first.term
    first.resign()
    thread.join()
    (leadership,) = second
    assert leadership.term > first.term
    leader = a.leader("handover")
    assert leader.term == leadership.term
    assert_label(backend, leader.identity, "b")
    leadership.resign()
    assert a.leader("handover") is None


def test_campaign_timeout_raises_lock_held(backend):
    a, b = distlock.connect(backend.url), distlock.connect(backend.url)
    with a.campaign("contested", "a", ttl=10):
        with pytest.raises(distlock.LockHeld, match='another candidate still leads "contested"'):
            b.campaign("contested", "b", ttl=10, timeout=0.3)
    with b.campaign("contested", "b", ttl=10, timeout=0):
        pass


def test_observe_follows_vacancy_and_leaders_with_growing_terms(backend):
    a, b = distlock.connect(backend.url), distlock.connect(backend.url)
    watch = distlock.connect(backend.url).observe("followed", poll_interval=0.1)
    assert watch.key == "followed" and iter(watch) is watch
    assert next(watch) is None
    first = a.campaign("followed", "leader-a", ttl=10)
    seen_a = next(watch)
    assert seen_a.term == first.term
    assert_label(backend, seen_a.identity, "leader-a")
    first.resign()
    assert next(watch) is None
    second = b.campaign("followed", "leader-b", ttl=10)
    seen_b = next(watch)
    assert seen_b == distlock.connect(backend.url).leader("followed")
    assert seen_b.term == second.term > seen_a.term
    assert_label(backend, seen_b.identity, "leader-b")
    second.resign()
    assert next(watch) is None


def test_lost_leadership_says_so(server_backend):
    locker = distlock.connect(server_backend.url)
    leadership = locker.campaign("deposed", "a", ttl=1.5)
    server_backend.delete_lock("deposed")
    assert leadership.wait_lost(timeout=30)
    assert leadership.is_lost() and "refused" in leadership.lost_reason
    with pytest.raises(distlock.LockLost, match=r'leadership lost: "deposed" \(term'):
        leadership.raise_if_lost()
    with pytest.raises(distlock.LockLost, match="another candidate may have led"):
        leadership.resign()


def test_async_election(backend):
    async def scenario():
        a, b, c = (distlock.connect(backend.url) for _ in range(3))
        watch = c.observe("async-election", poll_interval=0.1)
        assert watch.__aiter__() is watch

        async def step():
            return await asyncio.wait_for(watch.__anext__(), 60)

        assert await step() is None
        # A step cancelled while it waits loses nothing: the next one answers.
        pending = asyncio.ensure_future(watch.__anext__())
        await asyncio.sleep(0.2)
        assert not pending.done()
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert await c.leader_async("async-election") is None
        first = await a.campaign_async("async-election", "a", ttl=10)
        seen_a = await step()
        assert seen_a.term == first.term
        assert (await c.leader_async("async-election")) == seen_a

        # A candidate cancelled mid-campaign leaves nothing held.
        cancelled = asyncio.ensure_future(c.campaign_async("async-election", "c", ttl=10))
        waiting = asyncio.ensure_future(b.campaign_async("async-election", "b", ttl=10))
        await asyncio.sleep(0.2)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert not waiting.done()
        await first.__aexit__(None, None, None)
        second = await waiting
        assert second.term > first.term
        # The observer may have seen the vacancy between the two.
        seen = await step()
        if seen is None:
            seen = await step()
        assert seen.term == second.term
        assert_label(backend, seen.identity, "b")
        async with second:
            assert not second.is_lost()
        assert await step() is None

        async with a.campaign_async("async-election", "a", ttl=10, timeout=5) as third:
            assert third.term > second.term
            with pytest.raises(distlock.LockHeld):
                await b.campaign_async("async-election", "b", ttl=10, timeout=0.2)
        assert await a.leader_async("async-election") is None

    asyncio.run(scenario())


def test_async_for_iterates_changes(backend):
    async def scenario():
        locker = distlock.connect(backend.url)
        leadership = await locker.campaign_async("async-for", "a", ttl=10)
        seen = []
        async for leader in locker.observe("async-for", poll_interval=0.1):
            seen.append(leader)
            if leader is None:
                break
            await leadership.__aexit__(None, None, None)
        assert seen[0].term == leadership.term and seen[1:] == [None]

    asyncio.run(scenario())


def test_an_interrupted_campaign_leaves_nothing_held(backend):
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    a, b, c = (distlock.connect(backend.url) for _ in range(3))
    first = a.campaign("interrupted", "a", ttl=10)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        # As Ctrl-C would: the signal handler's exception stops the wait.
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            b.campaign("interrupted", "b", ttl=10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    first.resign()
    # b's campaign ended with nothing held: c leads at once.
    with c.campaign("interrupted", "c", ttl=10, timeout=5) as third:
        assert third.term > first.term
