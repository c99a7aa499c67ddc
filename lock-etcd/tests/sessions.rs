//! Session leases: a renewing acquire is one round trip, its renewal one
//! confirming transaction, a lock its holder stops renewing still expires,
//! and the session lease ends with its client.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    acquire, acquire_renewing, addr_of, any_server, connect, grpc_started, own_server, raw_client,
    requests_between, unique_key,
};
use distlock_conformance::naming::unique_name;
use distlock_conformance::server::{self, ServerProcess};
use distlock_core::{
    AcquireAttempt, AcquireReply, AcquireRequest, ErrorKind, ExtendReply, FencingToken, HeldLock,
    LockBackend, LockKey, LockOptions, Locker, OwnerToken, PermitReply, PermitRequest,
    ReleaseReply, SemaphoreBackend,
};
use distlock_etcd::EtcdLock;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_acquire_is_one_round_trip_and_still_expires() {
    // A server of its own, so no other test's requests are counted.
    let server = own_server();
    let a = connect(&server.url()).await;
    let b = connect(&server.url()).await;
    let long = Duration::from_secs(30);
    let expect = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
        pairs.iter().map(|(m, n)| ((*m).to_owned(), *n)).collect()
    };

    // The first renewing acquire with a TTL starts the session: grant + txn.
    let before = grpc_started(server.addr()).await;
    let first = acquire_renewing(&a, &unique_key("rt"), long).await;
    let after = grpc_started(server.addr()).await;
    assert_eq!(
        requests_between(&before, &after),
        expect(&[("LeaseGrant", 1), ("Txn", 1)]),
        "first renewing acquire"
    );

    // Every further one is a single transaction on the session lease.
    let before = grpc_started(server.addr()).await;
    let second = acquire_renewing(&a, &unique_key("rt"), long).await;
    let after = grpc_started(server.addr()).await;
    assert_eq!(
        requests_between(&before, &after),
        expect(&[("Txn", 1)]),
        "second renewing acquire: one round trip"
    );
    assert_eq!(second.ttl(), first.ttl());

    // Renewing it with its TTL is one confirming transaction.
    let before = grpc_started(server.addr()).await;
    let renewed = a.extend(&second, second.ttl()).await.expect("extend");
    let after = grpc_started(server.addr()).await;
    assert_eq!(
        requests_between(&before, &after),
        expect(&[("Txn", 1)]),
        "renewal"
    );
    assert_eq!(renewed.fencing_token(), second.fencing_token());
    // The renewed lease keeps the session handle, so its next renewal is
    // one confirming transaction too.
    assert_eq!(renewed.handle(), second.handle());

    // A plain acquire keeps its own lease (exact TTL): grant + txn.
    let before = grpc_started(server.addr()).await;
    let plain = acquire(&a, &unique_key("rt"), long).await;
    let after = grpc_started(server.addr()).await;
    assert_eq!(
        requests_between(&before, &after),
        expect(&[("LeaseGrant", 1), ("Txn", 1)]),
        "plain acquire"
    );

    // Releasing a session lock deletes only it: the session lease is not
    // revoked, so the other lock on it stays held.
    a.release(&renewed).await.expect("release the second");
    assert!(matches!(
        b.try_acquire(first.key(), long).await.unwrap(),
        AcquireAttempt::Held { .. }
    ));
    a.release(&first).await.expect("release the first");
    a.release(&plain).await.expect("release the plain lock");

    // A renewing lock its holder stops renewing expires while the client
    // (and its session) lives on.
    let short = Duration::from_secs(1);
    let k = unique_key("unrenewed");
    let stale = acquire_renewing(&a, &k, short).await;
    let give_up = Instant::now() + Duration::from_secs(30);
    let taken = loop {
        if let AcquireAttempt::Acquired(lease) = b.try_acquire(&k, long).await.unwrap() {
            break lease;
        }
        assert!(Instant::now() < give_up, "the unrenewed lock never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(taken.fencing_token() > stale.fencing_token());
    assert_eq!(
        a.extend(&stale, stale.ttl()).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
    // The session is still there for new locks: one round trip.
    let before = grpc_started(server.addr()).await;
    let again = acquire_renewing(&a, &unique_key("rt"), short).await;
    let after = grpc_started(server.addr()).await;
    assert_eq!(
        requests_between(&before, &after),
        expect(&[("Txn", 1)]),
        "renewing acquire after an expiry"
    );
    a.release(&again).await.expect("release");
    b.release(&taken).await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_client_stops_its_session_keep_alive() {
    let server = any_server();
    let raw = raw_client(&server.url()).await;
    let a = connect(&server.url()).await;
    let lease = acquire_renewing(&a, &unique_key("session-drop"), Duration::from_secs(1)).await;
    // The handle is the session lease id with the top bit set.
    let session_lease = i64::try_from(lease.handle() & !(1 << 63)).expect("lease id");
    // etcd reports the remaining whole seconds (0 in the last second), and
    // -1 for a lease that no longer exists.
    let alive = |ttl: i64| ttl >= 0;
    let mut leases = raw.lease_client();
    // Kept alive while the client lives, well past its 1 s TTL.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ttl = leases
        .time_to_live(session_lease, None)
        .await
        .unwrap()
        .ttl();
    assert!(
        alive(ttl),
        "the session lease must be kept alive (ttl {ttl})"
    );
    drop(a);
    // Dropped: its keep-alive task stops and etcd expires the lease.
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let ttl = leases
            .time_to_live(session_lease, None)
            .await
            .unwrap()
            .ttl();
        if !alive(ttl) {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "the session lease outlived its client"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A renewing permit (what a permit guard takes) goes on the session lease
/// as a renewing lock does (a read and one transaction), and renewing it
/// with its TTL is one confirming transaction: no lease granted, moved to
/// or revoked. A permit deleted
/// behind its holder's back is not held at its next renewal; another TTL
/// moves a permit to a lease of its own; releasing one leaves the session
/// lease (and the other permits on it) alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_permit_renewal_is_one_confirming_request() {
    // A server of its own, so no other test's requests are counted.
    let server = own_server();
    let lock = EtcdLock::connect(&server.url()).await.expect("connect");
    let mut raw = raw_client(&server.url()).await;
    let long = Duration::from_secs(30);
    let key = unique_key("sem-session");
    let mut held = Vec::new();
    for n in 0..3 {
        let owner = OwnerToken::random();
        let request = PermitRequest {
            key: &key,
            owner,
            ttl: long,
            limit: 3,
            renewing: true,
            settling: false,
            holder: None,
        };
        let before = grpc_started(server.addr()).await;
        let reply = lock.acquire_permit(request).await.expect("permit");
        let after = grpc_started(server.addr()).await;
        // A read, then one transaction on the session lease (granted by
        // the first).
        let mut expected = BTreeMap::from([("Range".to_owned(), 1), ("Txn".to_owned(), 1)]);
        if n == 0 {
            expected.insert("LeaseGrant".to_owned(), 1);
        }
        assert_eq!(
            requests_between(&before, &after),
            expected,
            "renewing permit attempt {n}"
        );
        match reply {
            PermitReply::Granted(grant) => held.push(HeldLock {
                key: &key,
                owner,
                fencing: grant.fencing,
                handle: grant.handle,
            }),
            reply => panic!("a renewing permit of a free semaphore: {reply:?}"),
        }
    }
    let [first, deleted, other] = held[..] else {
        unreachable!("three permits were taken");
    };
    assert!(
        first.handle == deleted.handle && first.handle == other.handle,
        "renewing permits with one TTL share the session lease"
    );

    for renewal in 1..=2 {
        let before = grpc_started(server.addr()).await;
        let reply = lock.extend_permit(first, long).await.expect("extend");
        let after = grpc_started(server.addr()).await;
        assert_eq!(
            requests_between(&before, &after),
            BTreeMap::from([("Txn".to_owned(), 1)]),
            "renewal {renewal} of a session permit with its TTL"
        );
        let ExtendReply::Extended(grant) = reply else {
            panic!("a held permit was not extended: {reply:?}");
        };
        assert_eq!(grant.fencing, first.fencing);
        // Still on the session lease, so its next renewal is one request too.
        assert_eq!(grant.handle, first.handle);
    }

    // Deleted behind its holder's back (as a force release does): not held.
    // Named by the client: found by the owner in its value.
    let permits = raw
        .get(
            format!("{}%sem/{key}/permits/", lock.key_prefix()),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("read the permits");
    let owner_value = format!("dl1:{}/", deleted.owner.to_hex());
    let permit_key = permits
        .kvs()
        .iter()
        .find(|kv| kv.value().starts_with(owner_value.as_bytes()))
        .expect("the permit to delete")
        .key()
        .to_vec();
    let gone = raw.delete(permit_key, None).await.expect("raw delete");
    assert_eq!(gone.deleted(), 1, "the permit's etcd key");
    let reply = lock.extend_permit(deleted, long).await.expect("extend");
    assert_eq!(reply, ExtendReply::NotHeld, "a deleted permit was renewed");

    // Another TTL moves it to a lease of exactly that TTL.
    let before = grpc_started(server.addr()).await;
    let reply = lock
        .extend_permit(first, Duration::from_secs(20))
        .await
        .expect("extend with another TTL");
    let after = grpc_started(server.addr()).await;
    let moved = requests_between(&before, &after);
    assert_eq!(moved.get("LeaseGrant"), Some(&1), "moved: {moved:?}");
    let ExtendReply::Extended(grant) = reply else {
        panic!("a held permit was not moved: {reply:?}");
    };
    assert_ne!(grant.handle, first.handle, "still on the session lease");
    let first = HeldLock {
        handle: grant.handle,
        ..first
    };

    // Releasing a permit does not revoke the session lease: the other
    // permit on it is still held.
    assert_eq!(
        lock.release_permit(first).await.expect("release"),
        ReleaseReply::Released
    );
    assert!(matches!(
        lock.extend_permit(other, long).await.expect("extend"),
        ExtendReply::Extended(_)
    ));
    assert_eq!(
        lock.release_permit(other).await.expect("release"),
        ReleaseReply::Released
    );
}

/// Renewing locks of `lock` on ten fresh keys, all on its session lease,
/// each of an acquisition (an owner token) of its own, as guards' are.
async fn ten_renewing_locks(lock: &EtcdLock) -> Vec<(LockKey, OwnerToken, u64, u64)> {
    let mut taken = Vec::new();
    for n in 0..10 {
        let key = unique_key(&format!("batch-{n}"));
        let owner = OwnerToken::random();
        let request = AcquireRequest {
            key: &key,
            owner,
            ttl: Duration::from_secs(30),
            renewing: true,
            settling: false,
            holder: None,
        };
        match lock.acquire(request).await.expect("acquire") {
            AcquireReply::Granted(grant) => {
                taken.push((key, owner, grant.fencing.get(), grant.handle));
            }
            reply => panic!("a renewing lock of a free key: {reply:?}"),
        }
    }
    taken
}

/// The batched renewal of 10 session locks whose 4th key was deleted
/// behind the client's back, with `foreign` keys of someone else's right
/// after each lock's key (inside any range read over two of them): one
/// answer per lock, only that one not held.
async fn renew_ten_with_one_gone(
    url: &str,
    foreign: usize,
) -> (Vec<ExtendReply>, BTreeMap<String, u64>) {
    let ns = unique_name("batch");
    let lock = EtcdLock::connect(&format!("{url}?namespace={ns}"))
        .await
        .expect("connect");
    let taken = ten_renewing_locks(&lock).await;
    let mut raw = raw_client(url).await;
    for (key, ..) in &taken {
        for n in 0..foreign {
            raw.put(format!("{ns}/lock/{key}/other-{n:03}"), "x", None)
                .await
                .expect("a foreign key");
        }
    }
    // Test keys need no escaping.
    let gone = format!("{ns}/lock/{}", taken[3].0);
    raw.delete(gone, None)
        .await
        .expect("delete behind its back");
    let held: Vec<HeldLock<'_>> = taken
        .iter()
        .map(|(key, owner, fencing, handle)| HeldLock {
            key,
            owner: *owner,
            fencing: FencingToken::new(*fencing),
            handle: *handle,
        })
        .collect();
    let before = grpc_started(addr_of(url)).await;
    let replies = lock
        .extend_many(&held, Duration::from_secs(30))
        .await
        .expect("the batch is answered");
    let after = grpc_started(addr_of(url)).await;
    let replies = replies
        .into_iter()
        .map(|reply| reply.expect("no lock's data is foreign"))
        .collect();
    (replies, requests_between(&before, &after))
}

fn assert_only_the_fourth_gone(replies: &[ExtendReply]) {
    assert_eq!(replies.len(), 10);
    for (n, reply) in replies.iter().enumerate() {
        match (n, reply) {
            (3, ExtendReply::NotHeld) => {}
            (3, reply) => panic!("the deleted lock was answered {reply:?}"),
            (_, ExtendReply::Extended(_)) => {}
            (n, reply) => panic!("lock {n} was answered {reply:?}"),
        }
    }
}

/// Ten renewing guards' locks renew in one transaction of reads, and each
/// is answered alone: the one deleted behind the client's back is not
/// held, the nine others are extended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_locks_renew_in_one_request_each_answered_alone() {
    let server = own_server();
    let (replies, requests) = renew_ten_with_one_gone(&server.url(), 0).await;
    assert_only_the_fourth_gone(&replies);
    assert_eq!(
        requests,
        BTreeMap::from([("Txn".to_owned(), 1)]),
        "ten renewals in one request"
    );
}

/// A server that takes at most 8 operations a transaction (etcd's
/// `--max-txn-ops`, 128 by default): the batch is refused, read nothing,
/// and is sent again in smaller transactions; every lock is still
/// answered alone. (Before, every batched renewal failed on such a
/// server, and each guard lost its lock.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_batches_fit_a_server_with_fewer_txn_ops() {
    let server = ServerProcess::start(Arc::new(server::EtcdMaxTxnOps(8))).expect("etcd must start");
    let (replies, requests) = renew_ten_with_one_gone(&server.url(), 0).await;
    assert_only_the_fourth_gone(&replies);
    // 10 reads refused, then 5 range reads of 2 keys each.
    assert_eq!(
        requests,
        BTreeMap::from([("Txn".to_owned(), 2)]),
        "refused once, then fewer reads"
    );
}

/// Range reads cut short by someone else's keys between ours: each range
/// over two locks (a server taking 8 operations a transaction) returns the
/// first lock and its 30 neighbours up to the range's limit, not the
/// second lock; the locks not reached are read again alone, never taken
/// for gone. (A lock a range did not reach must not read as deleted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_cut_short_are_read_again_key_by_key() {
    let server = ServerProcess::start(Arc::new(server::EtcdMaxTxnOps(8))).expect("etcd must start");
    let (replies, requests) = renew_ten_with_one_gone(&server.url(), 30).await;
    assert_only_the_fourth_gone(&replies);
    // Refused; 5 ranges, each cut short; the 5 second keys alone.
    assert_eq!(
        requests,
        BTreeMap::from([("Txn".to_owned(), 3)]),
        "refused, ranges, then the keys not reached"
    );
}

/// On a server that takes fewer operations a transaction than a renewing
/// acquire sends, the acquire fails at once with a configuration error
/// that names the setting to raise (it was a transient "unavailable",
/// which callers retry for as long as they wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_txn_ops_is_a_configuration_error() {
    let server = ServerProcess::start(Arc::new(server::EtcdMaxTxnOps(2))).expect("etcd must start");
    let client = connect(&server.url()).await;
    let error = client
        .try_acquire_renewing(&unique_key("few-ops"), Duration::from_secs(10))
        .await
        .expect_err("a transaction above the server's limit");
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(error.to_string().contains("--max-txn-ops"), "{error}");
}

/// A waiter's grant (its entry leaves with it, and an adoption step nests
/// beside it) fits a server that takes 8 operations a transaction (the
/// least distlock asks for), on its own lease and on the session lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiters_grant_fits_a_server_with_eight_txn_ops() {
    let server = ServerProcess::start(Arc::new(server::EtcdMaxTxnOps(8))).expect("etcd must start");
    let holder = connect(&server.url()).await;
    for renewing in [false, true] {
        let key = unique_key("eight-ops");
        let held = acquire(&holder, &key, Duration::from_secs(30)).await;
        let waiter = connect(&server.url()).await;
        let waiting = {
            let (waiter, key) = (waiter.clone(), key.clone());
            tokio::spawn(async move {
                let ttl = Duration::from_secs(10);
                if renewing {
                    let options = LockOptions::new(ttl).with_wait(Duration::from_secs(20));
                    let guard = Locker::new(waiter).acquire(&key, &options).await?;
                    guard.expect("acquired before the deadline").release().await
                } else {
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let lease = waiter.acquire(&key, ttl, deadline).await?;
                    waiter
                        .release(&lease.expect("acquired before the deadline"))
                        .await
                }
            })
        };
        // Queued behind the holder, then handed the lock.
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.release(&held).await.expect("release");
        waiting
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("renewing {renewing}: {e}"));
    }
}
