//! Holder labels on etcd beyond the shared suite (`holder::`): the label
//! key `NS/lock/<key>/holder` (see the crate's key layout) is shown only
//! for the owner that holds the lock now, whatever another owner or
//! another program left there; it goes with the lock's lease, also when
//! an extend or an adoption moves the lock to another lease; and the
//! observers' watch (`watch_holder`) fires on every change of holder
//! without taking a waiter's place or wake-up.

mod common;

use std::time::Duration;

use common::{
    acquire, any_server, connect, keys_under, observed, own_server, raw_client, unique_key, Waiting,
};
use distlock_conformance::naming::unique_name;
use distlock_conformance::server::{self, ServerHandle};
use distlock_core::{
    AcquireReply, AcquireRequest, ExtendReply, Grant, HeldLock, HolderId, LockAdmin, LockBackend,
    LockClient, LockKey, LockState, OwnerToken, ReleaseReply, ReleaseWatch, MAX_HOLDER_BYTES,
};
use distlock_etcd::etcd_client::{Client, PutOptions};
use distlock_etcd::EtcdLock;

/// How long a test waits for a watch to fire before it fails (a hang
/// guard, far above what a notice takes; an expiry comes within 2 TTLs).
const NOTICE_WITHIN: Duration = Duration::from_secs(20);

/// A client on a fresh namespace of the shared server, the namespace, a
/// raw client, and the server (kept for as long as the test runs).
async fn setup(label: &str) -> (EtcdLock, String, Client, ServerHandle) {
    let server = any_server();
    let ns = unique_name(label);
    let lock = EtcdLock::connect(&format!("{}?namespace={ns}", server.url()))
        .await
        .expect("connect");
    let raw = raw_client(&server.url()).await;
    (lock, ns, raw, server)
}

fn id(label: &str) -> HolderId {
    HolderId::new(label).expect("a valid label")
}

fn lock_key(ns: &str, key: &LockKey) -> String {
    format!("{ns}/lock/{}", key.as_str())
}

fn label_key(ns: &str, key: &LockKey) -> String {
    format!("{}/holder", lock_key(ns, key))
}

/// Takes the free `key` for `owner` (on the session lease if `renewing`).
async fn take(
    lock: &EtcdLock,
    key: &LockKey,
    owner: OwnerToken,
    renewing: bool,
    holder: Option<&HolderId>,
) -> Grant {
    let request = AcquireRequest {
        key,
        owner,
        ttl: Duration::from_secs(30),
        renewing,
        settling: false,
        holder,
    };
    match lock.acquire(request).await.expect("acquire") {
        AcquireReply::Granted(grant) => grant,
        other => panic!("{key} is free, yet: {other:?}"),
    }
}

/// The label `inspect` shows; panics if the key is free.
async fn shown(lock: &EtcdLock, key: &LockKey) -> Option<HolderId> {
    match lock.inspect(key).await.expect("inspect") {
        LockState::Held { holder, .. } => holder,
        LockState::Free => panic!("{key} is held, inspect says free"),
    }
}

/// The lock `grant` gave `owner` on `key`.
fn held<'a>(key: &'a LockKey, owner: OwnerToken, grant: &Grant) -> HeldLock<'a> {
    HeldLock {
        key,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    }
}

/// Writes `value` at `key` with a raw client, on no lease (as another
/// program might).
async fn leave(raw: &mut Client, key: &str, value: impl Into<Vec<u8>>) {
    raw.put(key, value, None).await.expect("raw put");
}

/// The lease of `key` read raw; `None` if the key is absent.
async fn lease_of(raw: &mut Client, key: &str) -> Option<i64> {
    let reply = raw.get(key, None).await.expect("raw get");
    reply.kvs().first().map(|kv| kv.lease())
}

