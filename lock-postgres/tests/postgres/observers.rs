//! Observers woken by the server (`LockAdmin::watch_holder`): the
//! namespace's `_holder` channel carries a labelled grant, the release of
//! a labelled lock and a force release; its wake-ups reach observers only,
//! never a waiter, and an observer takes neither a waiter's wake-up nor a
//! place in its line.
//!
//! No test here waits for something *not* to happen: a raw listener hears
//! the `_holder` channel in commit order, and a watch of the client's
//! listener is checked right after a later wake-up of the same connection
//! was delivered (the listener wakes in the order it reads).

use std::time::Duration;

use distlock_core::{
    AcquireReply, AcquireRequest, Grant, HeldLock, HolderId, LockBackend, LockKey, OwnerToken,
    ReleaseWatch,
};
use distlock_postgres::{channel_name, WAITER_TABLE};
use futures_util::FutureExt;
use sqlx::postgres::PgListener;

use super::support::*;

/// The holders' TTL: no expiry falls inside a test.
const LONG: Duration = Duration::from_secs(120);
/// Far below [`LONG`]: what a wake-up takes at most here.
const BOUND: Duration = Duration::from_secs(30);

/// One acquire attempt of `owner` on `k`, with `label`, directly on the
/// backend (so the test keeps the owner token for a later adoption).
async fn attempt(
    lock: &Pg,
    k: &LockKey,
    owner: OwnerToken,
    label: Option<&HolderId>,
) -> AcquireReply {
    lock.backend
        .acquire(AcquireRequest {
            key: k,
            owner,
            ttl: LONG,
            renewing: false,
            settling: false,
            holder: label,
        })
        .await
        .unwrap()
}

/// [`attempt`] on a free key (or one `owner` holds): the grant.
async fn granted(lock: &Pg, k: &LockKey, owner: OwnerToken, label: Option<&HolderId>) -> Grant {
    match attempt(lock, k, owner, label).await {
        AcquireReply::Granted(grant) => grant,
        held => panic!("{k:?} was not granted: {held:?}"),
    }
}

/// Releases what `grant` gave `owner` on `k`.
async fn release(lock: &Pg, k: &LockKey, owner: OwnerToken, grant: &Grant) {
    let held = HeldLock {
        key: k,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    };
    let reply = lock.backend.release(held).await.unwrap();
    assert!(
        matches!(reply, distlock_core::ReleaseReply::Released),
        "{reply:?}"
    );
}

/// An observers' watch on `k` (returns once the server listens).
async fn observe(lock: &Pg, k: &LockKey) -> ReleaseWatch {
    let admin = lock.backend.admin().expect("operator calls");
    admin
        .watch_holder(k)
        .await
        .unwrap()
        .expect("observers woken by the server")
}

/// Waits (within [`BOUND`]) for `watch` to fire.
async fn heard(watch: &mut ReleaseWatch, what: &str) {
    tokio::time::timeout(BOUND, watch.released())
        .await
        .unwrap_or_else(|_| panic!("{what}: not woken within {BOUND:?}"))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// The members in the waiter line of `k` in namespace `ns`.
async fn line(lock: &Pg, ns: &str, k: &LockKey) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT member FROM public.{WAITER_TABLE} WHERE namespace = $1 AND key = $2 ORDER BY arrival"
    ))
    .bind(ns)
    .bind(k.as_str())
    .fetch_all(lock.pool())
    .await
    .unwrap()
}

