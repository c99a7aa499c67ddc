//! Lock-core's own rules over a backend that misbehaves in one way: the
//! waiting loop after an attempt whose outcome is unknown, and a guard
//! whose renewal finds foreign data.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::{
    AcquireReply, AcquireRequest, Capabilities, ErrorKind, ExtendReply, HeldLock, LockBackend,
    LockClient, LockError, LockKey, LockOptions, Locker, LostReason, MemoryLock, OwnerToken,
    ReleaseReply, ReleaseWatch, Renewal,
};

/// `MemoryLock` with three faults: the first `lost_replies` acquire
/// attempts are applied but answered `Timeout` (the reply lost); with
/// `stall_replies` every attempt that is not settling is applied and then
/// never answered (a server holding the reply, as Redis's `WAIT` does for a
/// missing replica); with `corrupt_extends` every extend answers
/// `Corrupted` (foreign data at the key); with `resent_releases` every
/// release is applied and then answered `NotHeldAfterResend` (its first
/// send's reply was lost, and the resend found the lock gone). With
/// `attempt_before_watch` it declares that capability, and a registration
/// first releases `released_on_watch` (a release landing between a refused
/// attempt and the waiter's registration). With `slow_extends` every
/// extend signals `extend_called`, then takes that long before it is
/// applied.
#[derive(Debug, Default)]
struct Faulty {
    server: MemoryLock,
    lost_replies: AtomicUsize,
    stall_replies: bool,
    corrupt_extends: bool,
    resent_releases: bool,
    attempts: AtomicUsize,
    settling_attempts: AtomicUsize,
    /// Signalled when a stalled attempt has been applied.
    applied: tokio::sync::Notify,
    attempt_before_watch: bool,
    watches: AtomicUsize,
    released_on_watch: std::sync::Mutex<Option<(LockClient, crate::Lease)>>,
    slow_extends: Option<Duration>,
    extend_called: tokio::sync::Notify,
    /// With `slow_leaves`, each watch's leave takes that long, then counts
    /// itself in `left`.
    slow_leaves: Option<Duration>,
    left: Arc<AtomicUsize>,
}

#[async_trait]
impl LockBackend for Faulty {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            attempt_before_watch: self.attempt_before_watch,
            ..self.server.capabilities()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if request.settling {
            self.settling_attempts.fetch_add(1, Ordering::SeqCst);
        }
        let reply = self.server.acquire(request).await?;
        if self.stall_replies && !request.settling {
            self.applied.notify_one();
            std::future::pending::<()>().await;
        }
        let lost = self
            .lost_replies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lost {
            return Err(LockError::timeout("the reply was lost (applied)"));
        }
        Ok(reply)
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        if let Some(slow) = self.slow_extends {
            self.extend_called.notify_one();
            tokio::time::sleep(slow).await;
        }
        if self.corrupt_extends {
            return Err(LockError::corrupted(
                "the key holds a value distlock did not write",
            ));
        }
        self.server.extend(lock, ttl).await
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let reply = self.server.release(lock).await?;
        if self.resent_releases {
            return Ok(ReleaseReply::NotHeldAfterResend);
        }
        Ok(reply)
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        self.watches.fetch_add(1, Ordering::SeqCst);
        let release = self.released_on_watch.lock().unwrap().take();
        if let Some((client, lease)) = release {
            client.release(&lease).await?;
        }
        let mut watch = self.server.watch(key, waiter).await?;
        if let (Some(watch), Some(slow)) = (&mut watch, self.slow_leaves) {
            let left = self.left.clone();
            watch.leave_with(async move {
                tokio::time::sleep(slow).await;
                left.fetch_add(1, Ordering::SeqCst);
            });
        }
        Ok(watch)
    }
}

/// A current-thread runtime with time and I/O, for tests that drive
/// runtimes themselves.
pub(crate) fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A multi-thread runtime of one worker, with time and I/O: driven all
/// along, beside runtimes a test drives itself.
pub(crate) fn one_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime")
}

fn faulty(lost_replies: usize, corrupt_extends: bool) -> (Arc<Faulty>, LockClient) {
    let backend = Arc::new(Faulty {
        lost_replies: AtomicUsize::new(lost_replies),
        corrupt_extends,
        ..Faulty::default()
    });
    (backend.clone(), LockClient::new(backend))
}

fn key() -> LockKey {
    LockKey::new("job").unwrap()
}

const TTL: Duration = Duration::from_secs(60);