/// A label another owner left: a client that took the lock after it never
/// shows it, even one that does not know labels (an older client) and so
/// leaves it in place; and whatever else is there (bad data, a label too
/// long or on two lines) breaks neither acquire nor inspect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_another_owner_left_is_never_shown() {
    let (lock, ns, mut raw, _server) = setup("holder-left").await;
    let k = unique_key("left");
    let (lock_at, label_at) = (lock_key(&ns, &k), label_key(&ns, &k));
    let foreign = |owner: OwnerToken, label: &str| format!("dl1:{}/{label}", owner.to_hex());

    // Left before the lock was taken; taken without a label.
    leave(&mut raw, &label_at, foreign(OwnerToken::random(), "ghost")).await;
    let owner = OwnerToken::random();
    let grant = take(&lock, &k, owner, false, None).await;
    assert_eq!(shown(&lock, &k).await, None, "a label left before the take");
    // Written while the lock is held, by another owner.
    leave(&mut raw, &label_at, foreign(OwnerToken::random(), "ghost")).await;
    assert_eq!(shown(&lock, &k).await, None, "another owner's label");
    let released = lock.release(held(&k, owner, &grant)).await.unwrap();
    assert_eq!(released, ReleaseReply::Released);
    assert_eq!(
        lease_of(&mut raw, &label_at).await,
        None,
        "release clears it"
    );

    // Another owner's copy of the holder's own label: not the holder's.
    let owner = OwnerToken::random();
    let grant = take(&lock, &k, owner, false, Some(&id("me"))).await;
    assert_eq!(shown(&lock, &k).await, Some(id("me")));
    leave(&mut raw, &label_at, foreign(OwnerToken::random(), "me")).await;
    assert_eq!(shown(&lock, &k).await, None, "another owner's copy");
    let released = lock.release(held(&k, owner, &grant)).await.unwrap();
    assert_eq!(released, ReleaseReply::Released);

    // A labelled holder on the session lease, force-released by a client
    // that predates labels (it deletes the lock key only), then the lock
    // taken by such a client (it writes the lock key only): the label
    // stays behind, and is not shown for the new holder.
    take(&lock, &k, OwnerToken::random(), true, Some(&id("earlier"))).await;
    assert_eq!(shown(&lock, &k).await, Some(id("earlier")));
    raw.delete(lock_at.as_str(), None).await.unwrap();
    let lease = raw.lease_grant(30, None).await.unwrap().id();
    let older = OwnerToken::random();
    raw.put(
        lock_at.as_str(),
        format!("dl1:{}", older.to_hex()),
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .unwrap();
    assert!(
        lease_of(&mut raw, &label_at).await.is_some(),
        "the earlier holder's label is still there"
    );
    assert_eq!(shown(&lock, &k).await, None, "the older client's lock");

    // Anything else at the label key is ignored, never an error.
    let long = "x".repeat(MAX_HOLDER_BYTES + 1);
    let garbage: Vec<Vec<u8>> = vec![
        b"hello".to_vec(),
        Vec::new(),
        vec![0xff, 0xfe],
        format!("dl1:{}", older.to_hex()).into_bytes(),
        foreign(older, "").into_bytes(),
        foreign(older, "two\nlines").into_bytes(),
        foreign(older, &long).into_bytes(),
        b"dl1:nothex/a".to_vec(),
    ];
    for value in &garbage {
        leave(&mut raw, &label_at, value.clone()).await;
        assert_eq!(shown(&lock, &k).await, None, "{value:?} at the label key");
    }
    // Over garbage, a take without a label and one with a label both work.
    // The older client's lock goes (with its lease).
    raw.lease_revoke(lease).await.expect("raw revoke");
    for holder in [None, Some(id("after-garbage"))] {
        leave(&mut raw, &label_at, b"\xff garbage".to_vec()).await;
        let owner = OwnerToken::random();
        let grant = take(&lock, &k, owner, false, holder.as_ref()).await;
        assert_eq!(shown(&lock, &k).await, holder);
        let released = lock.release(held(&k, owner, &grant)).await.unwrap();
        assert_eq!(released, ReleaseReply::Released);
    }
}

/// The label lives on the lock's lease: put there by the take (own lease
/// or session lease), moved with the lock by an extend to another lease
/// (whose old lease is then revoked) and by an adoption; deleted by a
/// release and a force release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_label_goes_with_the_locks_lease() {
    let (lock, ns, mut raw, _server) = setup("holder-lease").await;
    let k = unique_key("lease");
    let (lock_at, label_at) = (lock_key(&ns, &k), label_key(&ns, &k));
    let label = id("worker-1:77");

    for renewing in [false, true] {
        let owner = OwnerToken::random();
        let grant = take(&lock, &k, owner, renewing, Some(&label)).await;
        let on = lease_of(&mut raw, &lock_at).await.expect("the lock");
        assert_eq!(lease_of(&mut raw, &label_at).await, Some(on), "{renewing}");
        assert_eq!(shown(&lock, &k).await, Some(label.clone()));

        // Adoption (the same owner again) keeps the label, on the lock's lease.
        let again = take(&lock, &k, owner, renewing, Some(&label)).await;
        assert_eq!(again.fencing, grant.fencing);
        let on = lease_of(&mut raw, &lock_at).await.expect("the lock");
        assert_eq!(lease_of(&mut raw, &label_at).await, Some(on), "adopted");
        assert_eq!(shown(&lock, &k).await, Some(label.clone()), "adopted");

        // Another TTL moves the lock to a new lease; the label follows.
        let mine = held(&k, owner, &again);
        let ExtendReply::Extended(moved) =
            lock.extend(mine, Duration::from_secs(20)).await.unwrap()
        else {
            panic!("the holder's extend was refused");
        };
        let before = on;
        let on = lease_of(&mut raw, &lock_at).await.expect("the lock");
        assert_ne!(on, before, "the extend moved the lock to another lease");
        assert_eq!(lease_of(&mut raw, &label_at).await, Some(on), "extended");
        assert_eq!(shown(&lock, &k).await, Some(label.clone()), "extended");

        let released = lock.release(held(&k, owner, &moved)).await.unwrap();
        assert_eq!(released, ReleaseReply::Released);
        assert_eq!(lease_of(&mut raw, &label_at).await, None, "released");
    }

    take(&lock, &k, OwnerToken::random(), true, Some(&label)).await;
    assert!(lock.force_release(&k).await.unwrap());
    assert_eq!(lease_of(&mut raw, &label_at).await, None, "force-released");
}