/// A waiter in line for a held key, and observers of that key on the
/// waiter's own client (same listener connection) and on another one: a
/// labelled grant (here an adoption by the holder) wakes both observers
/// and not the waiter, which keeps its place alone in line; the release
/// wakes the waiter (its one wake-up, which keeps its place) and both
/// observers; once the waiter left, a labelled take and a force release
/// wake the observers.
#[tokio::test]
async fn observers_are_woken_and_never_wake_a_waiter() {
    let ns = unique_name("observe");
    let (holder, waiter, apart) = (client(&ns).await, client(&ns).await, client(&ns).await);
    assert!(waiter.backend.capabilities().holder_watch);
    let k = key("leader");
    let label = HolderId::new("pod-1").unwrap();
    let h = OwnerToken::random();
    let grant = granted(&holder, &k, h, Some(&label)).await;

    // The waiter subscribes, then attempts, as a waiting acquire does: it
    // joins the line.
    let w = OwnerToken::random();
    let mut waiting = waiter
        .backend
        .watch(&k, w)
        .await
        .unwrap()
        .expect("native wait");
    let refused = attempt(&waiter, &k, w, None).await;
    assert!(matches!(refused, AcquireReply::Held { .. }), "{refused:?}");
    assert_eq!(line(&holder, &ns, &k).await, [w.to_hex()]);
    let mut beside = observe(&waiter, &k).await;
    let mut other = observe(&apart, &k).await;

    // A labelled grant: the holder's own again (adopted, same token).
    let again = granted(&holder, &k, h, Some(&label)).await;
    assert_eq!(again.fencing, grant.fencing, "adopted");
    heard(&mut beside, "the observer beside the waiter, at the grant").await;
    heard(&mut other, "the observer apart, at the grant").await;
    // `beside` fired, so the waiter's connection delivered the grant's
    // notification: had it woken the waiter, this would be ready.
    assert!(
        waiting.released().now_or_never().is_none(),
        "an observers' notification woke a waiter"
    );
    assert_eq!(
        line(&holder, &ns, &k).await,
        [w.to_hex()],
        "observers take no place in line; the waiter keeps its own"
    );

    // The release wakes the waiter in line alone, and the observers too.
    release(&holder, &k, h, &again).await;
    heard(&mut waiting, "the waiter, at the release").await;
    heard(
        &mut beside,
        "the observer beside the waiter, at the release",
    )
    .await;
    heard(&mut other, "the observer apart, at the release").await;
    assert_eq!(
        line(&holder, &ns, &k).await,
        [w.to_hex()],
        "the woken waiter keeps its place, with its turn"
    );
    // Its wait ends without the lock: it leaves the line, and the key is
    // free for anyone.
    drop(waiting);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !line(&holder, &ns, &k).await.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the waiter whose wait ended left the line"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // A labelled take, then an operator's force release.
    let label = HolderId::new("pod-2").unwrap();
    granted(&holder, &k, OwnerToken::random(), Some(&label)).await;
    heard(&mut beside, "the observer beside the waiter, at the take").await;
    heard(&mut other, "the observer apart, at the take").await;
    assert!(apart.force_release(&k).await.unwrap());
    heard(
        &mut beside,
        "the observer beside the waiter, at the force release",
    )
    .await;
    heard(&mut other, "the observer apart, at the force release").await;
}

/// Exactly what reaches the `_holder` channel, in commit order: a labelled
/// grant, the release of a labelled lock and every force release, each
/// with the key; an unlabelled take and its release send nothing there.
#[tokio::test]
async fn the_holder_channel_carries_labelled_changes_and_force_releases() {
    let ns = unique_name("observe");
    let lock = client(&ns).await;
    let holder_channel = format!("{}_holder", channel_name("public", "distlock_locks", &ns));
    let mut raw = PgListener::connect(&server().url()).await.unwrap();
    raw.listen(&holder_channel).await.unwrap();
    let mut hear = async || {
        let n = tokio::time::timeout(BOUND, raw.recv())
            .await
            .expect("a notification on the holder channel")
            .unwrap();
        n.payload().to_owned()
    };
    let (quiet, k) = (key("quiet"), key("k"));
    let label = HolderId::new("pod-1").unwrap();

    let lease = take(&lock, &quiet, LONG, "free").await;
    lock.release(&lease).await.unwrap();
    let owner = OwnerToken::random();
    let grant = granted(&lock, &k, owner, Some(&label)).await;
    assert_eq!(
        hear().await,
        "k",
        "the labelled grant (the unlabelled take and release sent nothing)"
    );
    release(&lock, &k, owner, &grant).await;
    assert_eq!(hear().await, "k", "the labelled lock's release");

    // A force release needs no label.
    take(&lock, &quiet, LONG, "free").await;
    assert!(lock.force_release(&quiet).await.unwrap());
    assert_eq!(hear().await, "quiet", "the force release");
    granted(&lock, &k, OwnerToken::random(), Some(&label)).await;
    assert_eq!(hear().await, "k", "the next labelled grant");
}

/// A labelled acquire whose caller left before the reply: its grant
/// notifies observers, and so does the give-back that frees the lock again.
#[tokio::test]
async fn a_labelled_grant_given_back_notifies_observers_twice() {
    let ns = unique_name("observe");
    let (lock, app) = named_client(&ns, "").await;
    let admin = client(&ns).await;
    let holder_channel = format!("{}_holder", channel_name("public", "distlock_locks", &ns));
    let mut raw = PgListener::connect(&server().url()).await.unwrap();
    raw.listen(&holder_channel).await.unwrap();
    let k = key("k");
    // The row exists, free, and a transaction holds it locked: the
    // acquire waits for it.
    let lease = take(&lock, &k, LONG, "free").await;
    lock.release(&lease).await.unwrap();
    let blocker = lock_row(&admin, &lock, &k).await;
    let call = {
        let (lock, k) = (lock.clone(), k.clone());
        tokio::spawn(async move {
            let label = HolderId::new("pod-1").unwrap();
            attempt(&lock, &k, OwnerToken::random(), Some(&label)).await
        })
    };
    backend(&admin, &app, "wait_event_type = 'Lock'").await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    blocker.commit().await.unwrap();
    for what in ["the grant", "the give-back"] {
        let n = tokio::time::timeout(BOUND, raw.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: nothing on the holder channel"))
            .unwrap();
        assert_eq!(n.payload(), "k", "{what}");
    }
    assert_eq!(
        lock.inspect(&k).await.unwrap(),
        distlock_core::LockState::Free,
        "given back"
    );
}