/// A waiting acquire whose first attempt was applied unseen gets that lock
/// from its next attempt (one owner token per acquisition, adopted by the
/// backend), not `Ok(None)` after waiting on its own orphan.
#[tokio::test]
async fn waiting_acquire_adopts_what_a_lost_reply_took() {
    let (backend, client) = faulty(1, false);
    let deadline = Instant::now() + Duration::from_secs(5);
    let lease = client
        .acquire(&key(), TTL, deadline)
        .await
        .unwrap()
        .expect("the lock its own first attempt took");
    assert_eq!(backend.attempts.load(Ordering::SeqCst), 2);
    assert_eq!(backend.server.held_count(), 1, "one lock, not two");
    client.release(&lease).await.unwrap();
    assert_eq!(backend.server.held_count(), 0);
}

/// A waiting acquire cancelled while it waits leaves its line before its
/// task ends: the client's `idle` covers the leave (a caller that awaits
/// it finds nobody in line after the wait).
#[tokio::test]
async fn idle_covers_the_leave_of_a_cancelled_wait() {
    let backend = Arc::new(Faulty {
        slow_leaves: Some(Duration::from_millis(200)),
        ..Faulty::default()
    });
    let client = LockClient::new(backend.clone());
    let held = client
        .try_acquire(&key(), TTL)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let (k, deadline) = (key(), Instant::now() + TTL);
    let mut waiting = Box::pin(client.acquire(&k, TTL, deadline));
    while backend.watches.load(Ordering::SeqCst) == 0 {
        tokio::select! {
            result = &mut waiting => panic!("the wait ended: {result:?}"),
            () = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    }
    drop(waiting);
    client.idle().await;
    assert_eq!(
        backend.left.load(Ordering::SeqCst),
        1,
        "idle returned before the cancelled wait left its line"
    );
    client.release(&held).await.unwrap();
}

/// A single try whose reply is lost ends with the error, and the lock it
/// took is given back in the background (one more attempt with the same
/// owner token finds it): once the client is idle, nothing is held.
#[tokio::test]
async fn try_lock_with_a_lost_reply_leaves_nothing_held() {
    let (backend, client) = faulty(1, false);
    let locker = Locker::new(client.clone());
    let err = locker
        .try_lock(&key(), &LockOptions::new(TTL))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout);
    tokio::time::timeout(Duration::from_secs(10), client.idle())
        .await
        .expect("background work ends");
    assert_eq!(backend.attempts.load(Ordering::SeqCst), 2);
    assert_eq!(backend.server.held_count(), 0, "the orphan was given back");
}

/// A backend whose attempts are applied and never answered (settling ones
/// excepted), a client and a locker over it.
fn stalling() -> (Arc<Faulty>, LockClient, Locker) {
    let backend = Arc::new(Faulty {
        stall_replies: true,
        ..Faulty::default()
    });
    let client = LockClient::new(backend.clone());
    let locker = Locker::new(client.clone());
    (backend, client, locker)
}

/// Waits until the lock a stalled attempt took was given back, by one
/// settling attempt (not by its reply, which never comes).
async fn given_back_by_one_settling_attempt(backend: &Faulty) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.server.held_count() != 0 {
        assert!(
            Instant::now() < deadline,
            "the lock the stalled attempt took is still held: nothing gave it back while its reply was pending"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(backend.settling_attempts.load(Ordering::SeqCst), 1);
}

/// A waiting acquire cancelled while its attempt is in flight (applied,
/// its reply held by the server) returns at once, and the lock that
/// attempt took is given back without waiting for that reply: a settling
/// attempt with the same owner token adopts it, and it is released.
#[tokio::test]
async fn cancel_gives_back_what_an_attempt_in_flight_took() {
    let (backend, _client, locker) = stalling();
    let options = LockOptions::new(TTL).with_wait(Duration::from_secs(3600));
    let applied = backend.applied.notified();
    let acquired = tokio::time::timeout(
        Duration::from_secs(10),
        locker.acquire_unless(&key(), &options, applied),
    )
    .await
    .expect("the cancelled acquire returns at once");
    assert!(
        acquired.unwrap().is_none(),
        "a cancelled acquire gets no guard"
    );
    given_back_by_one_settling_attempt(&backend).await;
}

/// A single try runs its attempt on the caller's task (no background task
/// while it is in flight), and dropped while that attempt is in flight
/// (applied, its reply held by the server) it still leaves nothing held: a
/// settling attempt with the same owner token adopts the lock and
/// releases it.
#[tokio::test]
async fn try_lock_runs_inline_and_dropped_in_flight_gives_back_what_it_took() {
    let (backend, client, locker) = stalling();
    let options = LockOptions::new(TTL);
    let key = key();
    let applied = backend.applied.notified();
    {
        let attempt = locker.try_lock(&key, &options);
        tokio::pin!(attempt);
        tokio::select! {
            _ = &mut attempt => panic!("a stalled attempt answered"),
            () = applied => {}
        }
        assert_eq!(backend.server.held_count(), 1);
        tokio::time::timeout(Duration::from_secs(10), client.idle())
            .await
            .expect("no background task while a try is in flight: it runs inline");
    }
    given_back_by_one_settling_attempt(&backend).await;
}

/// A renewal answered `Corrupted` (the lock was overwritten by a value
/// distlock did not write) loses the lock at once, as a refusal: long
/// before the stop moment, where a transient failure would be retried.
#[tokio::test]
async fn renewal_finding_foreign_data_loses_the_lock_at_once() {
    let (_backend, client) = faulty(0, true);
    let guard = Locker::new(client)
        .try_lock(
            &key(),
            &LockOptions::new(TTL).with_renewal(Renewal::Every(Duration::from_millis(20))),
        )
        .await
        .unwrap()
        .expect("free");
    let reason = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("lost at the first renewal, not at the stop moment");
    assert_eq!(reason, LostReason::Refused);
    assert!(
        Instant::now() < guard.stop_moment(),
        "lost before the stop moment"
    );
}

/// A release answered `NotHeldAfterResend` is reported done while the
/// lease is still valid by the client's conservative clock (only a release,
/// its own first send, can have freed the lock before then), and as
/// `NotHeld` once the lease may have expired (then expiry or a takeover
/// may have freed it: the caller must not believe it released the lock).
#[tokio::test]
async fn a_release_gone_on_resend_is_done_only_while_the_lease_is_valid() {
    let backend = Arc::new(Faulty {
        resent_releases: true,
        ..Faulty::default()
    });
    let client = LockClient::new(backend.clone());
    let valid = client.try_acquire(&key(), TTL).await.unwrap();
    let valid = valid.lease().expect("free");
    client
        .release(&valid)
        .await
        .expect("released by its first send");
    assert_eq!(backend.server.held_count(), 0);

    let short = Duration::from_millis(20);
    let expired = client.try_acquire(&key(), short).await.unwrap();
    let expired = expired.lease().expect("free");
    while !expired.is_expired() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let err = client.release(&expired).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotHeld, "{err}");
}

