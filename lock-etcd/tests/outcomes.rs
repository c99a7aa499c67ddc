//! Requests whose outcome is unknown, and foreign data in a waiter queue.
//! A renewing acquire whose requests reach the server late (held by a
//! delaying proxy past the operation timeout) never leaves a lock that
//! outlives the client's undo, and a queue key distlock did not write is
//! reported, not obeyed and not deleted.

mod common;

use std::time::{Duration, Instant};

use common::{
    acquire, any_server, assert_freed, connect, proxy_for, raw_client, release_resent, through,
    unique_key,
};
use distlock_conformance::fault::Direction;
use distlock_conformance::naming::unique_name;
use distlock_core::ErrorKind;

/// A key under a lock's waiter queue that distlock did not write makes a
/// waiting acquire fail with `Corrupted` once the lock is freed at the
/// latest (it never waits on the foreign key until its deadline), a
/// `try_acquire` of the free lock reports it too (it is in the line the
/// attempt must not cut into), and the key is left in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_in_a_waiter_queue_is_reported_not_obeyed() {
    let server = any_server();
    let ns = unique_name("foreign");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let waiter = connect(&url).await;
    let k = unique_key("foreign-queue");
    let foreign = format!("{ns}/lock/{}/waiters/not-ours", k.as_str());
    // Put there while the lock is held: a free lock's attempts look at
    // the line too (no cut-in), and report it (checked at the end).
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    raw.put(foreign.clone(), "hello", None)
        .await
        .expect("raw put");
    let deadline = Instant::now() + Duration::from_secs(60);
    let waiting = {
        let waiter = waiter.clone();
        let k = k.clone();
        tokio::spawn(async move { waiter.acquire(&k, Duration::from_secs(30), deadline).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    holder.release(&held).await.expect("release");
    let result = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .map(|joined| joined.expect("waiting task"));
    match result {
        Ok(Err(e)) if e.kind() == ErrorKind::Corrupted => {}
        Ok(other) => panic!("the waiter obeyed or ignored the foreign queue key: {other:?}"),
        Err(_) => panic!("the waiter was still waiting 30 s after the release (stalled behind the foreign queue key)"),
    }
    let attempt = holder.try_acquire(&k, Duration::from_secs(30)).await;
    assert!(
        matches!(&attempt, Err(e) if e.kind() == ErrorKind::Corrupted),
        "a try_acquire of the free lock obeyed or ignored the foreign queue key: {attempt:?}"
    );
    let left = raw.get(foreign.clone(), None).await.expect("raw get");
    assert_eq!(left.kvs().len(), 1, "the foreign key was deleted");
}

/// A renewing acquire whose requests reach the server only after its
/// operation timeout (a proxy delays every request by 3× that timeout), in
/// rounds: whatever order the server applies the late acquire and the
/// client's undo in, no lock is left on the session lease — another client
/// gets the lock once the acquire's TTL has passed, while the first client
/// (and so its session lease) lives on. A regression guard: on this
/// machine it also passed before fences (the reordering it guards against
/// needs the client to switch connections while requests are delayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_renewing_acquire_never_outlives_its_undo() {
    let server = any_server();
    let proxy = proxy_for(&server).await;
    let a = connect(&through(&proxy, "operation_timeout_ms=400")).await;
    let b = connect(&server.url()).await;
    let ttl = Duration::from_secs(3);
    for round in 0..10 {
        let k = unique_key("late-renewing");
        proxy.delay(Direction::ToServer, Duration::from_millis(1200));
        let attempt = a.try_acquire_renewing(&k, ttl).await;
        proxy.delay(Direction::ToServer, Duration::ZERO);
        match attempt {
            // Delayed requests are answered after the timeout: nothing
            // can have been granted in time.
            Ok(got) => panic!("round {round}: answered in time: {got:?}"),
            Err(e) => assert!(e.is_transient(), "round {round}: {e}"),
        }
        // Nobody renews it: free after the TTL (plus the delayed
        // requests' landing), never held for the life of client `a`.
        tokio::time::sleep(ttl).await;
        assert_freed(
            &b,
            &k,
            &format!("round {round}: a late renewing acquire stayed on the session lease"),
        )
        .await;
    }
    drop(a);
}

/// A release whose reply is held past its first send's share of the
/// operation timeout is sent again; the second send finds the lock gone
/// (the first released it) and the release is still reported done, not
/// "not held" — the lease was valid, so nothing but a release freed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_answered_after_its_resend_is_reported_done() {
    let server = any_server();
    let proxy = proxy_for(&server).await;
    // Each send gets a third of the 6 s: a reply held 2.5 s misses the
    // first send's share and still arrives within the operation for the
    // second.
    let a = connect(&through(&proxy, "operation_timeout_ms=6000")).await;
    let b = connect(&server.url()).await;
    let k = unique_key("resent-release");
    let held = acquire(&a, &k, Duration::from_secs(60)).await;
    release_resent(&proxy, &a, held)
        .await
        .expect("a release whose first send was applied unanswered");
    assert_freed(&b, &k, "the released lock").await;
}

/// An attempt applied late — after the refusal that made its acquisition
/// queue, before its queue entry was put — leaves the lock held by that
/// acquisition's owner token, which the entry's own transaction reads. The
/// attempt right after the join adopts it: it must not be refused there
/// and wait for a release that never comes (a renewing lock lives on the
/// client's session lease, kept alive as long as the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_grant_the_join_finds_is_adopted_not_waited_for() {
    use distlock_core::{AcquireReply, AcquireRequest, HeldLock, LockBackend, OwnerToken};
    let server = any_server();
    let url = format!("{}?namespace={}", server.url(), unique_name("latejoin"));
    let backend = distlock_etcd::EtcdLock::connect(&url)
        .await
        .expect("connect");
    let k = unique_key("late-join");
    let owner = OwnerToken::random();
    let request = AcquireRequest {
        key: &k,
        owner,
        ttl: Duration::from_secs(30),
        renewing: true,
        settling: false,
        holder: None,
    };
    // The grant of an earlier attempt of this acquisition, whose reply its
    // caller never saw.
    let AcquireReply::Granted(late) = backend.acquire(request).await.expect("acquire") else {
        panic!("the key is free");
    };
    // The acquisition queues (after a refusal, as a waiting acquire does)
    // and tries again at once.
    let watch = backend
        .watch(&k, owner)
        .await
        .expect("watch")
        .expect("etcd queues waiters");
    let reply = backend.acquire(request).await.expect("acquire in line");
    let AcquireReply::Granted(adopted) = reply else {
        panic!("the lock its own late attempt took was refused, not adopted: {reply:?}");
    };
    assert_eq!(adopted.fencing, late.fencing, "the same lock, adopted");
    drop(watch);
    let held = HeldLock {
        key: &k,
        owner,
        fencing: adopted.fencing,
        handle: adopted.handle,
    };
    backend.release(held).await.expect("release");
}
