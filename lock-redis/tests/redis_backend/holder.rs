//! The holder label beside a lock (`NS:{K}:holder`, `<owner hex>:<label>`):
//! stored with the lock's expiry, renewed and deleted with it, shown only
//! for the owner that holds the lock now; data distlock did not write
//! there stops no lock operation and is left alone.

use std::time::Duration;

use distlock_conformance::server;
use distlock_core::{
    AcquireReply, AcquireRequest, ExtendReply, HeldLock, HolderId, LockAdmin, LockBackend, LockKey,
    LockState, OwnerToken, ReleaseReply,
};
use distlock_redis::redis::{aio::MultiplexedConnection, AsyncCommands};
use distlock_redis::RedisLock;

use crate::support::*;

/// The label key of `key` in the default namespace.
fn holder_key_of(key: &LockKey) -> String {
    format!("distlock:{{{}}}:holder", key.as_str())
}

/// Takes `key` for `owner` with `label`, expecting it free.
async fn take<'a>(
    lock: &RedisLock,
    key: &'a LockKey,
    owner: OwnerToken,
    ttl: Duration,
    label: Option<&HolderId>,
) -> HeldLock<'a> {
    let reply = lock
        .acquire(AcquireRequest {
            key,
            owner,
            ttl,
            renewing: false,
            settling: false,
            holder: label,
        })
        .await
        .unwrap();
    let AcquireReply::Granted(grant) = reply else {
        panic!("expected {key} to be free, got {reply:?}");
    };
    HeldLock {
        key,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    }
}

/// The label `inspect` shows for `key`, which must be held.
async fn shown(lock: &RedisLock, key: &LockKey) -> Option<HolderId> {
    match lock.inspect(key).await.unwrap() {
        LockState::Held { holder, .. } => holder,
        LockState::Free => panic!("{key} is free"),
    }
}

/// A label is stored beside the lock, renewed with it and deleted with
/// it; one left by another owner (an older client deletes only the lock
/// key; a holder without a label never writes there) is never shown.
#[tokio::test]
async fn a_label_left_by_another_owner_is_never_shown() {
    let server = start(server::Redis::default());
    let lock = RedisLock::connect(&server.url()).await.unwrap();
    let mut conn = raw(&server.url()).await;
    let key = unique_key("holder");
    let name = holder_key_of(&key);
    let a = HolderId::new("worker-a:1").unwrap();
    let short = Duration::from_secs(5);

    let held = take(&lock, &key, OwnerToken::random(), short, Some(&a)).await;
    assert_eq!(shown(&lock, &key).await, Some(a.clone()));
    let stored: String = conn.get(&name).await.unwrap();
    assert_eq!(stored, format!("{}:{a}", held.owner.to_hex()));
    // Renewed with the lock, never outliving a lock that is not renewed.
    assert!(matches!(
        lock.extend(held, Duration::from_secs(60)).await.unwrap(),
        ExtendReply::Extended(_)
    ));
    let pttl: i64 = conn.pttl(&name).await.unwrap();
    assert!(pttl > 5_000, "the label's PTTL after an extension: {pttl}");
    // Deleted with the lock.
    assert_eq!(lock.release(held).await.unwrap(), ReleaseReply::Released);
    assert!(!conn.exists::<_, bool>(&name).await.unwrap());

    // a's label outlives its lock (deleted the way an older client's
    // force-release does: the lock key alone); b takes it without a label.
    let held = take(&lock, &key, OwnerToken::random(), short, Some(&a)).await;
    let _: () = conn.del(lock_key_of(&key)).await.unwrap();
    let b = take(&lock, &key, OwnerToken::random(), short, None).await;
    assert_eq!(shown(&lock, &key).await, None, "a's label shown for b");
    assert_ne!(held.owner, b.owner);
    // b wrote nothing there: a's stale label is still there, harmless.
    let stored: String = conn.get(&name).await.unwrap();
    assert!(stored.starts_with(&held.owner.to_hex()), "{stored}");
    // A force-release deletes the stale label too.
    assert!(lock.force_release(&key).await.unwrap());
    assert!(!conn.exists::<_, bool>(&name).await.unwrap());

    // A batched renewal renews each lock's own label (keys in threes).
    let keys = [unique_key("holder-batch"), unique_key("holder-batch")];
    let mut held = Vec::new();
    for key in &keys {
        held.push(take(&lock, key, OwnerToken::random(), short, Some(&a)).await);
    }
    let replies = lock
        .extend_many(&held, Duration::from_secs(60))
        .await
        .unwrap();
    for (key, reply) in keys.iter().zip(replies) {
        assert!(matches!(reply, Ok(ExtendReply::Extended(_))), "{reply:?}");
        let pttl: i64 = conn.pttl(holder_key_of(key)).await.unwrap();
        assert!(
            pttl > 5_000,
            "{key}'s label PTTL after a batched renewal: {pttl}"
        );
        assert_eq!(shown(&lock, key).await, Some(a.clone()));
    }
}

