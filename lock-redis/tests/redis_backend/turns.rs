//! Fair handoff: a lock's woken waiter keeps the free key for its turn
//! (5 s by the server's clock) and no longer; a wake-up for a waiter that
//! no longer waits is passed on by the listener that receives it.

use std::time::{Duration, Instant};

use distlock_conformance::server;
use distlock_core::{AcquireReply, LockBackend, LockKey, OwnerToken};
use distlock_redis::redis::{self, aio::MultiplexedConnection, AsyncCommands};
use distlock_redis::RedisLock;

use crate::support::*;

/// The Redis key of `key`'s waiter line in the default namespace.
fn line_of(key: &LockKey) -> String {
    format!("distlock:{{{}}}:waiters", key.as_str())
}

/// The Redis key of `key`'s turn in the default namespace.
fn turn_of(key: &LockKey) -> String {
    format!("distlock:{{{}}}:turn", key.as_str())
}

/// The members of `key`'s line, first first.
async fn line(conn: &mut MultiplexedConnection, key: &LockKey) -> Vec<String> {
    conn.zrange(line_of(key), 0, -1).await.unwrap()
}

/// A server of the test's own, a raw connection to it, and a lock on a
/// fresh key held by a client for `ttl`.
struct Held {
    server: distlock_conformance::server::ServerProcess,
    conn: MultiplexedConnection,
    holder: distlock_core::LockClient,
    key: LockKey,
    lease: distlock_core::Lease,
}

impl Held {
    async fn start(prefix: &str, ttl: Duration) -> Self {
        let server = start(server::Redis::default());
        let conn = raw(&server.url()).await;
        let holder = connect(&server.url()).await.unwrap();
        let key = unique_key(prefix);
        let lease = acquired(holder.try_acquire(&key, ttl).await.unwrap());
        Self {
            server,
            conn,
            holder,
            key,
            lease,
        }
    }
}

