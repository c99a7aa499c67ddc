//! The holder's marker (`src/marker.rs`): a waiter that takes the lock
//! leaves its queue entry in the line, on the lock's lease, and its
//! successor waits for that entry's deletion. A marker that outlived its
//! lock would stall the line for as long as its lease lives, so every
//! way a lock ends or moves is tried here: force release, an extend to a
//! new lease, a lock deleted under its renewing holder, the session's
//! undo of a lock nobody renews, and markers left by something else
//! (with or without a lock).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    acquire, any_server, connect, keys_under, observed, proxy_for, raw_client, release_resent,
    through, unique_key, Waiting,
};
use distlock_conformance::naming::unique_name;
use distlock_conformance::server::ServerHandle;
use distlock_conformance::ObservedLock;
use distlock_core::{
    AcquireReply, AcquireRequest, ExtendReply, Grant, HeldLock, Lease, LockBackend, LockClient,
    LockKey, OwnerToken,
};
use distlock_etcd::EtcdLock;
use etcd_client::{Client, GetOptions, PutOptions};

/// A namespace of its own on a shared etcd (kept running while the handle
/// lives): its URL, a raw client, and the line prefix of `key` there.
async fn scene(name: &str, key: &LockKey) -> (ServerHandle, String, Client, String) {
    let server = any_server();
    let ns = unique_name(name);
    let url = format!("{}?namespace={ns}", server.url());
    let raw = raw_client(&server.url()).await;
    let line = format!("{ns}/lock/{}/waiters/", key.as_str());
    (server, url, raw, line)
}

/// The markers in the line `line`: entries put again (version above 1),
/// with their leases.
async fn markers(raw: &mut Client, line: &str) -> Vec<(String, i64)> {
    raw.get(line, Some(GetOptions::new().with_prefix()))
        .await
        .expect("read the line")
        .kvs()
        .iter()
        .filter(|kv| kv.version() > 1)
        .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.lease()))
        .collect()
}

/// The one marker in the line `line`.
async fn the_marker(raw: &mut Client, line: &str) -> String {
    let found = markers(raw, line).await;
    assert_eq!(
        found.len(),
        1,
        "the holder's entry is its marker: {found:?}"
    );
    found[0].0.clone()
}