/// What distlock does not write, at the label key.
const GARBAGE: &[&str] = &["string", "hash", "zset", "no-expiry", "control", "too-long"];

/// Writes `variant` at `name`, in distlock's format for `owner` where the
/// variant is a near miss (no expiry, a control character, too long).
async fn plant(conn: &mut MultiplexedConnection, name: &str, variant: &str, owner: OwnerToken) {
    let owner = owner.to_hex();
    let _: () = match variant {
        "string" => conn.set(name, "someone else's").await.unwrap(),
        "hash" => conn.hset(name, "f", "v").await.unwrap(),
        "zset" => conn.zadd(name, "a", 1).await.unwrap(),
        "no-expiry" => conn.set(name, format!("{owner}:label")).await.unwrap(),
        "control" => conn.set(name, format!("{owner}:a\u{7}b")).await.unwrap(),
        "too-long" => conn
            .set(name, format!("{owner}:{}", "x".repeat(129)))
            .await
            .unwrap(),
        other => unreachable!("{other}"),
    };
    if variant != "no-expiry" {
        let _: () = conn.pexpire(name, 60_000).await.unwrap();
    }
}

/// Garbage at the label key (even a near miss in the current owner's
/// name): acquire with a label, inspect, extend, release and force-release
/// all work, no label is shown, the garbage is left as it was, and the
/// acquisition warns that its label was not stored.
#[tokio::test(flavor = "current_thread")]
async fn garbage_at_the_label_key_stops_nothing_and_is_left_alone() {
    let server = start(server::Redis::default());
    let lock = RedisLock::connect(&server.url()).await.unwrap();
    let mut conn = raw(&server.url()).await;
    let label = HolderId::new("worker-g:7").unwrap();
    let ttl = Duration::from_secs(30);
    let warnings = Warnings::capture();
    for variant in GARBAGE {
        let key = unique_key("holder-garbage");
        let name = holder_key_of(&key);
        let owner = OwnerToken::random();
        plant(&mut conn, &name, variant, owner).await;
        let before = snapshot(&mut conn, &name).await;

        let held = take(&lock, &key, owner, ttl, Some(&label)).await;
        assert_eq!(shown(&lock, &key).await, None, "{variant}");
        assert!(warnings.named(&name), "{variant}: no warning naming {name}");
        assert!(
            matches!(
                lock.extend(held, ttl).await.unwrap(),
                ExtendReply::Extended(_)
            ),
            "{variant}"
        );
        assert_eq!(
            lock.release(held).await.unwrap(),
            ReleaseReply::Released,
            "{variant}"
        );
        take(&lock, &key, OwnerToken::random(), ttl, None).await;
        assert!(lock.force_release(&key).await.unwrap(), "{variant}");
        left_alone(&mut conn, &name, &before, variant).await;
        let _: () = conn.del(&name).await.unwrap();
    }
}

/// A lock taken without a label has no label of its own: its extend and
/// release leave the label key unread (one command less each), while a
/// labelled lock's extend and release still move and delete its label.
#[tokio::test]
async fn an_unlabelled_lock_leaves_the_label_key_unread() {
    let server = start(server::Redis::default());
    let lock = RedisLock::connect(&server.url()).await.unwrap();
    let ttl = Duration::from_secs(30);
    let label = HolderId::new("worker-a:1").unwrap();
    let mut monitor = Monitor::start(&server.url()).await;
    for labelled in [false, true] {
        let key = unique_key("holder-unread");
        let name = holder_key_of(&key);
        let held = take(
            &lock,
            &key,
            OwnerToken::random(),
            ttl,
            labelled.then_some(&label),
        )
        .await;
        monitor.mark_scripted().await;
        assert!(matches!(
            lock.extend(held, ttl).await.unwrap(),
            ExtendReply::Extended(_)
        ));
        let extend = monitor.mark_scripted().await;
        assert_eq!(lock.release(held).await.unwrap(), ReleaseReply::Released);
        let release = monitor.mark_scripted().await;
        for (what, commands) in [("extend", &extend), ("release", &release)] {
            let touched = commands.iter().any(|(_, arg)| *arg == name);
            assert_eq!(
                touched, labelled,
                "labelled {labelled}: {what} ran {commands:?}"
            );
        }
    }
}