/// Waits for `watch` to fire; panics (naming `what`) if it does not
/// within [`NOTICE_WITHIN`].
async fn told(watch: &mut ReleaseWatch, what: &str) {
    tokio::time::timeout(NOTICE_WITHIN, watch.released())
        .await
        .unwrap_or_else(|_| panic!("the observer was not told of {what}"))
        .expect("the watch stream stayed up");
}

fn admin(client: &LockClient) -> &dyn LockAdmin {
    client.admin().expect("etcd has the operator calls")
}

/// An observer is told of a take, a release, a force release and an
/// expiry (the lease running out, which only etcd sees); several
/// observers of one key on one client share one etcd watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_is_told_of_every_change_of_holder() {
    let server = own_server();
    let watchers = || server::etcd_metric(server.port(), "etcd_debugging_mvcc_watcher_total");
    let holder = connect(&server.url()).await;
    let observer = connect(&server.url()).await;
    let k = unique_key("observed");
    let mut watch = admin(&observer)
        .watch_holder(&k)
        .await
        .expect("watch_holder")
        .expect("etcd watches");
    let one = watchers().expect("metrics");
    let mut more = Vec::new();
    for _ in 0..3 {
        more.push(admin(&observer).watch_holder(&k).await.unwrap().unwrap());
    }
    assert_eq!(
        watchers().unwrap(),
        one,
        "one etcd watch per key and client"
    );

    let lease = acquire(&holder, &k, Duration::from_secs(30)).await;
    told(&mut watch, "the take").await;
    for other in &mut more {
        told(other, "the take (another observer)").await;
    }
    assert!(matches!(
        observer.inspect(&k).await.unwrap(),
        LockState::Held { .. }
    ));
    drop(more);

    holder.release(&lease).await.unwrap();
    told(&mut watch, "the release").await;
    assert_eq!(observer.inspect(&k).await.unwrap(), LockState::Free);

    acquire(&holder, &k, Duration::from_secs(30)).await;
    told(&mut watch, "the second take").await;
    assert!(observer.force_release(&k).await.unwrap());
    told(&mut watch, "the force release").await;
    assert_eq!(observer.inspect(&k).await.unwrap(), LockState::Free);

    // Not renewed: etcd expires the lease and deletes the key.
    let expiring = acquire(&holder, &k, Duration::from_secs(2)).await;
    told(&mut watch, "the take before the expiry").await;
    told(&mut watch, "the expiry").await;
    assert_eq!(observer.inspect(&k).await.unwrap(), LockState::Free);
    drop(expiring);
}

/// An observer subscribed while a waiter waits is in no waiter queue and
/// takes no wake-up: on the holder's release the waiter still gets the
/// lock (woken by the server, before its deadline), whether the observer
/// is on another client or on the waiter's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_takes_no_waiters_place_or_wake_up() {
    let server = any_server();
    let ns = unique_name("holder-wait");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let k = unique_key("waited");
    let queue = format!("{}/waiters/", lock_key(&ns, &k));
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;

    let (attempts, waiter) = observed(&url).await;
    let waiting = Waiting::start(&attempts, &waiter, &k).await;
    let elsewhere = connect(&url).await;
    let mut watches = Vec::new();
    for client in [&waiter, &elsewhere] {
        watches.push(admin(client).watch_holder(&k).await.unwrap().unwrap());
    }
    assert_eq!(
        keys_under(&mut raw, &queue).await.len(),
        1,
        "only the waiter is queued"
    );

    holder.release(&held).await.unwrap();
    let lease = waiting.acquired().await;
    for watch in &mut watches {
        // The release, and the waiter's take after it (one notice or two).
        told(watch, "the release the waiter was woken by").await;
    }
    assert!(lease.fencing_token() > held.fencing_token());
    assert!(matches!(
        elsewhere.inspect(&k).await.unwrap(),
        LockState::Held { .. }
    ));
    waiter.release(&lease).await.unwrap();
}

