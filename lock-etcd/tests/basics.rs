//! etcd-specific basics beyond the shared suite: TTL rounding, fencing
//! order, the key layout in the namespace, foreign values, a dead server,
//! and authentication through the URL. Real etcd servers started by the
//! harness (or `DISTLOCK_ETCD_URL` where the test does not need to control
//! the process).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    acquire, any_server, connect, endpoint, observed, own_server, raw_client, unique_key,
};
use distlock_conformance::naming::unique_name;
use distlock_conformance::server::{self, ServerProcess};
use distlock_core::{AcquireAttempt, ErrorKind, LockClient, LockKey};
use distlock_etcd::etcd_client::{self, Permission};
use distlock_etcd::EtcdLock;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_extend_release_and_fencing() {
    let server = any_server();
    let a = connect(&server.url()).await;
    let b = connect(&server.url()).await;
    let k = unique_key("basic");

    let first = acquire(&a, &k, Duration::from_millis(300)).await;
    // Rounded up to whole seconds.
    assert_eq!(first.ttl(), Duration::from_secs(1));
    assert!(matches!(
        b.try_acquire(&k, Duration::from_secs(5)).await.unwrap(),
        AcquireAttempt::Held { .. }
    ));

    // Extending keeps the fencing token and resets the TTL, also to a shorter one.
    let long = a
        .extend(&first, Duration::from_secs(30))
        .await
        .expect("extend");
    assert_eq!(long.fencing_token(), first.fencing_token());
    assert_eq!(long.ttl(), Duration::from_secs(30));
    let short = a
        .extend(&long, Duration::from_secs(1))
        .await
        .expect("extend shorter");
    assert_eq!(short.ttl(), Duration::from_secs(1));
    // The shorter TTL is real: the lock expires after about a second.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let second = acquire(&b, &k, Duration::from_secs(5)).await;
    assert!(second.fencing_token() > first.fencing_token());
    // The expired lease can neither be extended nor released; the new holder keeps it.
    assert_eq!(
        a.extend(&short, Duration::from_secs(5))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotHeld
    );
    assert_eq!(
        a.release(&short).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
    // A lease from another client is refused.
    assert_eq!(
        a.release(&second).await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );

    b.release(&second).await.expect("release");
    assert_eq!(
        b.release(&second).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
    assert_eq!(
        b.extend(&second, Duration::from_secs(5))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotHeld
    );
    let third = acquire(&a, &k, Duration::from_secs(5)).await;
    assert!(third.fencing_token() > second.fencing_token());
    a.release(&third).await.expect("release third");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_stay_in_namespace_and_foreign_values_are_reported() {
    let server = any_server();
    let url = server.url();
    let ns = unique_name("ns");
    let lock = connect(&format!("{url}?namespace={ns}")).await;
    let mut raw = raw_client(&url).await;

    let look_alikes = ["a", "a/b", "a%2Fb", "a:b", "a{b}", "ключ/🔒"];
    let mut leases = Vec::new();
    for k in look_alikes {
        leases.push(acquire(&lock, &LockKey::new(k).unwrap(), Duration::from_secs(10)).await);
    }
    let all = raw
        .get(
            ns.as_bytes(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    // The locks and the namespace's format marker.
    assert_eq!(all.kvs().len(), look_alikes.len() + 1);
    assert!(all
        .kvs()
        .iter()
        .any(|kv| kv.key() == format!("{ns}/lock/%format").as_bytes()));
    for kv in all.kvs() {
        let k = kv.key_str().unwrap();
        assert!(k.starts_with(&format!("{ns}/lock/")), "{k}");
        assert!(!k[ns.len() + 6..].contains('/'), "{k}");
    }
    for lease in &leases {
        lock.release(lease).await.unwrap();
    }

    // A value distlock did not write is reported and left alone.
    let foreign = LockKey::new("foreign").unwrap();
    let etcd_key = format!("{ns}/lock/foreign");
    raw.put(etcd_key.as_str(), "someone else's", None)
        .await
        .unwrap();
    let err = lock
        .try_acquire(&foreign, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted);
    // The client names the key (once), the backend says what it found.
    assert_eq!(err.key(), Some("foreign"), "{err}");
    assert_eq!(err.to_string().matches("foreign").count(), 1, "{err}");
    assert!(err.message().contains("did not write"), "{err}");
    // Our format but without a lease: would never expire.
    let no_lease = LockKey::new("no-lease").unwrap();
    raw.put(
        format!("{ns}/lock/no-lease"),
        format!("dl1:{}", "0".repeat(32)),
        None,
    )
    .await
    .unwrap();
    let err = lock
        .try_acquire(&no_lease, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted);
    let value = raw.get(etcd_key.as_str(), None).await.unwrap();
    assert_eq!(value.kvs()[0].value(), b"someone else's");
    common::delete_prefix(&mut raw, &ns).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_server_gives_unavailable_in_bounded_time() {
    let port = distlock_conformance::server::free_port().unwrap();
    let err = EtcdLock::connect(&format!("etcd://127.0.0.1:{port}?connect_timeout_ms=500"))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
}

/// An etcd with authentication: a root user and a lock user whose role may
/// only read and write the lock namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_through_the_url() {
    let server = own_server();
    let url = server.url();
    let ns = "authns";
    let prefix = format!("{ns}/lock/");
    {
        let mut admin = raw_client(&url).await;
        admin
            .user_add("root", "rootpw", None)
            .await
            .expect("add root");
        admin
            .user_grant_role("root", "root")
            .await
            .expect("grant root");
        admin.role_add("locker").await.expect("add role");
        admin
            .role_grant_permission(
                "locker",
                Permission::read_write(prefix.as_str()).with_prefix(),
            )
            .await
            .expect("grant permission");
        admin
            .user_add("locker", "p@ss:word", None)
            .await
            .expect("add user");
        admin
            .user_grant_role("locker", "locker")
            .await
            .expect("grant role");
        admin.auth_enable().await.expect("auth enable");
    }
    let addr = endpoint(&url);
    let good = format!("etcd://locker:p%40ss%3Aword@{addr}?namespace={ns}");
    let a = EtcdLock::connect(&good)
        .await
        .expect("connect with the lock user");
    assert_eq!(a.key_prefix(), prefix);
    let a = LockClient::new(a);
    let (b_attempts, b) = observed(&good).await;
    let k = unique_key("auth");
    let lease = acquire(&a, &k, Duration::from_secs(10)).await;
    let lease = a
        .extend(&lease, Duration::from_secs(10))
        .await
        .expect("extend");
    let waiter = async {
        b.acquire(
            &k,
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(20),
        )
        .await
    };
    let releaser = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        a.release(&lease).await
    };
    let (got, released) = tokio::join!(waiter, releaser);
    released.expect("release");
    let got = got.expect("waiter under auth").expect("acquired");
    assert!(b_attempts.attempts_in_line() <= 2);
    b.release(&got).await.unwrap();

    let wrong = format!("etcd://locker:nope@{addr}?namespace={ns}");
    let err = EtcdLock::connect(&wrong).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.message().contains("authentication failed"), "{err}");
    assert!(err.message().contains("user and password"), "{err}");

    // Outside its namespace the user has no permission: a clear config error.
    let outside = format!("etcd://locker:p%40ss%3Aword@{addr}?namespace=other");
    let err = EtcdLock::connect(&outside).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
}

/// A server whose database is full (etcd's `NOSPACE` alarm): a new
/// acquisition fails with a message that says how an operator frees space,
/// a holder still releases (a release only deletes), and once the
/// operator did what the message says (compact, defragment, disarm) locks
/// are taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_database_says_how_to_free_space() {
    use etcd_client::{AlarmAction, AlarmOptions, AlarmType, CompactionOptions};
    let server =
        ServerProcess::start(Arc::new(server::EtcdSpaceQuota(1 << 20))).expect("etcd must start");
    let client = connect(&server.url()).await;
    let held = acquire(&client, &unique_key("held-before"), Duration::from_secs(30)).await;
    // Fill it: values of 64 KiB until etcd refuses one.
    let mut raw = raw_client(&server.url()).await;
    let value = vec![b'x'; 64 << 10];
    let mut filled = false;
    for i in 0..200 {
        match raw.put(format!("filler/{i}"), value.clone(), None).await {
            Ok(_) => {}
            Err(e) => {
                assert!(e.to_string().contains("database space exceeded"), "{e}");
                filled = true;
                break;
            }
        }
    }
    assert!(filled, "a 1 MiB quota took 200 values of 64 KiB");

    let error = client
        .try_acquire(&unique_key("on-a-full-database"), Duration::from_secs(10))
        .await
        .expect_err("etcd refuses every write that adds data");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    for needed in [
        "--quota-backend-bytes",
        "etcdctl compact",
        "etcdctl defrag",
        "alarm disarm",
        "--auto-compaction-retention",
    ] {
        assert!(error.to_string().contains(needed), "{needed}: {error}");
    }
    client.release(&held).await.expect("a release only deletes");

    // What the message says.
    raw.delete(
        "filler/",
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .expect("deleted");
    let revision = raw
        .get("filler/", None)
        .await
        .expect("read")
        .header()
        .expect("a header")
        .revision();
    raw.compact(revision, Some(CompactionOptions::new().with_physical()))
        .await
        .expect("compacted");
    raw.defragment().await.expect("defragmented");
    let alarms = raw
        .alarm(AlarmAction::Get, AlarmType::None, None)
        .await
        .expect("alarms");
    for alarm in alarms.alarms() {
        let mut options = AlarmOptions::new();
        options.with_member(alarm.member_id());
        raw.alarm(AlarmAction::Deactivate, AlarmType::Nospace, Some(options))
            .await
            .expect("disarmed");
    }
    let again = acquire(
        &client,
        &unique_key("after-the-operator"),
        Duration::from_secs(10),
    )
    .await;
    client.release(&again).await.expect("released");
}
