//! Requests caught in flight: a session that dies while a
//! renewing acquire is in flight never yields a live lease, a dropped
//! renewing acquire's lock still expires, and dropped waits leave no queue
//! entries. Replies are held back with the shared fault proxy's one-way
//! hold: requests still reach the server and take effect, in order, while
//! the client hears nothing.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::{
    acquire, acquire_renewing, any_server, assert_freed, assert_queue_empties, connect, observed,
    proxy_for, raw_client, through, unique_key, Waiting,
};
use distlock_conformance::fault::{Direction, Proxy};
use distlock_conformance::naming::unique_name;
use distlock_core::{AcquireAttempt, LockBackend, LockClient, LockKey};
use distlock_etcd::EtcdLock;

/// How long after the replies are cut [`kill_session_during`] sends the
/// request: well after the last keep-alive that can still be answered.
const SEND_AFTER_CUT: Duration = Duration::from_millis(700);
/// How long after the session's client-side deadline the replies flow again.
const HEAL_AFTER_DEATH: Duration = Duration::from_millis(300);

/// Kills the etcd session of a client behind `proxy` while `request` is in
/// flight: holds every reply, so the client's keep-alives go unanswered
/// (they still reach the server, which keeps the lease), sends `request` a
/// moment later (the server applies it on the live session lease), and
/// lets the replies through only after the client's deadline for the
/// session (at most `session_ttl` after the cut) has passed, but before
/// the request's own TTL ran out. By then the client has given the session
/// up and revoked its lease on the server, so whatever `request` put on it
/// is gone; its reply reaches a client whose session is dead. Returns the
/// request's output.
async fn kill_session_during<T>(
    proxy: &Proxy,
    session_ttl: Duration,
    request: impl Future<Output = T>,
) -> T {
    proxy.hold(Direction::ToClient);
    let cut_at = Instant::now();
    let send = async {
        tokio::time::sleep(SEND_AFTER_CUT).await;
        request.await
    };
    let heal = async {
        tokio::time::sleep_until((cut_at + session_ttl + HEAL_AFTER_DEATH).into()).await;
        proxy.pass(Direction::ToClient);
    };
    let (output, ()) = tokio::join!(send, heal);
    output
}