/// Every error a client call returns names the backend, the operation and
/// the key once, whether the backend or the client itself made it.
#[tokio::test]
async fn client_errors_name_backend_operation_and_key_once() {
    let context = |e: &LockError| {
        (
            e.backend().map(str::to_owned),
            e.operation().map(str::to_owned),
            e.key().map(str::to_owned),
        )
    };
    let expect = |operation: &str, key: &str| {
        (
            Some("faulty".to_owned()),
            Some(operation.to_owned()),
            Some(key.to_owned()),
        )
    };
    let (_backend, client) = faulty(1, true);
    let err = client.try_acquire(&key(), TTL).await.unwrap_err();
    assert_eq!(context(&err), expect("acquire", "job"));
    assert_eq!(
        err.to_string(),
        r#"lock backend timed out: acquire "job" on faulty: the reply was lost (applied)"#
    );

    let other = LockKey::new("other").unwrap();
    let lease = client
        .try_acquire(&other, TTL)
        .await
        .unwrap()
        .lease()
        .expect("free");
    let err = client.extend(&lease, TTL).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted);
    assert_eq!(context(&err), expect("extend", "other"));
    assert_eq!(err.to_string().matches("other").count(), 1, "{err}");

    client.release(&lease).await.unwrap();
    let err = client.release(&lease).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotHeld);
    assert_eq!(context(&err), expect("release", "other"));
    assert_eq!(err.to_string().matches("other").count(), 1, "{err}");

    let err = client.try_acquire_permit(&other, 2, TTL).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert_eq!(context(&err), expect("acquire a permit", "other"));
}

/// A runtime frozen past the stop moment (the renewal task could not run
/// either) sees its guard lost at once when it runs again: `is_lost` and
/// `while_held` go by the clock, not only by the renewal task's word.
/// Before, the job ran on: the lost signal waited for the renewal task.
#[tokio::test(flavor = "current_thread")]
async fn frozen_runtime_sees_lost_first() {
    let locker = Locker::new(MemoryLock::new());
    let key = LockKey::new("frozen").unwrap();
    let options = LockOptions::new(Duration::from_millis(300));
    let guard = locker.try_lock(&key, &options).await.unwrap().unwrap();
    let stop = guard.stop_moment();
    // Frozen: nothing on this runtime runs until past the stop moment.
    std::thread::sleep(stop.saturating_duration_since(Instant::now()) + Duration::from_millis(20));
    assert!(guard.is_lost(), "lost by the clock");
    assert_eq!(guard.lost_signal().reason(), Some(LostReason::Expired));
    assert!(guard.while_held(async { "the job ran" }).await.is_err());
    assert_eq!(guard.lost().await, LostReason::Expired);
}

