//! Semaphores on the server: what a permit looks like there, a permit
//! request applied after its reply was lost (adopted by its owner's next
//! attempt, given back by a settling one), and data distlock did not write
//! at each of a semaphore's keys (reported, left alone).

use std::time::Duration;

use distlock_conformance::fault::Direction;
use distlock_conformance::server;
use distlock_core::{
    ErrorKind, Grant, HeldLock, LockError, LockKey, OwnerToken, PermitReply, PermitRequest,
    ReleaseReply, SemaphoreBackend,
};
use distlock_redis::redis::{self, aio::MultiplexedConnection, AsyncCommands};
use distlock_redis::RedisLock;

use crate::support::*;

/// The Redis name of `key`'s semaphore key `suffix` (`permits`, `fence`,
/// `gone`) in namespace `ns` (test keys need no escaping).
fn sem_key(ns: &str, key: &LockKey, suffix: &str) -> String {
    format!("{ns}:{{{}}}:sem:{suffix}", key.as_str())
}

fn request(key: &LockKey, owner: OwnerToken, ttl: Duration, settling: bool) -> PermitRequest<'_> {
    PermitRequest {
        key,
        owner,
        ttl,
        limit: 1,
        renewing: false,
        settling,
        holder: None,
    }
}

fn granted(reply: Result<PermitReply, LockError>, what: &str) -> Grant {
    match reply {
        Ok(PermitReply::Granted(grant)) => grant,
        other => panic!("{what}: expected a grant, got {other:?}"),
    }
}

fn held(key: &LockKey, owner: OwnerToken, grant: Grant) -> HeldLock<'_> {
    HeldLock {
        key,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    }
}

/// The permits at `name`: (member, score).
async fn permits(conn: &mut MultiplexedConnection, name: &str) -> Vec<(String, u64)> {
    conn.zrange_withscores(name, 0, -1).await.unwrap()
}

/// A permit request whose reply is held past the operation timeout took a
/// permit on the server (the last of a semaphore of one); the same owner's
/// next attempt gets it back (its fencing token, its score reset from now),
/// another owner is refused, and a settling attempt of the same owner
/// adopts it too and its give-back leaves the semaphore empty.
#[tokio::test]
async fn a_timed_out_permit_request_applied_late_is_adopted_then_given_back() {
    let server = start(server::Redis::default());
    let (proxy, lock) = behind_proxy(&server).await;
    let mut conn = raw(&server.url()).await;
    let key = unique_key("permit-adopt");
    let set = sem_key("distlock", &key, "permits");
    let owner = OwnerToken::random();

    proxy.hold(Direction::ToClient);
    let err = lock
        .acquire_permit(request(&key, owner, Duration::from_secs(10), false))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    // It reached the server and took the permit.
    let taken = eventually("the permit is written", || {
        let mut conn = conn.clone();
        let set = set.clone();
        async move { permits(&mut conn, &set).await.into_iter().next() }
    })
    .await;
    proxy.pass(Direction::ToClient);
    let (member, first_score) = taken;
    let parts: Vec<&str> = member.split(':').collect();
    assert_eq!(parts.len(), 4, "{member}");
    assert_eq!(parts[0], "dl1");
    assert_eq!(parts[1], owner.to_hex());
    assert_eq!(parts[3], "1", "the limit is stored in the permit");
    let token: u64 = parts[2].parse().unwrap();
    let fence: String = conn.get(sem_key("distlock", &key, "fence")).await.unwrap();
    assert_eq!(fence, parts[2], "the semaphore's own fencing counter");
    let lock_pttl: i64 = conn.pttl(lock_key_of(&key)).await.unwrap();
    assert_eq!(lock_pttl, -2, "the lock of the same name is untouched");

    let again = granted(
        lock.acquire_permit(request(&key, owner, Duration::from_secs(60), false))
            .await,
        "the same owner's next attempt",
    );
    assert_eq!(again.fencing.get(), token, "the permit's own fencing token");
    let after = permits(&mut conn, &set).await;
    assert_eq!(after.len(), 1, "never a second permit: {after:?}");
    assert_eq!(
        after[0].0, member,
        "adoption rewrites nothing but the score"
    );
    assert!(
        after[0].1 > first_score,
        "the score (expiry) was reset from now: {} then {}",
        first_score,
        after[0].1
    );
    let set_pttl: i64 = conn.pttl(&set).await.unwrap();
    assert!(set_pttl > 10_000, "the set outlives its permit: {set_pttl}");

    let other = lock
        .acquire_permit(request(
            &key,
            OwnerToken::random(),
            Duration::from_secs(5),
            false,
        ))
        .await
        .unwrap();
    assert!(
        matches!(
            other,
            PermitReply::Full {
                expires_in: Some(_)
            }
        ),
        "{other:?}"
    );

    // The client's undo once an outcome was unknown: a settling attempt of
    // the same owner (adopting), then its release.
    let settled = granted(
        lock.acquire_permit(request(&key, owner, Duration::from_secs(60), true))
            .await,
        "the settling attempt",
    );
    assert_eq!(settled.fencing.get(), token);
    assert_eq!(
        lock.release_permit(held(&key, owner, settled))
            .await
            .unwrap(),
        ReleaseReply::Released
    );
    assert!(permits(&mut conn, &set).await.is_empty());
    assert_eq!(
        lock.release_permit(held(&key, owner, settled))
            .await
            .unwrap(),
        ReleaseReply::NotHeld,
        "a second release call"
    );
    let next = granted(
        lock.acquire_permit(request(
            &key,
            OwnerToken::random(),
            Duration::from_secs(5),
            false,
        ))
        .await,
        "another owner once it was given back",
    );
    assert!(next.fencing.get() > token, "fencing grows");
}

