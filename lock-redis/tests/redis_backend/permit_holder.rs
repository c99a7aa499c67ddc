//! The permits' holder labels (`NS:{K}:sem:holder`, a hash of
//! `<owner hex>:<token>` to label): written only for a labelled permit,
//! kept at least as long as the permit set, deleted with the permit
//! (released or swept), shown only for that permit; data distlock did not
//! write there stops no permit operation and is left alone.

use std::time::Duration;

use distlock_conformance::server;
use distlock_core::{
    ExtendReply, HeldLock, HolderId, LockAdmin, LockKey, OwnerToken, PermitReply, PermitRequest,
    ReleaseReply, SemaphoreBackend,
};
use distlock_redis::redis::{aio::MultiplexedConnection, AsyncCommands};
use distlock_redis::RedisLock;

use crate::support::*;

const LIMIT: u32 = 3;

/// The permit set and label hash of semaphore `key` in the default
/// namespace.
fn names_of(key: &LockKey) -> (String, String) {
    (
        format!("distlock:{{{}}}:sem:permits", key.as_str()),
        format!("distlock:{{{}}}:sem:holder", key.as_str()),
    )
}

/// Takes a permit of `key` for `owner` with `label`, expecting room.
async fn take<'a>(
    lock: &RedisLock,
    key: &'a LockKey,
    owner: OwnerToken,
    ttl: Duration,
    label: Option<&HolderId>,
) -> HeldLock<'a> {
    let reply = lock
        .acquire_permit(PermitRequest {
            key,
            owner,
            ttl,
            limit: LIMIT,
            renewing: false,
            settling: false,
            holder: label,
        })
        .await
        .unwrap();
    let PermitReply::Granted(grant) = reply else {
        panic!("expected a permit of {key}, got {reply:?}");
    };
    HeldLock {
        key,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    }
}

/// The labels `inspect_permits` shows, oldest first.
async fn shown(lock: &RedisLock, key: &LockKey) -> Vec<Option<HolderId>> {
    let permits = lock.inspect_permits(key).await.unwrap();
    permits.into_iter().map(|p| p.holder).collect()
}

/// Extends `held` by `ttl`, then releases it, both of which must work.
async fn extend_and_release(lock: &RedisLock, held: HeldLock<'_>, ttl: Duration, what: &str) {
    assert!(
        matches!(
            lock.extend_permit(held, ttl).await.unwrap(),
            ExtendReply::Extended(_)
        ),
        "{what}: extend"
    );
    assert_eq!(
        lock.release_permit(held).await.unwrap(),
        ReleaseReply::Released,
        "{what}: release"
    );
}

fn field(permit: &HeldLock<'_>) -> String {
    format!("{}:{}", permit.owner.to_hex(), permit.fencing)
}

/// A label is stored under its permit's owner and token, kept as long as
/// the permit set (renewed with it), and deleted with the permit: on
/// release, and when an expired permit is swept. An unlabelled permit
/// writes nothing there.
#[tokio::test]
async fn labels_live_and_go_with_their_permits() {
    let server = start(server::Redis::default());
    let lock = RedisLock::connect(&server.url()).await.unwrap();
    let mut conn = raw(&server.url()).await;
    let key = unique_key("permit-holder");
    let (set, hash) = names_of(&key);
    let a = HolderId::new("worker-a:1").unwrap();
    let long = Duration::from_secs(60);

    let _plain = take(&lock, &key, OwnerToken::random(), long, None).await;
    assert!(!conn.exists::<_, bool>(&hash).await.unwrap(), "unlabelled");
    let held = take(
        &lock,
        &key,
        OwnerToken::random(),
        Duration::from_secs(5),
        Some(&a),
    )
    .await;
    let stored: String = conn.hget(&hash, field(&held)).await.unwrap();
    assert_eq!(stored, a.as_str());
    assert_eq!(shown(&lock, &key).await, vec![None, Some(a.clone())]);
    let (set_pttl, hash_pttl): (i64, i64) = (
        conn.pttl(&set).await.unwrap(),
        conn.pttl(&hash).await.unwrap(),
    );
    assert!(
        hash_pttl >= set_pttl - 50,
        "labels {hash_pttl} ms, set {set_pttl} ms"
    );
    // Renewed with the permit.
    assert!(matches!(
        lock.extend_permit(held, Duration::from_secs(120))
            .await
            .unwrap(),
        ExtendReply::Extended(_)
    ));
    let hash_pttl: i64 = conn.pttl(&hash).await.unwrap();
    assert!(
        hash_pttl > 60_000,
        "labels' PTTL after an extension: {hash_pttl}"
    );
    // Released: its label goes (the hash with it, as it was the last).
    assert_eq!(
        lock.release_permit(held).await.unwrap(),
        ReleaseReply::Released
    );
    assert!(!conn.exists::<_, bool>(&hash).await.unwrap());

    // Expired: swept with its label by the next write.
    let _short = take(
        &lock,
        &key,
        OwnerToken::random(),
        Duration::from_millis(200),
        Some(&a),
    )
    .await;
    let other = take(&lock, &key, OwnerToken::random(), long, Some(&a)).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let _next = take(&lock, &key, OwnerToken::random(), long, None).await;
    let fields: Vec<String> = conn.hkeys(&hash).await.unwrap();
    assert_eq!(
        fields,
        vec![field(&other)],
        "the expired permit's label stays"
    );
    assert_eq!(shown(&lock, &key).await, vec![None, Some(a.clone()), None]);
}

