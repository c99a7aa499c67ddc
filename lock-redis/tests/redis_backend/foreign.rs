//! Data distlock did not write, of every type, at each of the Redis keys of
//! a lock (the lock, its fencing counter, its released-by marker), met by
//! each operation: every script that would write there reports it
//! (`Corrupted`) and writes nothing; one that does not touch the key goes
//! on and leaves it alone.

use std::time::Duration;

use distlock_conformance::server;
use distlock_core::{ErrorKind, Lease, LockClient, LockError, LockKey};
use distlock_redis::redis::{self, aio::MultiplexedConnection, AsyncCommands};

use crate::support::*;

const NS: &str = "fm";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Lock,
    Fence,
    Gone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Acquire,
    Extend,
    Release,
}

const VARIANTS: &[&str] = &[
    "string",
    "hash",
    "list",
    "set",
    "zset",
    "stream",
    "no-expiry",
];

fn redis_key(key: &LockKey, target: Target) -> String {
    let suffix = match target {
        Target::Lock => "lock",
        Target::Fence => "fence",
        Target::Gone => "gone",
    };
    format!("{NS}:{{{}}}:{suffix}", key.as_str())
}

/// Writes foreign data of `variant` at `name`; with an expiry of 5 s
/// except for `no-expiry` (a value in distlock's own format, which
/// distlock never leaves without one).
async fn plant(conn: &mut MultiplexedConnection, name: &str, variant: &str, target: Target) {
    let _: () = conn.del(name).await.unwrap();
    let _: () = match variant {
        "string" => conn.set(name, "someone else's").await.unwrap(),
        "hash" => conn.hset(name, "f", "v").await.unwrap(),
        "list" => conn.rpush(name, "a").await.unwrap(),
        "set" => conn.sadd(name, "a").await.unwrap(),
        "zset" => conn.zadd(name, "a", 1).await.unwrap(),
        "stream" => redis::cmd("XADD")
            .arg(name)
            .arg("*")
            .arg("f")
            .arg("v")
            .query_async::<String>(conn)
            .await
            .map(drop)
            .unwrap(),
        "no-expiry" => {
            let value = match target {
                Target::Fence => "42".to_owned(),
                Target::Lock => format!("dl1:{}:7", "ab".repeat(16)),
                Target::Gone => format!("dl1:{}:7/{}", "ab".repeat(16), "cd".repeat(16)),
            };
            conn.set(name, value).await.unwrap()
        }
        other => unreachable!("{other}"),
    };
    if variant != "no-expiry" {
        let _: () = conn.pexpire(name, 5000).await.unwrap();
    }
}

/// Runs `op` with foreign `variant` data at `target`; the mismatches with
/// what should happen, if any.
async fn case(
    lock: &LockClient,
    conn: &mut MultiplexedConnection,
    target: Target,
    variant: &str,
    op: Op,
) -> Option<String> {
    let key = unique_key("foreign");
    let name = redis_key(&key, target);
    let lock_name = redis_key(&key, Target::Lock);
    // Extend and release need a lock of ours first, taken for 10 s.
    let lease: Option<Lease> = match op {
        Op::Acquire => None,
        Op::Extend | Op::Release => Some(acquired(
            lock.try_acquire(&key, Duration::from_secs(10))
                .await
                .unwrap(),
        )),
    };
    plant(conn, &name, variant, target).await;
    let before = snapshot(conn, &name).await;
    let result: Result<(), LockError> = match (&lease, op) {
        (None, _) => lock
            .try_acquire(&key, Duration::from_secs(60))
            .await
            .map(drop),
        (Some(lease), Op::Extend) => lock.extend(lease, Duration::from_secs(60)).await.map(drop),
        (Some(lease), _) => lock.release(lease).await,
    };
    let after = snapshot(conn, &name).await;
    let label = format!("{op:?} with a foreign {variant} at the {target:?} key");
    let touches = !matches!(
        (target, op),
        (Target::Fence, Op::Release) | (Target::Gone, Op::Acquire | Op::Extend)
    );
    let mut problems = Vec::new();
    match (&result, touches) {
        (Err(e), true) if e.kind() == ErrorKind::Corrupted => {
            if !e.message().contains(&name) {
                problems.push(format!("the error does not name {name}: {e}"));
            }
        }
        (Ok(()), false) => {}
        (other, true) => problems.push(format!("expected Corrupted, got {other:?}")),
        (other, false) => problems.push(format!("expected success, got {other:?}")),
    }
    if after.0 != before.0 {
        problems.push("the foreign value was changed".to_owned());
    }
    let pttl_kept = match before.1 {
        -1 => after.1 == -1,
        ms => after.1 > 0 && after.1 <= ms,
    };
    if !pttl_kept {
        problems.push(format!(
            "its expiry went from {} to {} ms",
            before.1, after.1
        ));
    }
    // Nothing else was written: no lock taken, extended or deleted.
    if target != Target::Lock {
        let lock_pttl: i64 = conn.pttl(&lock_name).await.unwrap();
        let expected = match (op, touches) {
            (Op::Acquire, true) => lock_pttl == -2,
            (Op::Acquire, false) => lock_pttl > 10_000,
            (Op::Extend, true) => (0..=10_000).contains(&lock_pttl),
            (Op::Extend, false) => lock_pttl > 10_000,
            (Op::Release, true) => (0..=10_000).contains(&lock_pttl),
            (Op::Release, false) => lock_pttl == -2,
        };
        if !expected {
            problems.push(format!("the lock key's PTTL is {lock_pttl} ms"));
        }
    }
    let _: () = conn.del(&[&name, &lock_name]).await.unwrap();
    (!problems.is_empty()).then(|| format!("{label}: {}", problems.join("; ")))
}