const NS: &str = "fs";

/// Foreign data of `variant` at `name`, the semaphore key `suffix`; with
/// an expiry of 5 s except for `no-expiry` (members in distlock's own
/// format, which distlock never leaves without one).
async fn plant(conn: &mut MultiplexedConnection, name: &str, suffix: &str, variant: &str) {
    let _: () = conn.del(name).await.unwrap();
    let _: () = match variant {
        "string" => conn.set(name, "someone else's").await.unwrap(),
        "hash" => conn.hset(name, "f", "v").await.unwrap(),
        "zset" => conn.zadd(name, "not a permit", 1).await.unwrap(),
        "no-expiry" => {
            let member = match suffix {
                "gone" => format!("{}:7/{}", "ab".repeat(16), "cd".repeat(16)),
                _ => format!("dl1:{}:7:1", "ab".repeat(16)),
            };
            conn.zadd(name, member, 1).await.unwrap()
        }
        other => unreachable!("{other}"),
    };
    if variant != "no-expiry" {
        let _: () = conn.pexpire(name, 5000).await.unwrap();
    }
}

/// Every permit operation meets foreign data at each key it reads: it is
/// reported as `Corrupted` naming the key, and left as it was.
#[tokio::test]
async fn foreign_data_at_a_semaphores_keys_is_reported_and_left_alone() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = RedisLock::connect(&format!("{url}/?namespace={NS}"))
        .await
        .unwrap();
    let mut conn = raw(&url).await;
    let mut problems = Vec::new();
    // (which key, the variants planted there, the operations that read it)
    let cases: &[(&str, &[&str], &[&str])] = &[
        (
            "permits",
            &["string", "hash", "zset", "no-expiry"],
            &["acquire", "extend", "release"],
        ),
        ("fence", &["string", "hash", "zset"], &["acquire", "extend"]),
        (
            "gone",
            &["string", "hash", "zset", "no-expiry"],
            &["release"],
        ),
    ];
    for (suffix, variants, ops) in cases {
        for variant in *variants {
            for op in *ops {
                let key = unique_key("foreign-permit");
                let name = sem_key(NS, &key, suffix);
                let owner = OwnerToken::random();
                let grant = if *op == "acquire" {
                    None
                } else {
                    let reply = lock
                        .acquire_permit(request(&key, owner, Duration::from_secs(10), false))
                        .await;
                    Some(granted(reply, "a permit to extend or release"))
                };
                plant(&mut conn, &name, suffix, variant).await;
                let before: Vec<u8> = redis::cmd("DUMP")
                    .arg(&name)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                let result = match grant {
                    None => lock
                        .acquire_permit(request(&key, owner, Duration::from_secs(10), false))
                        .await
                        .map(drop),
                    Some(grant) if *op == "extend" => lock
                        .extend_permit(held(&key, owner, grant), Duration::from_secs(10))
                        .await
                        .map(drop),
                    Some(grant) => lock
                        .release_permit(held(&key, owner, grant))
                        .await
                        .map(drop),
                };
                let after: Vec<u8> = redis::cmd("DUMP")
                    .arg(&name)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                let label = format!("{op} with a foreign {variant} at the {suffix} key");
                match &result {
                    Err(e) if e.kind() == ErrorKind::Corrupted && e.message().contains(&name) => {}
                    other => problems.push(format!(
                        "{label}: expected Corrupted naming {name}, got {other:?}"
                    )),
                }
                if before != after {
                    problems.push(format!("{label}: the foreign value was changed"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