/// Takes a permit of `key` (limit 2) for `owner` with `holder`, on the
/// session lease if `renewing`.
async fn take_permit(
    lock: &EtcdLock,
    key: &LockKey,
    owner: OwnerToken,
    renewing: bool,
    holder: Option<&HolderId>,
) -> Grant {
    let request = distlock_core::PermitRequest {
        key,
        owner,
        ttl: Duration::from_secs(30),
        limit: 2,
        renewing,
        settling: false,
        holder,
    };
    match distlock_core::SemaphoreBackend::acquire_permit(lock, request)
        .await
        .expect("acquire a permit")
    {
        distlock_core::PermitReply::Granted(grant) => grant,
        other => panic!("{key} has room, yet: {other:?}"),
    }
}

/// The labels `inspect_permits` shows, oldest first.
async fn permit_labels(lock: &EtcdLock, key: &LockKey) -> Vec<Option<HolderId>> {
    let permits = lock.inspect_permits(key).await.expect("inspect_permits");
    permits.into_iter().map(|p| p.holder).collect()
}

/// A permit's label is the sibling key `NS/lock/%sem/<key>/holders/<owner
/// hex>` on the permit's lease: put there by the take (own lease or
/// session lease), moved with the permit by an extend to another lease,
/// deleted by a release; a permit without a label writes none, and
/// whatever else is at its label key is not shown and breaks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permits_label_goes_with_its_lease() {
    use distlock_core::SemaphoreBackend;
    let (lock, ns, mut raw, _server) = setup("permit-holder").await;
    let k = unique_key("permit-lease");
    let base = format!("{ns}/lock/%sem/{}", k.as_str());
    let label_of = |owner: OwnerToken| format!("{base}/holders/{}", owner.to_hex());
    let permits = format!("{base}/permits/");

    for renewing in [false, true] {
        let owner = OwnerToken::random();
        let grant = take_permit(&lock, &k, owner, renewing, Some(&id("p"))).await;
        assert_eq!(permit_labels(&lock, &k).await, vec![Some(id("p"))]);
        // The permit's name is its client's, not its owner's.
        let [permit] = &keys_under(&mut raw, &permits).await[..] else {
            panic!("one permit");
        };
        let permit_lease = lease_of(&mut raw, permit).await;
        assert!(permit_lease.is_some());
        assert_eq!(lease_of(&mut raw, &label_of(owner)).await, permit_lease);
        // An extend with another TTL moves both to a new lease.
        let ExtendReply::Extended(moved) = lock
            .extend_permit(held(&k, owner, &grant), Duration::from_secs(40))
            .await
            .unwrap()
        else {
            panic!("the permit is held");
        };
        let permit_lease = lease_of(&mut raw, permit).await;
        assert_eq!(lease_of(&mut raw, &label_of(owner)).await, permit_lease);
        let released = lock.release_permit(held(&k, owner, &moved)).await.unwrap();
        assert_eq!(released, ReleaseReply::Released);
        assert_eq!(lease_of(&mut raw, &label_of(owner)).await, None, "released");
    }

    // Without a label: none written; garbage at its label key not shown.
    let owner = OwnerToken::random();
    let grant = take_permit(&lock, &k, owner, false, None).await;
    assert_eq!(lease_of(&mut raw, &label_of(owner)).await, None);
    let garbage: Vec<Vec<u8>> = vec![
        b"hello".to_vec(),
        vec![0xff, 0xfe],
        format!("dl1:{}/someone", OwnerToken::random().to_hex()).into_bytes(),
        format!("dl1:{}/two\nlines", owner.to_hex()).into_bytes(),
    ];
    for value in garbage {
        leave(&mut raw, &label_of(owner), value.clone()).await;
        assert_eq!(permit_labels(&lock, &k).await, vec![None], "{value:?}");
    }
    let released = lock.release_permit(held(&k, owner, &grant)).await.unwrap();
    assert_eq!(released, ReleaseReply::Released);
    assert!(keys_under(&mut raw, &permits).await.is_empty());
}