#[tokio::test]
async fn foreign_data_at_every_key_is_reported_and_left_alone() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&format!("{url}/?namespace={NS}")).await.unwrap();
    let mut conn = raw(&url).await;
    let mut problems = Vec::new();
    for target in [Target::Lock, Target::Fence, Target::Gone] {
        for variant in VARIANTS {
            for op in [Op::Acquire, Op::Extend, Op::Release] {
                if let Some(problem) = case(&lock, &mut conn, target, variant, op).await {
                    problems.push(problem);
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A batched renewal meets foreign data at one lock's keys: that lock's
/// answer is `Corrupted` naming the Redis key, which is left as it was
/// (and the lock not extended); the locks beside it in the same request
/// are extended.
#[tokio::test]
async fn foreign_data_in_a_batched_renewal_concerns_its_lock_alone() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&format!("{url}/?namespace={NS}")).await.unwrap();
    assert!(
        lock.capabilities().extend_batch > 1,
        "one server batches renewals"
    );
    let mut conn = raw(&url).await;
    let mut problems = Vec::new();
    for target in [Target::Lock, Target::Fence] {
        for variant in VARIANTS {
            let label = format!("a batched extend with a foreign {variant} at the {target:?} key");
            let mut leases = Vec::new();
            for _ in 0..3 {
                let key = unique_key("foreign-batch");
                leases.push(acquired(
                    lock.try_acquire(&key, Duration::from_secs(10))
                        .await
                        .unwrap(),
                ));
            }
            let name = redis_key(leases[1].key(), target);
            plant(&mut conn, &name, variant, target).await;
            let before = snapshot(&mut conn, &name).await;
            let held: Vec<_> = leases.iter().map(Lease::held).collect();
            let replies = lock
                .backend()
                .extend_many(&held, Duration::from_secs(60))
                .await
                .unwrap();
            match &replies[1] {
                Err(e) if e.kind() == ErrorKind::Corrupted && e.message().contains(&name) => {}
                other => problems.push(format!("{label}: its lock answered {other:?}")),
            }
            if snapshot(&mut conn, &name).await.0 != before.0 {
                problems.push(format!("{label}: the foreign value was changed"));
            }
            for i in [0, 2] {
                let pttl: i64 = conn
                    .pttl(redis_key(leases[i].key(), Target::Lock))
                    .await
                    .unwrap();
                if !matches!(replies[i], Ok(distlock_core::ExtendReply::Extended(_)))
                    || pttl <= 10_000
                {
                    problems.push(format!(
                        "{label}: lock {i} beside it answered {:?} (PTTL {pttl} ms)",
                        replies[i]
                    ));
                }
            }
            if target == Target::Fence {
                let pttl: i64 = conn
                    .pttl(redis_key(leases[1].key(), Target::Lock))
                    .await
                    .unwrap();
                if !(0..=10_000).contains(&pttl) {
                    problems.push(format!("{label}: its lock was extended (PTTL {pttl} ms)"));
                }
            }
            for lease in &leases {
                for target in [Target::Lock, Target::Fence] {
                    let _: () = conn.del(redis_key(lease.key(), target)).await.unwrap();
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A foreign value at a key's waiter line: an attempt that does not wait
/// on a held key never reads it; a waiting attempt, and any attempt on a
/// free key (whose line's head goes first), are refused as `Corrupted`
/// before they write; a release still releases (only its wake-up fails).
/// The value is left as it was.
#[tokio::test]
async fn foreign_data_at_the_waiter_line_is_reported_and_left_alone() {
    foreign_data_beside_the_lock("waiters", "not a line", true).await;
}

/// A foreign value at a key's turn (the woken waiter's): an attempt on
/// the free key whose line has a head is refused as `Corrupted` naming
/// it, before it writes; with nobody in line the turn is not read (the
/// key is taken and released); a release still releases (only its
/// wake-up fails). The value is left as it was.
#[tokio::test]
async fn foreign_data_at_the_turn_is_reported_and_left_alone() {
    foreign_data_beside_the_lock("turn", "not a turn", false).await;
}

/// Plants `value` (with an expiry) at the lock's Redis key of `suffix`
/// while the lock is held, and checks what each operation makes of it
/// (see the tests above); `waiting_reads`: whether a waiting attempt on
/// the held key reads it.
async fn foreign_data_beside_the_lock(suffix: &str, value: &str, waiting_reads: bool) {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&format!("{url}/?namespace={NS}")).await.unwrap();
    let other = connect(&format!("{url}/?namespace={NS}")).await.unwrap();
    let mut conn = raw(&url).await;
    let key = unique_key("foreign-beside");
    let name = format!("{NS}:{{{}}}:{suffix}", key.as_str());
    let ttl = Duration::from_secs(30);
    let lease = acquired(lock.try_acquire(&key, ttl).await.unwrap());
    let _: () = conn.set_ex(&name, value, 60).await.unwrap();

    let refused = other.try_acquire(&key, ttl).await;
    assert!(
        matches!(refused, Ok(distlock_core::AcquireAttempt::Held { .. })),
        "an attempt that does not wait on a held key never reads {suffix}: {refused:?}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    let waited = other.acquire(&key, ttl, deadline).await;
    match (waited, waiting_reads) {
        (Err(e), true) => {
            assert_eq!(e.kind(), ErrorKind::Corrupted, "{e}");
            assert!(e.message().contains(&name), "{e}");
        }
        (Ok(None), false) => {}
        (other, _) => panic!("a waiting attempt on the held key: {other:?}"),
    }
    lock.release(&lease)
        .await
        .expect("the release still releases");
    if suffix == "turn" {
        // A turn is read only for a line's head: with nobody in line (the
        // waiter above could not leave it: its leave read the turn) the key
        // is free to take, and the value there is not read.
        let line = format!("{NS}:{{{}}}:waiters", key.as_str());
        let _: () = conn.del(&line).await.unwrap();
        let lease = acquired(other.try_acquire(&key, ttl).await.unwrap());
        other.release(&lease).await.expect("released");
        let member = format!("{:032x}:{:032x}", 1, 2);
        let _: () = conn.zadd(&line, &member, 1).await.unwrap();
        let _: () = conn.pexpire(&line, 60_000).await.unwrap();
    }
    let err = other
        .try_acquire(&key, ttl)
        .await
        .expect_err("an attempt on the free key reads it");
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.message().contains(&name), "{err}");
    let kept: String = conn.get(&name).await.unwrap();
    assert_eq!(kept, value, "the foreign value is left alone");
    let pttl: i64 = conn.pttl(&name).await.unwrap();
    assert!((0..=60_000).contains(&pttl), "its expiry is kept: {pttl}");
    let _: () = conn.del(&name).await.unwrap();
}
