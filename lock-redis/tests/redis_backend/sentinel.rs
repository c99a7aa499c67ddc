//! Sentinel: the client finds the primary through the
//! sentinels, follows a failover (guards keep their lock or report it
//! lost, waiters get it), never writes to a replica, and `min_replicas`
//! makes every acquisition wait for the replica. Each test runs its own
//! group (primary, replica, three sentinels), as it kills or reconfigures
//! its members.

use std::time::Duration;

use distlock_conformance::server::{RedisSentinel, SENTINEL_SERVICE};
use distlock_core::{ErrorKind, LockState};
use distlock_redis::redis::{self, AsyncCommands};

use crate::support::*;

/// Short timeouts: a dead primary is noticed fast.
const TIMEOUTS: &str = "connect_timeout_ms=1000&operation_timeout_ms=1000";

fn url(group: &RedisSentinel, extra: &str) -> String {
    format!("{}&{TIMEOUTS}{extra}", group.url())
}

/// How many scripts `node` has run since it started (`INFO commandstats`).
async fn scripts_run(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// The primary is SIGKILLed while a guard holds a lock and another
/// client's waiter waits for it: the sentinels promote the replica, the
/// clients find it, the guard keeps its lock or reports it lost, the waiter
/// gets the lock (woken over a new subscription on the new primary), and
/// fencing tokens keep growing, even for a lock whose counter the new
/// primary never received (the server-clock floor). The old primary comes
/// back as a replica and is never sent a script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_killed_during_holds_and_waits() {
    let group = start_group(RedisSentinel::start).await;
    let url = url(&group, "");
    let holder = connect(&url).await.unwrap();
    let waiter = connect(&url).await.unwrap();
    let old = group.primary().unwrap();
    let mut on_old = raw(&group.node_url(old)).await;

    let key = unique_key("sentinel-failover");
    let before = acquired(
        holder
            .try_acquire(&unique_key("sentinel-before"), Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let held = HeldAndAwaited::start(&holder, &waiter, &key, Duration::from_secs(10)).await;
    await_numsub(
        &mut on_old,
        &channel_of(&key),
        1,
        "the waiter subscribes on the primary",
    )
    .await;
    drop(on_old);

    old.kill();
    let new = tokio::task::block_in_place(|| group.wait_failover(old)).unwrap();
    let mut on_new = raw(&group.node_url(new)).await;
    let next = held.settle().await;
    let exists: bool = on_new.exists(lock_key_of(&key)).await.unwrap();
    assert!(exists, "the waiter's lock is on the new primary");
    assert!(next.fencing_token() > before.fencing_token());
    next.release().await.unwrap();

    // A lock whose acquisition the new primary never saw (its keys are
    // gone, as after a failover to a lagging replica): its next token is
    // still greater, from the server's clock.
    let lagging = unique_key("sentinel-lagging");
    let first = acquired(
        holder
            .try_acquire(&lagging, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let _: () = redis::cmd("DEL")
        .arg(lock_key_of(&lagging))
        .arg(lock_key_of(&lagging).replace(":lock", ":fence"))
        .query_async(&mut on_new)
        .await
        .unwrap();
    let second = acquired(
        waiter
            .try_acquire(&lagging, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    assert!(second.fencing_token() > first.fencing_token());
    waiter.release(&second).await.unwrap();

    // The old primary runs again, as a replica: no client sends it a
    // script (every write goes to the primary).
    tokio::task::block_in_place(|| group.rejoin(old)).unwrap();
    let fresh = connect(&url).await.unwrap();
    for client in [&holder, &waiter, &fresh] {
        let lease = acquired(
            client
                .try_acquire(&unique_key("sentinel-after"), Duration::from_secs(5))
                .await
                .unwrap(),
        );
        client.release(&lease).await.unwrap();
    }
    let mut on_replica = raw(&group.node_url(old)).await;
    assert_eq!(
        scripts_run(&mut on_replica).await,
        0,
        "a script was sent to the replica"
    );
}

/// The primary turns into a replica under a connected client without
/// dropping its connection (roles swapped by hand, the sentinels pointed
/// at the new primary): the client's next write is refused by the server
/// (`READONLY`, nothing written) and reported as `Unavailable`, and the
/// request after that goes to the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_is_left_for_the_new_one() {
    let group = start_group(RedisSentinel::start).await;
    let client = connect(&url(&group, "")).await.unwrap();
    let warm = acquired(
        client
            .try_acquire(&unique_key("demoted-warm"), Duration::from_secs(30))
            .await
            .unwrap(),
    );
    client.release(&warm).await.unwrap();

    let old = group.primary().unwrap();
    let new = group
        .nodes()
        .iter()
        .find(|n| n.port() != old.port())
        .unwrap();
    let mut on_new = raw(&group.node_url(new)).await;
    let mut on_old = raw(&group.node_url(old)).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut on_new)
        .await
        .unwrap();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new.port())
        .query_async(&mut on_old)
        .await
        .unwrap();
    for sentinel in group.sentinels() {
        let mut conn = raw(&group.sentinel_url(sentinel)).await;
        let commands: [&[&str]; 3] = [
            &["REMOVE", SENTINEL_SERVICE],
            &[
                "MONITOR",
                SENTINEL_SERVICE,
                "127.0.0.1",
                &new.port().to_string(),
                "2",
            ],
            &["SET", SENTINEL_SERVICE, "auth-pass", "data-pw"],
        ];
        for args in commands {
            let _: () = redis::cmd("SENTINEL")
                .arg(args)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }

    let key = unique_key("demoted");
    let err = client
        .try_acquire(&key, Duration::from_secs(30))
        .await
        .expect_err("the old primary refuses the write");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.message().contains("replica"), "{err}");
    let lease = acquired(
        client
            .try_acquire(&key, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let exists: bool = on_new.exists(lock_key_of(&key)).await.unwrap();
    assert!(exists, "the lock is on the new primary");
    client.release(&lease).await.unwrap();
}

/// `min_replicas=1`: every acquisition and extension waits for the
/// replica. More replicas than there are: the acquisition is given back
/// and reported as `Unavailable`. The replica frozen: an extension is
/// reported as `Unavailable`, and the lease keeps its old expiry. Then an
/// evicting `maxmemory-policy` on the primary is refused at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_waits_for_the_replicas() {
    let group = start_group(RedisSentinel::start).await;
    let plain = connect(&url(&group, "")).await.unwrap();
    let one = connect(&url(&group, "&min_replicas=1")).await.unwrap();
    let two = connect(&url(&group, "&min_replicas=2")).await.unwrap();

    let key = unique_key("min-replicas");
    let lease = acquired(
        one.try_acquire(&key, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let lease = one.extend(&lease, Duration::from_secs(30)).await.unwrap();
    one.release(&lease).await.unwrap();

    let err = two
        .try_acquire(&key, Duration::from_secs(30))
        .await
        .expect_err("only one replica acknowledges");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.message().contains("min_replicas") && err.message().contains("released"),
        "{err}"
    );
    assert_eq!(
        plain.inspect(&key).await.unwrap(),
        LockState::Free,
        "the unacknowledged lock was given back"
    );

    // Permits the same: acknowledged by one replica, given back when two
    // were asked for.
    let permit = acquired(
        one.try_acquire_permit(&key, 1, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let permit = one.extend(&permit, Duration::from_secs(30)).await.unwrap();
    one.release(&permit).await.unwrap();
    let err = two
        .try_acquire_permit(&key, 1, Duration::from_secs(30))
        .await
        .expect_err("only one replica acknowledges the permit");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.message().contains("min_replicas") && err.message().contains("released"),
        "{err}"
    );
    let only = acquired(
        plain
            .try_acquire_permit(&key, 1, Duration::from_secs(30))
            .await
            .expect("the unacknowledged permit was given back"),
    );
    plain.release(&only).await.unwrap();

    let lease = acquired(
        one.try_acquire(&key, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let replica = group
        .nodes()
        .iter()
        .find(|n| n.port() != group.primary().unwrap().port())
        .unwrap();
    replica.pause().unwrap();
    let extended = one.extend(&lease, Duration::from_secs(60)).await;
    replica.resume().unwrap();
    let err = extended.expect_err("the frozen replica acknowledges nothing");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.message().contains("min_replicas"), "{err}");
    one.release(&lease).await.unwrap();

    // An evicting maxmemory-policy on the primary the sentinels name: the
    // connection is refused, naming it.
    let mut primary = raw(&group.node_url(group.primary().unwrap())).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-lru")
        .query_async(&mut primary)
        .await
        .unwrap();
    let err = connect(&url(&group, "")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.message().contains("volatile-lru"), "{err}");
}