/// What distlock does not write, at the label key.
const GARBAGE: &[&str] = &["string", "zset", "list", "no-expiry"];

async fn plant(conn: &mut MultiplexedConnection, name: &str, variant: &str) {
    let _: () = match variant {
        "string" => conn.set(name, "someone else's").await.unwrap(),
        "zset" => conn.zadd(name, "a", 1).await.unwrap(),
        "list" => conn.rpush(name, "a").await.unwrap(),
        "no-expiry" => conn.hset(name, "f", "v").await.unwrap(),
        other => unreachable!("{other}"),
    };
    if variant != "no-expiry" {
        let _: () = conn.pexpire(name, 60_000).await.unwrap();
    }
}

/// Garbage at the label key: a labelled permit is granted, extended and
/// released, none is shown, the acquisition warns that its label was not
/// stored, and the garbage is left as it was. A value HolderId would
/// refuse in a permit's own field is not shown either.
#[tokio::test(flavor = "current_thread")]
async fn garbage_at_the_label_key_stops_no_permit_and_is_left_alone() {
    let server = start(server::Redis::default());
    let lock = RedisLock::connect(&server.url()).await.unwrap();
    let mut conn = raw(&server.url()).await;
    let label = HolderId::new("worker-g:7").unwrap();
    let ttl = Duration::from_secs(30);
    let warnings = Warnings::capture();
    for variant in GARBAGE {
        let key = unique_key("permit-holder-garbage");
        let (_, name) = names_of(&key);
        plant(&mut conn, &name, variant).await;
        let before = snapshot(&mut conn, &name).await;

        let held = take(&lock, &key, OwnerToken::random(), ttl, Some(&label)).await;
        assert_eq!(shown(&lock, &key).await, vec![None], "{variant}");
        assert!(warnings.named(&name), "{variant}: no warning naming {name}");
        extend_and_release(&lock, held, ttl, variant).await;
        left_alone(&mut conn, &name, &before, variant).await;
        let _: () = conn.del(&name).await.unwrap();
    }

    // A near miss in a live permit's own field: not shown, no panic.
    let key = unique_key("permit-holder-near-miss");
    let (_, name) = names_of(&key);
    let held = take(&lock, &key, OwnerToken::random(), ttl, Some(&label)).await;
    for bad in ["a\u{7}b".to_owned(), "x".repeat(129), String::new()] {
        let _: () = conn.hset(&name, field(&held), &bad).await.unwrap();
        assert_eq!(shown(&lock, &key).await, vec![None], "{bad:?}");
    }
    assert_eq!(
        lock.release_permit(held).await.unwrap(),
        ReleaseReply::Released
    );
}

/// The hash commands are optional for an ACL user: with exactly the
/// permissions the crate docs require, a labelled permit is granted,
/// extended and released (its label not stored, with a warning); with
/// `HGET`, `HSET` and `HDEL` added its label is stored and shown.
#[tokio::test(flavor = "current_thread")]
async fn permit_labels_need_the_hash_commands_and_nothing_else_does() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    let label = HolderId::new("worker-acl:1").unwrap();
    let ttl = Duration::from_secs(30);
    let warnings = Warnings::capture();
    let with_hashes: Vec<&str> = DOC_PERMISSIONS
        .iter()
        .copied()
        .chain(["+hget", "+hset", "+hdel"])
        .collect();
    for (user, rules, stored) in [
        ("nohash", DOC_PERMISSIONS, false),
        ("hash", with_hashes.as_slice(), true),
    ] {
        acl_user(&mut admin, user, rules).await;
        let url = format!("redis://{user}:pw@{}", server.addr());
        let lock = RedisLock::connect(&url).await.unwrap();
        let key = unique_key("permit-holder-acl");
        let held = take(&lock, &key, OwnerToken::random(), ttl, Some(&label)).await;
        let want = stored.then(|| label.clone());
        assert_eq!(shown(&lock, &key).await, vec![want], "{user}");
        let (_, name) = names_of(&key);
        assert_eq!(
            warnings.named(&name),
            !stored,
            "{user}: warned that the label was not stored"
        );
        extend_and_release(&lock, held, ttl, user).await;
        assert!(!admin.exists::<_, bool>(&name).await.unwrap(), "{user}");
    }
}
