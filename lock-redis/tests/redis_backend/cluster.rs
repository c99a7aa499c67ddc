//! Redis Cluster: locks in every primary's slots (scripts and
//! `WAIT` on the slot's node, waiters subscribed to the slot's shard
//! channel there), and a primary SIGKILLed while a guard holds a lock in
//! its slots and a waiter waits for it: its replica is promoted and the
//! clients follow. One cluster of its own (three primaries, one replica
//! each), since a primary is killed.

use std::time::Duration;

use distlock_conformance::fault::Proxy;
use distlock_conformance::server::{ClusterPrimary, RedisCluster};
use distlock_core::{ErrorKind, LockKey};
use distlock_redis::redis::{self, aio::MultiplexedConnection, AsyncCommands};

use crate::support::*;

/// Short timeouts: a dead node is noticed fast.
const TIMEOUTS: &str = "connect_timeout_ms=1000&operation_timeout_ms=1000";

/// A fresh key whose lock lives in one of `slots`.
async fn key_in(conn: &mut MultiplexedConnection, slots: &[(u16, u16)], label: &str) -> LockKey {
    for _ in 0..10_000 {
        let key = unique_key(label);
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(lock_key_of(&key))
            .query_async(conn)
            .await
            .unwrap();
        if slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)) {
            return key;
        }
    }
    panic!("no key found in slots {slots:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_in_every_primarys_slots_and_a_primary_killed() {
    let cluster = start_group(RedisCluster::start).await;
    let url = format!("{}?{TIMEOUTS}", cluster.url());
    let holder = connect(&url).await.unwrap();
    let waiter = connect(&url).await.unwrap();
    let acknowledged = connect(&format!("{url}&min_replicas=1")).await.unwrap();
    let overasked = connect(&format!("{url}&min_replicas=2")).await.unwrap();
    let primaries = cluster.primaries().unwrap();
    assert_eq!(primaries.len(), 3);

    // Every primary's slots: the lock is on that node, the waiter is
    // subscribed to the lock's shard channel there, and the release wakes
    // it; WAIT runs on that node (one replica each).
    let mut keys = Vec::new();
    for primary in &primaries {
        let node = cluster.node(primary.port).unwrap();
        let mut on_node = raw(&cluster.node_url(node)).await;
        let key = key_in(&mut on_node, &primary.slots, "cluster").await;
        let lease = acquired(
            holder
                .try_acquire(&key, Duration::from_secs(60))
                .await
                .unwrap(),
        );
        let exists: bool = on_node.exists(lock_key_of(&key)).await.unwrap();
        assert!(exists, "the lock is on the node that serves its slot");
        let task = spawn_acquire(&waiter, &key, Duration::from_secs(20));
        await_shard_numsub(
            &mut on_node,
            &channel_of(&key),
            1,
            "the waiter subscribes on the slot's node",
        )
        .await;
        holder.release(&lease).await.unwrap();
        let got = task
            .await
            .unwrap()
            .unwrap()
            .expect("the release wakes the waiter");
        assert!(got.fencing_token() > lease.fencing_token());
        waiter.release(&got).await.unwrap();

        let lease = acquired(
            acknowledged
                .try_acquire(&key, Duration::from_secs(30))
                .await
                .unwrap(),
        );
        let lease = acknowledged
            .extend(&lease, Duration::from_secs(30))
            .await
            .unwrap();
        acknowledged.release(&lease).await.unwrap();
        let err = overasked
            .try_acquire(&key, Duration::from_secs(30))
            .await
            .expect_err("each primary has one replica, not two");
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        assert!(err.message().contains("min_replicas"), "{err}");
        keys.push((primary.clone(), key));
    }

    // The first primary is killed while its lock is held and awaited.
    let (primary, key) = &keys[0];
    let old = cluster.node(primary.port).unwrap();
    let mut on_old = raw(&cluster.node_url(old)).await;
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(lock_key_of(key))
        .query_async(&mut on_old)
        .await
        .unwrap();
    let before = acquired(
        holder
            .try_acquire(&keys[1].1, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let held = HeldAndAwaited::start(&holder, &waiter, key, Duration::from_secs(10)).await;
    await_shard_numsub(&mut on_old, &channel_of(key), 1, "the waiter subscribes").await;
    drop(on_old);
    old.kill();
    let promoted = tokio::task::block_in_place(|| cluster.wait_failover(old, slot)).unwrap();
    let next = held.settle().await;
    let mut on_new = raw(&cluster.node_url(cluster.node(promoted).unwrap())).await;
    let exists: bool = on_new.exists(lock_key_of(key)).await.unwrap();
    assert!(exists, "the waiter's lock is on the promoted replica");
    next.release().await.unwrap();
    holder.release(&before).await.unwrap();

    // The old primary comes back as a replica; every slot range still locks.
    tokio::task::block_in_place(|| {
        old.restart()?;
        cluster.wait_healthy()
    })
    .unwrap();
    for (_, key) in &keys {
        let lease = acquired(
            holder
                .try_acquire(key, Duration::from_secs(5))
                .await
                .unwrap(),
        );
        holder.release(&lease).await.unwrap();
    }
}

/// The port `CLUSTER SLOTS` on `conn` names for the primary of `slot`.
async fn slot_port(conn: &mut MultiplexedConnection, slot: u16) -> Option<u16> {
    let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .ok()?;
    for range in ranges {
        let redis::Value::Array(items) = range else {
            continue;
        };
        let bound = |i: usize| match items.get(i) {
            Some(redis::Value::Int(n)) => u16::try_from(*n).ok(),
            _ => None,
        };
        let (Some(start), Some(end)) = (bound(0), bound(1)) else {
            continue;
        };
        if (start..=end).contains(&slot) {
            if let Some(redis::Value::Array(node)) = items.get(2) {
                if let Some(redis::Value::Int(port)) = node.get(1) {
                    return u16::try_from(*port).ok();
                }
            }
        }
    }
    None
}

/// A primary whose clients are sent through a fault proxy: it announces
/// the proxy's port (`cluster-announce-port`), and once every node's
/// `CLUSTER SLOTS` says so, clients reach it only through the proxy.
async fn proxied_primary(
    cluster: &RedisCluster,
) -> (ClusterPrimary, Proxy, MultiplexedConnection, String) {
    let primary = cluster.primaries().unwrap().remove(0);
    let node = cluster.node(primary.port).unwrap();
    let node_url = cluster.node_url(node);
    let proxy = Proxy::start(node.addr()).await.unwrap();
    let mut on_node = raw(&node_url).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("cluster-announce-port")
        .arg(proxy.addr().port())
        .query_async(&mut on_node)
        .await
        .unwrap();
    let slot = primary.slots[0].0;
    for other in cluster.nodes() {
        let conn = raw(&cluster.node_url(other)).await;
        eventually("every node names the proxy for the primary's slots", || {
            let mut conn = conn.clone();
            let want = proxy.addr().port();
            async move { (slot_port(&mut conn, slot).await == Some(want)).then_some(()) }
        })
        .await;
    }
    (primary, proxy, on_node, node_url)
}

/// How many scripts clients sent in a MONITOR phase.
fn evalshas(phase: &[(String, String)]) -> usize {
    phase.iter().filter(|(name, _)| name == "evalsha").count()
}

/// Suspected: the cluster driver resends a request whose connection
/// dropped after it was sent, though the server may have applied it. An
/// acquire resent so found its own lock (and reported it held: an orphan),
/// a release resent so found the lock gone (and reported NotHeld for a
/// release that happened). Both are recognised now: the resent acquire
/// adopts its own lock, the resent release finds its released-by marker.
/// Then: a dead connection to the node is replaced, and an evicting
/// `maxmemory-policy` on any primary is refused at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_scripts_dead_node_connections_and_eviction() {
    use distlock_conformance::fault::Direction;
    let cluster = start_group(RedisCluster::start).await;
    let (primary, proxy, mut on_node, node_url) = proxied_primary(&cluster).await;
    let url = format!(
        "{}?connect_timeout_ms=2000&operation_timeout_ms=5000",
        cluster.url()
    );
    let lock = connect(&url).await.unwrap();
    let key = key_in(&mut on_node, &primary.slots, "resent").await;
    let mut monitor = Monitor::start(&node_url).await;

    // Acquire: applied, its reply lost with the connection.
    proxy.hold(Direction::ToClient);
    let task = {
        let (lock, key) = (lock.clone(), key.clone());
        tokio::spawn(async move { lock.try_acquire(&key, Duration::from_secs(30)).await })
    };
    let value = value_appears(&on_node, &lock_key_of(&key)).await;
    proxy.drop_all();
    proxy.pass(Direction::ToClient);
    let lease = match task.await.unwrap().unwrap() {
        distlock_core::AcquireAttempt::Acquired(lease) => lease,
        held => panic!("the driver resent the acquire after its connection dropped, and the resend was told the client's own lock is held: {held:?}"),
    };
    assert_eq!(lease.fencing_token().get(), token_of(&value));
    let phase = monitor.mark().await;
    assert!(evalshas(&phase) >= 2, "the driver resent it: {phase:?}");

    // Release: applied, its reply lost with the connection.
    proxy.hold(Direction::ToClient);
    let task = {
        let (lock, lease) = (lock.clone(), lease.clone());
        tokio::spawn(async move { lock.release(&lease).await })
    };
    eventually("the release is applied", || {
        let mut conn = on_node.clone();
        let name = lock_key_of(&key);
        async move { (!conn.exists::<_, bool>(&name).await.unwrap()).then_some(()) }
    })
    .await;
    proxy.drop_all();
    proxy.pass(Direction::ToClient);
    task.await
        .unwrap()
        .expect("the release happened; its resend must not report NotHeld");
    let phase = monitor.mark().await;
    assert!(evalshas(&phase) >= 2, "the driver resent it: {phase:?}");

    // The same for a permit of the semaphore of that name.
    let permits = format!("distlock:{{{}}}:sem:permits", key.as_str());
    let members = |conn: &MultiplexedConnection| {
        let (mut conn, permits) = (conn.clone(), permits.clone());
        async move {
            conn.zrange::<_, Vec<String>>(&permits, 0, -1)
                .await
                .unwrap()
        }
    };
    proxy.hold(Direction::ToClient);
    let task = {
        let (lock, key) = (lock.clone(), key.clone());
        tokio::spawn(async move {
            lock.try_acquire_permit(&key, 2, Duration::from_secs(30))
                .await
        })
    };
    let member = eventually("the permit is written", || async {
        members(&on_node).await.into_iter().next()
    })
    .await;
    proxy.drop_all();
    proxy.pass(Direction::ToClient);
    let permit = match task.await.unwrap().unwrap() {
        distlock_core::AcquireAttempt::Acquired(lease) => lease,
        held => panic!("the resent permit request was refused its own permit: {held:?}"),
    };
    assert_eq!(
        Some(permit.fencing_token().get().to_string().as_str()),
        member.split(':').nth(2),
        "the resend adopted the permit the first send took: {member}"
    );
    assert_eq!(members(&on_node).await, [member], "never a second permit");
    let phase = monitor.mark().await;
    assert!(evalshas(&phase) >= 2, "the driver resent it: {phase:?}");
    proxy.hold(Direction::ToClient);
    let task = {
        let (lock, permit) = (lock.clone(), permit.clone());
        tokio::spawn(async move { lock.release(&permit).await })
    };
    eventually("the permit release is applied", || async {
        members(&on_node).await.is_empty().then_some(())
    })
    .await;
    proxy.drop_all();
    proxy.pass(Direction::ToClient);
    task.await
        .unwrap()
        .expect("the permit release happened; its resend must not report NotHeld");
    let phase = monitor.mark().await;
    assert!(evalshas(&phase) >= 2, "the driver resent it: {phase:?}");

    // Every connection to the node so far goes dead without closing.
    let lock = connect(&format!(
        "{}?connect_timeout_ms=2000&operation_timeout_ms=500",
        cluster.url()
    ))
    .await
    .unwrap();
    let warm = key_in(&mut on_node, &primary.slots, "warm").await;
    let lease = acquired(
        lock.try_acquire(&warm, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&lease).await.unwrap();
    let dead = kill_connections_so_far(&proxy);
    let mut failures = Vec::new();
    loop {
        let key = key_in(&mut on_node, &primary.slots, "recover").await;
        match lock.try_acquire(&key, Duration::from_secs(5)).await {
            Ok(attempt) => {
                lock.release(&acquired(attempt)).await.unwrap();
                break;
            }
            Err(e) if failures.len() < 16 => {
                assert!(e.is_transient(), "{e}");
                failures.push(e.to_string());
            }
            Err(e) => panic!(
                "{} requests failed after the node connection died, the last: {e}; {failures:?}",
                failures.len() + 1
            ),
        }
    }
    assert!(failures.len() <= 2, "{failures:?}");
    assert!(proxy.connections_accepted() > dead, "a new connection");

    // An evicting policy on one primary.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lfu")
        .query_async(&mut on_node)
        .await
        .unwrap();
    let err = connect(&url).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.message().contains("allkeys-lfu"), "{err}");
}
