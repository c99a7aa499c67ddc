//! Redis Cluster (issue 17): locks in every primary's slots (scripts and
//! `WAIT` on the slot's node, waiters subscribed to the slot's shard
//! channel there), and a primary SIGKILLed while a guard holds a lock in
//! its slots and a waiter waits for it: its replica is promoted and the
//! clients follow. One cluster of its own (three primaries, one replica
//! each), since a primary is killed.

use std::time::Duration;

use distlock_conformance::server::RedisCluster;
use distlock_core::{ErrorKind, LockKey};
use distlock_redis::redis::{self, aio::MultiplexedConnection, AsyncCommands};

use crate::support::*;

/// Short timeouts: a dead node is noticed fast.
const TIMEOUTS: &str = "connect_timeout_ms=1000&operation_timeout_ms=1000";

/// A fresh key whose lock lives in one of `slots`.
async fn key_in(conn: &mut MultiplexedConnection, slots: &[(u16, u16)], label: &str) -> LockKey {
    for _ in 0..10_000 {
        let key = unique(label);
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