/// Another client tries `key` until `until`; panics if it gets the lock
/// while the first holder's lease (valid until `until`) still claims it.
async fn assert_not_taken_before(other: &LockClient, key: &LockKey, until: Instant) {
    while Instant::now() < until {
        if let Ok(AcquireAttempt::Acquired(taken)) =
            other.try_acquire(key, Duration::from_secs(30)).await
        {
            let left = until.saturating_duration_since(Instant::now());
            assert!(
                left.is_zero(),
                "another client acquired {key} while the first lease still had {left:?} left"
            );
            other.release(&taken).await.expect("release");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client `a` behind a fault proxy in front of `server` (with `query`
/// in its URL), and a direct client `b`.
async fn proxied_clients(
    server: &distlock_conformance::server::ServerHandle,
    query: &str,
) -> (Proxy, LockClient, LockClient) {
    let proxy = proxy_for(server).await;
    let a = connect(&through(&proxy, query)).await;
    let b = connect(&server.url()).await;
    (proxy, a, b)
}

/// Makes sure `client` has a live session for `ttl`, its keep-alives
/// answered.
async fn warm_session(client: &LockClient, ttl: Duration) {
    let warm = acquire_renewing(client, &unique_key("session-warm"), ttl).await;
    client.release(&warm).await.expect("release");
}

/// A renewing acquire whose session dies while its
/// transaction is in flight must not return a live lease dated from the
/// send time: the dead session's lease is revoked (deleting the key), so
/// another client can take the lock at once. The acquire is refused
/// (transient error), or its lease is already expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_acquire_on_a_session_that_dies_in_flight_gets_no_live_lease() {
    let server = any_server();
    let (proxy, a, b) = proxied_clients(&server, "operation_timeout_ms=8000").await;
    let ttl = Duration::from_secs(2);
    for round in 0..2 {
        warm_session(&a, ttl).await;
        let k = unique_key("session-dies");
        let outcome = kill_session_during(&proxy, ttl, a.try_acquire_renewing(&k, ttl)).await;
        match outcome {
            Ok(AcquireAttempt::Acquired(lease)) => {
                eprintln!(
                    "round {round}: acquired, {:?} left on the lease",
                    lease
                        .valid_until()
                        .saturating_duration_since(Instant::now())
                );
                assert_not_taken_before(&b, &k, lease.valid_until()).await;
                let _ = a.release(&lease).await;
            }
            Ok(AcquireAttempt::Held { .. }) => panic!("round {round}: {k} was free"),
            Err(e) => {
                eprintln!("round {round}: refused: {e}");
                assert!(e.is_transient(), "round {round}: {e}");
            }
        }
        // Either way the key does not stay held by the dead session.
        assert_freed(&b, &k, "the dead session's lock").await;
    }
}

/// Dropped raw futures: a renewing acquire dropped after
/// its transaction reached the server (the reply held back, then a timeout)
/// created a lock on the client's session lease that nobody renews; the
/// session must still expire it after its TTL, though the client (and so
/// the session lease) lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_acquire_dropped_in_flight_still_expires() {
    let server = any_server();
    let (proxy, a, b) = proxied_clients(&server, "").await;
    let ttl = Duration::from_secs(2);
    warm_session(&a, ttl).await;

    let k = unique_key("dropped-renewing");
    proxy.hold(Direction::ToClient);
    let dropped = tokio::time::timeout(ttl / 4, a.try_acquire_renewing(&k, ttl)).await;
    proxy.pass(Direction::ToClient);
    assert!(dropped.is_err(), "the reply was held back");
    // The server applied it: the lock is there, on the live session lease.
    assert!(matches!(
        b.try_acquire(&k, ttl).await.expect("try_acquire"),
        AcquireAttempt::Held { .. }
    ));
    assert_freed(&b, &k, "a dropped renewing acquire's lock outlived its TTL").await;
    drop(a);
}

/// A pseudo-random duration below `max`.
fn random_below(max: Duration) -> Duration {
    Duration::from_micros(rand::random_range(
        0..u64::try_from(max.as_micros()).unwrap_or(1).max(1),
    ))
}

/// Waiting calls dropped at any await point (a timeout
/// around the client's waiting `acquire` and the raw backend's `watch`)
/// leave no queue entries, so a later waiter is woken by the release, not
/// by its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waits_leave_no_queue_entries_and_do_not_stall_later_waiters() {
    let server = any_server();
    let ns = unique_name("drop");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let k = unique_key("dropped-waits");
    let queue = format!("{ns}/lock/{}/waiters/", k.as_str());
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;

    // How long one wait takes to queue, so the timeouts below fall inside it.
    let lock = EtcdLock::connect(&url).await.expect("waiter");
    let waiter = LockClient::new(lock.clone());
    let started = Instant::now();
    drop(
        lock.watch(&k, distlock_core::OwnerToken::random())
            .await
            .expect("watch"),
    );
    let queueing = started.elapsed() * 2;
    for i in 0..60 {
        let limit = random_below(queueing);
        if i % 2 == 0 {
            let deadline = Instant::now() + Duration::from_secs(30);
            let wait = waiter.acquire(&k, Duration::from_secs(30), deadline);
            assert!(
                tokio::time::timeout(limit, wait).await.is_err(),
                "{k} is held"
            );
        } else if let Ok(watched) =
            tokio::time::timeout(limit, lock.watch(&k, distlock_core::OwnerToken::random())).await
        {
            drop(watched.expect("watch"));
        }
    }

    // A later waiter, on another client, is woken by the release.
    let (attempts, late) = observed(&url).await;
    let waiting = Waiting::start(&attempts, &late, &k).await;
    holder.release(&held).await.expect("release");
    let got = waiting.acquired().await;
    assert!(
        attempts.attempts_in_line() <= 2,
        "{} attempts",
        attempts.attempts_in_line()
    );
    late.release(&got).await.expect("release");

    // Every dropped wait left the queue (the waiter's client, whose session
    // lease would keep leaked entries, is still alive).
    assert_queue_empties(&mut raw, &queue).await;
    drop(waiter);
    drop(lock);
}