/// Waits (up to 30 s) until the server's clock is past `deadline_ms`.
async fn server_clock_passes(conn: &mut MultiplexedConnection, deadline_ms: u64) {
    let give_up = Instant::now() + Duration::from_secs(30);
    while server_time_us(conn).await / 1000 <= deadline_ms {
        assert!(
            Instant::now() < give_up,
            "the server's clock never passed the turn's end"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A woken head that never comes (its client received the wake-up and
/// froze) keeps the free key from the next waiter until its turn is over,
/// then no longer: the next waiter's attempt drops it and takes the key.
#[tokio::test]
async fn a_woken_waiter_that_never_comes_loses_its_turn() {
    let mut held = Held::start("turn", Duration::from_secs(60)).await;
    let key = held.key.clone();
    let url = held.server.url();

    // Two waiters through the raw backend: each opens its wait (a watch)
    // and makes one refused attempt, which puts it in the line.
    let (frozen, next) = (
        RedisLock::connect(&url).await.unwrap(),
        RedisLock::connect(&url).await.unwrap(),
    );
    let (frozen_owner, next_owner) = (OwnerToken::random(), OwnerToken::random());
    let ttl = Duration::from_secs(30);
    let mut frozen_watch = frozen.watch(&key, frozen_owner).await.unwrap().unwrap();
    let refused = raw_acquire(&frozen, &key, frozen_owner, ttl).await.unwrap();
    assert!(matches!(refused, AcquireReply::Held { .. }), "{refused:?}");
    let _next_watch = next.watch(&key, next_owner).await.unwrap().unwrap();
    let refused = raw_acquire(&next, &key, next_owner, ttl).await.unwrap();
    assert!(matches!(refused, AcquireReply::Held { .. }), "{refused:?}");
    let queued = line(&mut held.conn, &key).await;
    assert_eq!(queued.len(), 2, "{queued:?}");
    assert!(queued[0].ends_with(&frozen_owner.to_hex()), "{queued:?}");

    held.holder.release(&held.lease).await.unwrap();
    // The release woke the first waiter alone, and its client received
    // the wake-up; it never acts on it.
    tokio::time::timeout(Duration::from_secs(20), frozen_watch.released())
        .await
        .expect("the release wakes the first waiter")
        .unwrap();
    let turn: String = held.conn.get(turn_of(&key)).await.unwrap();
    let (member, deadline) = turn
        .rsplit_once('/')
        .expect("a turn is <member>/<deadline>");
    assert_eq!(member, queued[0], "the turn is the woken waiter's");
    let deadline: u64 = deadline.parse().unwrap();

    // While its turn lasts the woken waiter keeps its place, and the next
    // one is refused the free key, told to come back when the turn ends
    // (not when the released holder's 60 s would have).
    if server_time_us(&mut held.conn).await / 1000 < deadline {
        let refused = raw_acquire(&next, &key, next_owner, ttl).await.unwrap();
        if server_time_us(&mut held.conn).await / 1000 < deadline {
            let AcquireReply::Held {
                expires_in: Some(left),
            } = refused
            else {
                panic!("the next waiter took the key during the first one's turn: {refused:?}");
            };
            assert!(left <= Duration::from_secs(5), "told to wait {left:?}");
            assert_eq!(
                line(&mut held.conn, &key).await,
                queued,
                "nobody lost a place"
            );
        }
    }

    server_clock_passes(&mut held.conn, deadline).await;
    let granted = raw_acquire(&next, &key, next_owner, ttl).await.unwrap();
    assert!(
        matches!(granted, AcquireReply::Granted(_)),
        "after the turn ran out the next waiter gets the key: {granted:?}"
    );
    // The one that never came is out of the line, and no turn is left.
    assert_eq!(line(&mut held.conn, &key).await, Vec::<String>::new());
    let turn: Option<String> = held.conn.get(turn_of(&key)).await.unwrap();
    assert_eq!(turn, None);
}

/// The lease `task` waited for, within 60 s: only a wake-up serves it
/// before the holder's 120 s.
async fn served_by_a_wake_up(
    task: tokio::task::JoinHandle<Result<Option<distlock_core::Lease>, distlock_core::LockError>>,
) -> distlock_core::Lease {
    tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .expect("the wake-up for the waiter that left was passed on")
        .unwrap()
        .unwrap()
        .expect("the waiter is served")
}

/// A wake-up for a waiter of this client that no longer waits (here a
/// member of the line the client does not know, as a waiter's attempt that
/// reached the server after its wait ended leaves) is passed on by the
/// client's listener: the next waiter, of the same client, is served
/// long before the holder's TTL, and the turn did not have to run out.
#[tokio::test]
async fn a_wake_up_for_a_waiter_that_left_is_passed_on() {
    let mut held = Held::start("passon", Duration::from_secs(120)).await;
    let key = held.key.clone();
    let waiter = connect(&held.server.url()).await.unwrap();
    let task = spawn_acquire(&waiter, &key, Duration::from_secs(120));
    let queued = eventually("the waiter joins the line", || {
        let mut conn = held.conn.clone();
        let key = key.clone();
        async move {
            let queued = line(&mut conn, &key).await;
            (queued.len() == 1).then_some(queued)
        }
    })
    .await;
    // A member of the same client, ahead of the waiter, that waits no more.
    let client = queued[0].split_once(':').unwrap().0;
    let left = format!("{client}:{}", OwnerToken::random().to_hex());
    let _: i64 = redis::cmd("ZADD")
        .arg(line_of(&key))
        .arg(1)
        .arg(&left)
        .query_async(&mut held.conn)
        .await
        .unwrap();

    held.holder.release(&held.lease).await.unwrap();
    // The release woke the member that left, whose client passed it on.
    let got = served_by_a_wake_up(task).await;
    assert!(got.fencing_token() > held.lease.fencing_token());
    assert_eq!(line(&mut held.conn, &key).await, Vec::<String>::new());
    waiter.release(&got).await.unwrap();
}

/// As [`a_wake_up_for_a_waiter_that_left_is_passed_on`], on a semaphore:
/// its release takes the woken waiter off the line, so a wake-up for a
/// member that waits no more was lost, and the next waiter waited for its
/// timer (the holder's permit expiry).
#[tokio::test]
async fn a_permit_wake_up_for_a_waiter_that_left_is_passed_on() {
    let server = start(server::Redis::default());
    let mut conn = raw(&server.url()).await;
    let holder = connect(&server.url()).await.unwrap();
    let key = unique_key("permit-passon");
    let ttl = Duration::from_secs(120);
    let attempt = holder.try_acquire_permit(&key, 1, ttl).await.unwrap();
    let permit = attempt.lease().expect("a free permit");
    let waiter = connect(&server.url()).await.unwrap();
    let task = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + ttl;
            waiter.acquire_permit(&key, 1, ttl, deadline).await
        })
    };
    let permit_line = format!("distlock:{{{}}}:sem:waiters", key.as_str());
    let queued: Vec<String> = eventually("the waiter joins the line", || {
        let (mut conn, permit_line) = (conn.clone(), permit_line.clone());
        async move {
            let queued: Vec<String> = conn.zrange(&permit_line, 0, -1).await.unwrap();
            (queued.len() == 1).then_some(queued)
        }
    })
    .await;
    // A member of the same client, ahead of the waiter, that waits no more.
    let client = queued[0].split_once(':').unwrap().0;
    let left = format!("{client}:{}", OwnerToken::random().to_hex());
    let _: i64 = conn.zadd(&permit_line, &left, 1).await.unwrap();

    holder.release(&permit).await.unwrap();
    let got = served_by_a_wake_up(task).await;
    let members: Vec<String> = conn.zrange(&permit_line, 0, -1).await.unwrap();
    assert_eq!(members, Vec::<String>::new());
    waiter.release(&got).await.unwrap();
}