/// A backend whose watch costs a request: a waiting acquire of a free key
/// takes it with one attempt and no registration; one that registers
/// first (the default) registers even then.
#[tokio::test]
async fn a_free_key_is_taken_without_a_watch_where_watching_costs_a_request() {
    for attempt_before_watch in [true, false] {
        let backend = Arc::new(Faulty {
            attempt_before_watch,
            ..Faulty::default()
        });
        let client = LockClient::new(backend.clone());
        let deadline = Instant::now() + Duration::from_secs(5);
        let lease = client.acquire(&key(), TTL, deadline).await.unwrap();
        assert!(lease.is_some(), "a free key is taken");
        assert_eq!(backend.attempts.load(Ordering::SeqCst), 1);
        let watches = backend.watches.load(Ordering::SeqCst);
        assert_eq!(
            watches,
            usize::from(!attempt_before_watch),
            "with attempt_before_watch = {attempt_before_watch}"
        );
    }
}

/// Refused before registering, a waiting acquire registers and attempts
/// again at once: a release that lands between the refusal and the
/// registration (which no watch registered after it can report) is seen
/// by that attempt, not at the holder's expiry, long after the wait ends.
#[tokio::test]
async fn a_release_before_the_watch_of_a_refused_first_attempt_is_not_missed() {
    let backend = Arc::new(Faulty {
        attempt_before_watch: true,
        ..Faulty::default()
    });
    let holder = backend.server.client();
    let held = holder
        .try_acquire(&key(), TTL)
        .await
        .unwrap()
        .lease()
        .unwrap();
    *backend.released_on_watch.lock().unwrap() = Some((holder, held));
    let client = LockClient::new(backend.clone());
    let deadline = Instant::now() + Duration::from_secs(5);
    let lease = client.acquire(&key(), TTL, deadline).await.unwrap();
    assert!(
        lease.is_some(),
        "the release before the watch was missed: the wait ran out while the key was free"
    );
    assert_eq!(backend.watches.load(Ordering::SeqCst), 1);
    assert_eq!(
        backend.attempts.load(Ordering::SeqCst),
        2,
        "refused, then granted after registering"
    );
}

/// A guard's renewal is sent from its own runtime while that runtime
/// runs: a driver on a runtime driven only now and then, awake when the
/// guard fell due while the guard's runtime was busy for a moment, used to
/// take the renewal and then stop being driven with it in flight (the
/// guard was then lost by the clock). Here the guard's runtime is held up
/// for 20 ms at its renewal moment while the other runtime runs, and that
/// one is then left undriven (not dropped) as soon as an extend starts.
#[test]
fn a_renewal_is_not_taken_by_a_runtime_driven_only_for_a_moment() {
    let backend = Arc::new(Faulty {
        slow_extends: Some(Duration::from_millis(300)),
        ..Faulty::default()
    });
    let locker = Locker::new(LockClient::new(backend.clone()));
    // Its first renewal comes after the other driver's linger ended.
    let options = LockOptions::new(Duration::from_secs(6));
    let (now_and_then, own) = (current_thread_runtime(), current_thread_runtime());
    // A driver on `now_and_then`, lingering.
    now_and_then.block_on(async {
        let key = LockKey::new("now-and-then").unwrap();
        let guard = locker.try_lock(&key, &options).await.unwrap();
        guard.expect("free").release().await.unwrap();
        tokio::task::yield_now().await;
    });
    let guard = own.block_on(async {
        let guard = locker.try_lock(&key(), &options).await.unwrap();
        guard.expect("free")
    });
    let renew_at = locker
        .client()
        .renewals()
        .first_wake()
        .expect("the guard is queued");
    let held_up_until = renew_at + Duration::from_millis(20);
    std::thread::scope(|scope| {
        // Driven until the renewal moment is 20 ms past, or an extend
        // started; then not driven at all until the guard is done.
        let (done, done_rx) = std::sync::mpsc::channel::<()>();
        let (now_and_then, backend) = (&now_and_then, &backend);
        let other = scope.spawn(move || {
            now_and_then.block_on(async {
                tokio::select! {
                    () = backend.extend_called.notified() => {}
                    () = tokio::time::sleep_until(held_up_until.into()) => {}
                }
            });
            let _ = done_rx.recv();
        });
        // `own` is not driven until then (its thread busy elsewhere).
        std::thread::sleep(held_up_until.saturating_duration_since(Instant::now()));
        own.block_on(async {
            tokio::time::sleep_until((guard.stop_moment() + Duration::from_secs(1)).into()).await;
            assert!(
                !guard.is_lost(),
                "the guard was lost: its renewal was taken by a runtime that then stopped"
            );
            guard.release().await.expect("held, so released");
        });
        let _ = done.send(());
        other.join().expect("no panic");
    });
}