/// Polls `markers` until `marker` is gone, for at most `bound` (the
/// waiter behind it may have taken the lock by then, with a marker of its
/// own).
async fn until_gone(raw: &mut Client, line: &str, marker: &str, bound: Duration, why: &str) {
    let give_up = Instant::now() + bound;
    loop {
        let left = markers(raw, line).await;
        if left.iter().all(|(name, _)| name != marker) {
            return;
        }
        assert!(Instant::now() < give_up, "{why}: markers left {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The lock key of the line `line`.
fn lock_of(line: &str) -> String {
    line.trim_end_matches("/waiters/").to_string()
}

/// The lease of the lock of the line `line`, if it is held.
async fn lock_lease(raw: &mut Client, line: &str) -> Option<i64> {
    raw.get(lock_of(line), None)
        .await
        .expect("read the lock")
        .kvs()
        .first()
        .map(|kv| kv.lease())
}

/// `holder` takes `key` as a waiter (so its entry becomes the lock's
/// marker): another client holds it first, `holder` waits, the other
/// releases. Returns the holder's lease, client and the count of its
/// attempts.
async fn taken_in_line(url: &str, key: &LockKey) -> (Lease, LockClient, Arc<ObservedLock>) {
    let first = connect(url).await;
    let held = acquire(&first, key, Duration::from_secs(30)).await;
    let (attempts, holder) = observed(url).await;
    let waiting = Waiting::start(&attempts, &holder, key).await;
    first.release(&held).await.expect("release");
    (waiting.acquired().await, holder, attempts)
}

/// A renewing lock of `ttl` on `key` (on the holder's session lease)
/// taken in line through the raw backend, which renews nothing by itself:
/// another client holds `key` first, the holder queues, the other
/// releases. Returns the holder, its owner token and the grant.
async fn renewing_in_line(
    url: &str,
    key: &LockKey,
    ttl: Duration,
) -> (EtcdLock, OwnerToken, Grant) {
    let holder = EtcdLock::connect(url).await.expect("connect");
    let other = connect(url).await;
    let held = acquire(&other, key, Duration::from_secs(30)).await;
    let owner = OwnerToken::random();
    let request = AcquireRequest {
        key,
        owner,
        ttl,
        renewing: true,
        settling: false,
        holder: None,
    };
    let watch = holder
        .watch(key, owner)
        .await
        .expect("watch")
        .expect("etcd queues waiters");
    other.release(&held).await.expect("release");
    let granted = loop {
        match holder.acquire(request).await.expect("acquire") {
            AcquireReply::Granted(grant) => break grant,
            AcquireReply::Held { .. } => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    drop(watch);
    (holder, owner, granted)
}

/// A marker in `line` on `lease`, as a client that took the lock in line
/// leaves it (an entry put twice), put by hand; its key.
async fn put_marker(raw: &mut Client, line: &str, lease: i64) -> String {
    let marker = format!("{line}{lease:x}-0");
    for _ in 0..2 {
        raw.put(
            marker.as_str(),
            "dl1-waiter",
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .expect("put the marker");
    }
    marker
}

/// A second waiter behind the holder's marker.
async fn behind(url: &str, key: &LockKey) -> (Arc<ObservedLock>, Waiting) {
    let (attempts, client) = observed(url).await;
    let waiting = Waiting::start(&attempts, &client, key).await;
    (attempts, waiting)
}

/// A force release takes the holder's marker with the lock (it is found
/// in the line by the lock's lease), so the waiter behind it is woken.
/// Without it, the marker lives on the holder's 30 s lease and the
/// waiter's 20 s wait ends first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_deletes_the_holders_marker() {
    let key = unique_key("forced");
    let (_server, url, mut raw, line) = scene("marker-forced", &key).await;
    let (_lease, holder, _) = taken_in_line(&url, &key).await;
    let (_, next) = behind(&url, &key).await;
    let marker = the_marker(&mut raw, &line).await;
    assert!(holder.force_release(&key).await.expect("force release"));
    // Gone at once: no wait.
    until_gone(
        &mut raw,
        &line,
        &marker,
        Duration::ZERO,
        "the force release left the holder's marker",
    )
    .await;
    let lease = next.acquired().await;
    connect(&url).await.release(&lease).await.ok();
}

/// An extend that moves the lock to a new lease moves its marker with it:
/// left on the old lease (revoked after the move), it would be deleted
/// while the lock is still held, waking the waiter behind it for nothing;
/// the waiter still takes the lock when it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extend_moves_the_holders_marker_with_the_lock() {
    let key = unique_key("moved");
    let (_server, url, mut raw, line) = scene("marker-moved", &key).await;
    let (lease, holder, _) = taken_in_line(&url, &key).await;
    let (attempts, next) = behind(&url, &key).await;
    let tried = attempts.attempts_in_line();
    let before = lock_lease(&mut raw, &line).await.expect("held");
    let extended = holder
        .extend(&lease, Duration::from_secs(40))
        .await
        .expect("extend");
    let after = lock_lease(&mut raw, &line).await.expect("held");
    assert_ne!(
        before, after,
        "the extend did not move the lock to a new lease"
    );
    let found = markers(&mut raw, &line).await;
    assert_eq!(
        found.iter().map(|(_, lease)| *lease).collect::<Vec<_>>(),
        vec![after],
        "the marker is not on the lock's new lease"
    );
    // The old lease's revoke took nothing the waiter waits for.
    assert_eq!(
        attempts.attempts_in_line(),
        tried,
        "the waiter was woken while the lock was held"
    );
    holder.release(&extended).await.expect("release");
    let lease = next.acquired().await;
    holder.release(&lease).await.ok();
}

/// A lock deleted under its renewing holder by a client that knows no
/// markers (here a raw delete, as an older distlock's force release does)
/// leaves the marker on the holder's session lease; the holder's next
/// renewal (alone, or in a batch as guards renew) finds the lock gone and
/// deletes it, and the waiter behind gets the lock. Without that, the
/// marker would live as long as the holder's client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_finds_the_lock_gone_deletes_its_marker() {
    for batched in [false, true] {
        let key = unique_key("lost");
        let (_server, url, mut raw, line) = scene("marker-lost", &key).await;
        let (holder, owner, granted) = renewing_in_line(&url, &key, Duration::from_secs(30)).await;
        let other = connect(&url).await;
        let (_, next) = behind(&url, &key).await;
        let marker = the_marker(&mut raw, &line).await;
        raw.delete(lock_of(&line), None).await.expect("raw delete");
        let held = HeldLock {
            key: &key,
            owner,
            fencing: granted.fencing,
            handle: granted.handle,
        };
        let ttl = Duration::from_secs(30);
        let renewed = match batched {
            false => holder.extend(held, ttl).await.expect("renew"),
            true => {
                let mut replies = holder.extend_many(&[held], ttl).await.expect("renew");
                replies.pop().expect("one reply").expect("renew")
            }
        };
        assert!(matches!(renewed, ExtendReply::NotHeld), "{renewed:?}");
        until_gone(
            &mut raw,
            &line,
            &marker,
            Duration::from_secs(10),
            &format!("a renewal (batched: {batched}) that found the lock gone"),
        )
        .await;
        let lease = next.acquired().await;
        other.release(&lease).await.ok();
    }
}

/// A renewing lock nobody renews is undone by the session a TTL later,
/// and its marker with it (a session lease outlives the lock: it is the
/// client's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_undo_deletes_the_marker() {
    let key = unique_key("undone");
    let (_server, url, mut raw, line) = scene("marker-undone", &key).await;
    let (holder, _, _) = renewing_in_line(&url, &key, Duration::from_secs(2)).await;
    let marker = the_marker(&mut raw, &line).await;
    // Never renewed: the session undoes it after its 2 s TTL.
    until_gone(
        &mut raw,
        &line,
        &marker,
        Duration::from_secs(15),
        "the session's undo of a lock nobody renewed",
    )
    .await;
    assert_eq!(
        lock_lease(&mut raw, &line).await,
        None,
        "the lock was not undone"
    );
    drop(holder);
}

/// A marker without its lock (left by something that knows no markers,
/// here put by hand) does not stall the line: the waiter behind it is
/// first, finds the lock free and takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_without_its_lock_is_passed() {
    let key = unique_key("stray");
    let (_server, url, mut raw, line) = scene("marker-stray", &key).await;
    let lease = raw.lease_grant(60, None).await.expect("lease").id();
    put_marker(&mut raw, &line, lease).await;
    let client = connect(&url).await;
    let lease = client
        .acquire(
            &key,
            Duration::from_secs(30),
            Instant::now() + Duration::from_secs(20),
        )
        .await
        .expect("acquire")
        .expect("a waiter behind a marker without its lock took the free lock");
    client.release(&lease).await.expect("release");
}

/// A marker deleted while its lock stays (by something that knows no
/// markers, here by hand): the waiter behind it, woken, is refused, looks
/// its place up again, watches the lock key and takes the lock when that
/// goes. Without the look-up it would wait for a watch that never fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_refused_after_its_markers_end_looks_again() {
    let key = unique_key("refused");
    let (_server, url, mut raw, line) = scene("marker-refused", &key).await;
    let lock = lock_of(&line);
    let lease = raw.lease_grant(60, None).await.expect("lease").id();
    // A lock and its marker, as a client that took it in line leaves them.
    let value = format!("dl1:{}", OwnerToken::random().to_hex());
    raw.put(
        lock.as_str(),
        value,
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .expect("put the lock");
    let marker = put_marker(&mut raw, &line, lease).await;
    let (attempts, waiter) = behind(&url, &key).await;
    let tried = attempts.attempts_in_line();
    raw.delete(marker.as_str(), None)
        .await
        .expect("delete the marker");
    // Woken for the marker's end, and refused: the lock is still there.
    let give_up = Instant::now() + Duration::from_secs(10);
    while attempts.attempts_in_line() == tried {
        assert!(
            Instant::now() < give_up,
            "the marker's deletion did not wake the waiter behind it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    raw.delete(lock.as_str(), None)
        .await
        .expect("delete the lock");
    let lease = waiter.acquired().await;
    connect(&url).await.release(&lease).await.ok();
}

/// A release whose first send went unanswered and was sent again may have
/// that first send applied later, which would delete a marker of the same
/// name: the client then never reuses the marker's name (its number is
/// retired). Here the release's reply is held past its first send's share
/// of the operation timeout; the client's next wait on the key takes
/// another name. (A release answered at once gives the name back: see
/// `a_markers_name_is_reused_only_once_its_lock_is_released`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_release_retires_its_markers_name() {
    let key = unique_key("resent");
    let (server, _url, mut raw, line) = scene("marker-resent", &key).await;
    let proxy = proxy_for(&server).await;
    let ns = line.split('/').next().expect("namespace").to_string();
    // Each send gets a third of the 6 s: a reply held 2.5 s misses the
    // first send's share and still arrives within the operation.
    let url = format!(
        "{}&namespace={ns}",
        through(&proxy, "operation_timeout_ms=6000")
    );
    let (lease, holder, attempts) = taken_in_line(&url, &key).await;
    let marker = the_marker(&mut raw, &line).await;
    release_resent(&proxy, &holder, lease)
        .await
        .expect("a release whose first send was applied unanswered");
    assert!(
        markers(&mut raw, &line).await.is_empty(),
        "the marker outlived its release"
    );
    // The holder's client waits on the key again: its entry takes a new
    // name.
    let other = connect(&url).await;
    let held = acquire(&other, &key, Duration::from_secs(30)).await;
    let waiting = Waiting::start(&attempts, &holder, &key).await;
    let names = keys_under(&mut raw, &line).await;
    assert_eq!(names.len(), 1, "the second wait's entry alone: {names:?}");
    assert_ne!(
        names[0], marker,
        "the name of a marker deleted by a resent release was reused"
    );
    other.release(&held).await.expect("release");
    let lease = waiting.acquired().await;
    holder.release(&lease).await.ok();
}
