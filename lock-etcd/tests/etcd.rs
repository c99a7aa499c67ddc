//! etcd-specific tests beyond the shared suite, against real etcd servers
//! started by the harness (or `DISTLOCK_ETCD_URL` where the test does not
//! need to control the process).

use std::sync::Arc;
use std::time::{Duration, Instant};

use conformance_tests::fault::Proxy;
use conformance_tests::server::{self, ServerHandle, ServerProcess};
use conformance_tests::ObservedLock;
use lock_core::{AcquireAttempt, DistributedLock, ErrorKind, Lease, LockKey};
use lock_etcd::etcd_client::{self, Client, Permission};
use lock_etcd::EtcdLock;

fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

fn key(label: &str) -> LockKey {
    LockKey::new(format!("{label}-{:016x}", random())).expect("valid key")
}

/// A server for tests that do not control the process.
fn any_server() -> ServerHandle {
    ServerHandle::from_env_or_start(Arc::new(server::Etcd)).expect("etcd must start")
}

/// A server this test owns (kill, restart, auth setup).
fn own_server() -> ServerProcess {
    ServerProcess::start(Arc::new(server::Etcd)).expect("etcd must start")
}

fn endpoint(url: &str) -> String {
    url.strip_prefix("etcd://")
        .expect("etcd URL")
        .split('?')
        .next()
        .unwrap_or_default()
        .to_owned()
}

async fn raw_client(url: &str) -> Client {
    Client::connect([endpoint(url)], None)
        .await
        .expect("raw etcd client")
}

async fn acquire(lock: &EtcdLock, key: &LockKey, ttl: Duration) -> Lease {
    match lock.try_acquire(key, ttl).await.expect("try_acquire") {
        AcquireAttempt::Acquired(lease) => lease,
        AcquireAttempt::Held { .. } => panic!("{key} unexpectedly held"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_extend_release_and_fencing() {
    let server = any_server();
    let a = EtcdLock::connect(&server.url()).await.expect("connect a");
    let b = EtcdLock::connect(&server.url()).await.expect("connect b");
    let k = key("basic");

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
    let ns = format!("ns{:x}", random() as u32);
    let lock = EtcdLock::connect(&format!("{url}?namespace={ns}"))
        .await
        .expect("connect");
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
    assert_eq!(all.kvs().len(), look_alikes.len());
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
    assert!(err.message().contains("foreign"), "{err}");
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
    raw.delete(
        ns.as_bytes(),
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
}

/// A waiter blocked for 2 s makes at most 2 attempts: it is woken by the
/// watch, not by polling. The operation timeout is shorter than the wait,
/// so the watch stream must outlive it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_the_server_not_polling() {
    let server = any_server();
    let url = format!("{}?operation_timeout_ms=500", server.url());
    let holder = EtcdLock::connect(&url).await.expect("holder");
    let waiter = Arc::new(ObservedLock::new(Arc::new(
        EtcdLock::connect(&url).await.expect("waiter"),
    )));
    let k = key("wake");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;

    let task = {
        let waiter = waiter.clone();
        let k = k.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            waiter.acquire(&k, Duration::from_secs(30), deadline).await
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(waiter.attempts(), 1, "no polling while held");
    holder.release(&held).await.expect("release");
    let lease = task
        .await
        .unwrap()
        .expect("acquire")
        .expect("acquired before the deadline");
    assert!(lease.fencing_token() > held.fencing_token());
    let attempts = waiter.attempts();
    assert!(attempts <= 2, "{attempts} attempts");
    waiter.release(&lease).await.unwrap();
}

/// A holder that stops renewing (crashed) is noticed when etcd expires its
/// lease: the deletion wakes the waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_lease_expiry() {
    let server = any_server();
    let holder = EtcdLock::connect(&server.url()).await.expect("holder");
    let waiter = ObservedLock::new(Arc::new(
        EtcdLock::connect(&server.url()).await.expect("waiter"),
    ));
    let k = key("expiry");
    let held = acquire(&holder, &k, Duration::from_secs(2)).await;
    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(20);
    let lease = waiter
        .acquire(&k, Duration::from_secs(5), deadline)
        .await
        .expect("acquire")
        .expect("acquired after expiry");
    assert!(lease.fencing_token() > held.fencing_token());
    assert!(waiter.attempts() <= 2);
}

/// Fencing tokens survive a restart; a waiter's watch reconnects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_fencing_order_and_watches_reconnect() {
    let server = own_server();
    let url = format!(
        "{}?operation_timeout_ms=1000&connect_timeout_ms=1000",
        server.url()
    );
    let holder = EtcdLock::connect(&url).await.expect("holder");
    let waiter = Arc::new(EtcdLock::connect(&url).await.expect("waiter"));
    let k = key("restart");
    let before = acquire(&holder, &k, Duration::from_secs(30)).await;

    let task = {
        let waiter = waiter.clone();
        let k = k.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(25);
            waiter.acquire(&k, Duration::from_secs(30), deadline).await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| server.kill());
    // A dead server gives a typed error in bounded time.
    let err = holder
        .extend(&before, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    tokio::task::block_in_place(|| server.restart()).expect("restart");
    // The holder's lock survived (etcd keeps leases across restarts).
    let mut renewed = None;
    for _ in 0..50 {
        match holder.extend(&before, Duration::from_secs(30)).await {
            Ok(lease) => {
                renewed = Some(lease);
                break;
            }
            Err(e) if e.is_transient() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("extend after restart: {e}"),
        }
    }
    let renewed = renewed.expect("the client reconnects after a restart");
    // Give the waiter's watch time to be re-created, then release.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    holder
        .release(&renewed)
        .await
        .expect("release after restart");
    let after = task
        .await
        .unwrap()
        .expect("acquire across restart")
        .expect("woken after the release");
    assert!(after.fencing_token() > before.fencing_token());
    waiter.release(&after).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_server_gives_unavailable_in_bounded_time() {
    let port = server::free_port().unwrap();
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
    let b = ObservedLock::new(Arc::new(
        EtcdLock::connect(&good).await.expect("second client"),
    ));
    assert_eq!(a.key_prefix(), prefix);
    let k = key("auth");
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
    assert!(b.attempts() <= 2);
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

/// etcd's per-method gRPC request counters (`grpc_server_started_total`),
/// read from its Prometheus endpoint on the client port with a plain
/// HTTP/1.0 GET.
async fn grpc_started(addr: std::net::SocketAddr) -> std::collections::BTreeMap<String, u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to etcd's metrics endpoint");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("send the metrics request");
    let mut body = String::new();
    stream
        .read_to_string(&mut body)
        .await
        .expect("read the metrics");
    let mut counts = std::collections::BTreeMap::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("grpc_server_started_total{") else {
            continue;
        };
        let method = rest
            .split("grpc_method=\"")
            .nth(1)
            .and_then(|m| m.split('"').next())
            .expect("grpc_method label");
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .expect("counter value");
        *counts.entry(method.to_owned()).or_insert(0) += value as u64;
    }
    assert!(
        counts.contains_key("Range") || counts.contains_key("Txn"),
        "etcd's /metrics has no grpc_server_started_total counters: {body:.500}"
    );
    counts
}

/// The gRPC requests started between two counter readings, by method,
/// without the keep-alive stream (its messages are not requests).
fn requests_between(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(method, _)| method.as_str() != "LeaseKeepAlive")
        .map(|(method, n)| (method.clone(), n - before.get(method).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_acquire_is_one_round_trip_and_still_expires() {
    // A server of its own, so no other test's requests are counted.
    let server = own_server();
    let a = EtcdLock::connect(&server.url()).await.expect("connect a");
    let b = EtcdLock::connect(&server.url()).await.expect("connect b");
    let long = Duration::from_secs(30);
    let expect = |pairs: &[(&str, u64)]| -> std::collections::BTreeMap<String, u64> {
        pairs.iter().map(|(m, n)| ((*m).to_owned(), *n)).collect()
    };

    // The first renewing acquire with a TTL starts the session: grant + txn.
    let before = grpc_started(server.addr()).await;
    let AcquireAttempt::Acquired(first) = a.try_acquire_renewing(&key("rt"), long).await.unwrap()
    else {
        panic!("a free key must be acquired");
    };
    let after = grpc_started(server.addr()).await;
    assert_eq!(
        requests_between(&before, &after),
        expect(&[("LeaseGrant", 1), ("Txn", 1)]),
        "first renewing acquire"
    );

    // Every further one is a single transaction on the session lease.
    let before = grpc_started(server.addr()).await;
    let AcquireAttempt::Acquired(second) = a.try_acquire_renewing(&key("rt"), long).await.unwrap()
    else {
        panic!("a free key must be acquired");
    };
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

    // A plain acquire keeps its own lease (exact TTL): grant + txn.
    let before = grpc_started(server.addr()).await;
    let plain = acquire(&a, &key("rt"), long).await;
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
    let k = key("unrenewed");
    let AcquireAttempt::Acquired(stale) = a.try_acquire_renewing(&k, short).await.unwrap() else {
        panic!("a free key must be acquired");
    };
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
    let AcquireAttempt::Acquired(again) = a.try_acquire_renewing(&key("rt"), short).await.unwrap()
    else {
        panic!("a free key must be acquired");
    };
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
    let a = EtcdLock::connect(&server.url()).await.expect("connect a");
    let AcquireAttempt::Acquired(lease) = a
        .try_acquire_renewing(&key("session-drop"), Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a free key must be acquired");
    };
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

/// gRPC requests per handoff with `waiters` waiters, each in its own client:
/// a holder releases, the first waiter acquires, holds briefly and releases,
/// the next acquires, and so on. Counts everything started from the moment
/// every waiter waits until the last one released (background deletes and
/// revokes included), divided by the number of handoffs.
async fn requests_per_handoff(
    server: &ServerProcess,
    waiters: usize,
) -> std::collections::BTreeMap<String, f64> {
    let holder = EtcdLock::connect(&server.url()).await.expect("holder");
    let k = key("handoff");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    let mut clients = Vec::new();
    for _ in 0..waiters {
        clients.push(Arc::new(ObservedLock::new(Arc::new(
            EtcdLock::connect(&server.url()).await.expect("waiter"),
        ))));
    }
    let tasks: Vec<_> = clients
        .iter()
        .map(|client| {
            let client = client.clone();
            let k = k.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(60);
                let lease = client
                    .acquire(&k, Duration::from_secs(30), deadline)
                    .await
                    .expect("acquire")
                    .expect("acquired before the deadline");
                tokio::time::sleep(Duration::from_millis(30)).await;
                client.release(&lease).await.expect("release");
                lease.fencing_token()
            })
        })
        .collect();
    // Every waiter has made its first attempt (so it is subscribed and queued).
    while clients.iter().any(|c| c.attempts() == 0) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = grpc_started(server.addr()).await;
    holder.release(&held).await.expect("release the holder");
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.push(task.await.expect("waiter task"));
    }
    // Background deletes and revokes.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = grpc_started(server.addr()).await;
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), waiters, "every waiter acquired once");
    for client in &clients {
        let attempts = client.attempts();
        assert!(attempts <= 3, "a waiter made {attempts} attempts");
    }
    requests_between(&before, &after)
        .into_iter()
        .map(|(method, n)| (method, n as f64 / waiters as f64))
        .collect()
}

/// FIFO wake-up: each waiter watches only its predecessor in the queue, so
/// the key-value requests per handoff do not grow with the number of waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_cost_is_constant_in_the_number_of_waiters() {
    // A server of its own, so no other test's requests are counted.
    let server = own_server();
    let kv = |counts: &std::collections::BTreeMap<String, f64>| -> f64 {
        ["Txn", "Range", "Put", "DeleteRange"]
            .iter()
            .map(|m| counts.get(*m).copied().unwrap_or(0.0))
            .sum()
    };
    let mut per_size = Vec::new();
    for waiters in [1usize, 8, 16] {
        let counts = requests_per_handoff(&server, waiters).await;
        eprintln!("requests per handoff with {waiters} waiters: {counts:?}");
        per_size.push((waiters, kv(&counts), counts));
    }
    for (waiters, total, counts) in &per_size {
        // Per handoff: release (Txn), acquire (Txn), the leaving waiter's
        // queue entry (DeleteRange), its successor's look-up (Txn); the
        // acquire's lease grant and the released lease's revoke.
        assert!(
            *total <= 4.0,
            "{waiters} waiters: {total} key-value requests per handoff: {counts:?}"
        );
        let grants = counts.get("LeaseGrant").copied().unwrap_or(0.0);
        assert!(grants <= 1.0, "{waiters} waiters: {counts:?}");
    }
}

/// The keys under `prefix`, read with a raw client.
async fn keys_under(raw: &mut Client, prefix: &str) -> Vec<String> {
    raw.get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .expect("raw range")
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect()
}

/// Waits until no queue entries are left under `queue` (waiters delete
/// theirs in the background); panics if some are still there after 10 s.
async fn assert_queue_empties(raw: &mut Client, queue: &str) {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let left = keys_under(raw, queue).await;
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < give_up,
            "{} queue entries left behind: {left:?}",
            left.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waiters acquire in the order they started waiting, and leave no queue
/// entries behind: neither those that acquired nor one that gave up at its
/// deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_acquire_in_fifo_order_and_leave_no_queue_entries() {
    let server = any_server();
    let ns = format!("fifo{:x}", random() as u32);
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = EtcdLock::connect(&url).await.expect("holder");
    let k = LockKey::new("queue/of a").unwrap();
    let queue = format!("{ns}/lock/queue%2Fof a/waiters/");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;

    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5usize {
        let client = Arc::new(ObservedLock::new(Arc::new(
            EtcdLock::connect(&url).await.expect("waiter"),
        )));
        let task = {
            let client = client.clone();
            let k = k.clone();
            let order = order.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(30);
                let lease = client
                    .acquire(&k, Duration::from_secs(30), deadline)
                    .await
                    .expect("acquire")
                    .expect("acquired");
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(20)).await;
                client.release(&lease).await.expect("release");
                client.attempts()
            })
        };
        // Queued (its first attempt made) before the next one starts.
        while client.attempts() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tasks.push(task);
    }
    assert_eq!(
        keys_under(&mut raw, &queue).await.len(),
        5,
        "one entry per waiter"
    );
    // A waiter that gives up at its deadline leaves the queue.
    let quitter = EtcdLock::connect(&url).await.expect("quitter");
    let gave_up = quitter
        .acquire(
            &k,
            Duration::from_secs(30),
            Instant::now() + Duration::from_millis(300),
        )
        .await
        .expect("acquire with a short deadline");
    assert!(gave_up.is_none());

    holder.release(&held).await.expect("release");
    for task in tasks {
        let attempts = task.await.expect("waiter task");
        assert!(attempts <= 2, "a waiter made {attempts} attempts");
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert_queue_empties(&mut raw, &queue).await;
}

/// Waiters on look-alike keys (`a` and `a/b`) never see each other's queue
/// or releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_look_alike_keys_are_independent() {
    let server = any_server();
    let ns = format!("alike{:x}", random() as u32);
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = EtcdLock::connect(&url).await.expect("holder");
    let a = LockKey::new("a").unwrap();
    let ab = LockKey::new("a/b").unwrap();
    let held_ab = acquire(&holder, &ab, Duration::from_secs(30)).await;
    let held_a = acquire(&holder, &a, Duration::from_secs(30)).await;

    let wait_on = |key: LockKey| {
        let url = url.clone();
        async move {
            let client = Arc::new(ObservedLock::new(Arc::new(
                EtcdLock::connect(&url).await.expect("waiter"),
            )));
            let task = {
                let client = client.clone();
                tokio::spawn(async move {
                    client
                        .acquire(
                            &key,
                            Duration::from_secs(30),
                            Instant::now() + Duration::from_secs(30),
                        )
                        .await
                })
            };
            while client.attempts() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (client, task)
        }
    };
    let (on_a, task_a) = wait_on(a.clone()).await;
    let (on_ab, task_ab) = wait_on(ab.clone()).await;
    assert_eq!(
        keys_under(&mut raw, &format!("{ns}/lock/a/")).await.len(),
        1
    );
    assert_eq!(
        keys_under(&mut raw, &format!("{ns}/lock/a%2Fb/"))
            .await
            .len(),
        1
    );

    // Releasing `a` wakes its waiter only.
    holder.release(&held_a).await.expect("release a");
    let got_a = task_a
        .await
        .unwrap()
        .expect("acquire a")
        .expect("acquired a");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(on_ab.attempts(), 1, "a/b waiter woken by a");
    on_a.release(&got_a).await.unwrap();
    holder.release(&held_ab).await.expect("release a/b");
    let got_ab = task_ab
        .await
        .unwrap()
        .expect("acquire a/b")
        .expect("acquired a/b");
    assert_eq!(on_ab.attempts(), 2);
    on_ab.release(&got_ab).await.unwrap();
    raw.delete(
        ns.as_bytes(),
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
}

/// The server address in an `etcd://` URL.
fn addr_of(url: &str) -> std::net::SocketAddr {
    endpoint(url).parse().expect("an etcd URL with IP:port")
}

/// A client whose connections go through a fault proxy in front of `server`.
async fn behind_proxy(server: &ServerHandle, query: &str) -> (Proxy, EtcdLock) {
    let proxy = Proxy::start(addr_of(&server.url()))
        .await
        .expect("fault proxy");
    let client = EtcdLock::connect(&format!("etcd://{}?{query}", proxy.addr()))
        .await
        .expect("connect through the proxy");
    (proxy, client)
}

/// A loopback TCP proxy in front of one server that forwards requests at
/// once but can hold back every reply: a one-way partition, as when a
/// server's answers are lost (a leader election that leaves keep-alives
/// unanswered). Unlike a black hole in both directions, requests still
/// take effect on the server, in the order they were sent.
struct ReplyGate {
    addr: std::net::SocketAddr,
    held: tokio::sync::watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl ReplyGate {
    async fn start(server: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the reply gate");
        let addr = listener.local_addr().expect("reply gate address");
        let (held, gate) = tokio::sync::watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(server).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = upstream.into_split();
                tokio::spawn(Self::forward(client_read, server_write, None));
                tokio::spawn(Self::forward(server_read, client_write, Some(gate.clone())));
            }
        });
        Self { addr, held, accept }
    }

    /// Copies `from` to `to`, waiting while `gate` says replies are held.
    async fn forward(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut gate: Option<tokio::sync::watch::Receiver<bool>>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Some(gate) = gate.as_mut() {
                if gate.wait_for(|held| !*held).await.is_err() {
                    return;
                }
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    fn hold(&self) {
        self.held.send_replace(true);
    }

    fn release(&self) {
        self.held.send_replace(false);
    }
}

impl Drop for ReplyGate {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// How long after the replies are cut [`kill_session_during`] sends the
/// request: well after the last keep-alive that can still be answered.
const SEND_AFTER_CUT: Duration = Duration::from_millis(700);
/// How long after the session's client-side deadline the replies flow again.
const HEAL_AFTER_DEATH: Duration = Duration::from_millis(300);

/// Kills the etcd session of a client behind `gate` while `request` is in
/// flight: holds every reply, so the client's keep-alives go unanswered
/// (they still reach the server, which keeps the lease), sends `request` a
/// moment later (the server applies it on the live session lease), and lets
/// the replies through only after the client's deadline for the session
/// (at most `session_ttl` after the cut) has passed. By then the client has
/// given the session up and revoked its lease on the server, so whatever
/// `request` put on it is gone; its reply reaches a client whose session is
/// dead. Returns the request's output.
async fn kill_session_during<T>(
    gate: &ReplyGate,
    session_ttl: Duration,
    request: impl std::future::Future<Output = T>,
) -> T {
    gate.hold();
    let cut_at = Instant::now();
    let send = async {
        tokio::time::sleep(SEND_AFTER_CUT).await;
        request.await
    };
    let heal = async {
        tokio::time::sleep_until((cut_at + session_ttl + HEAL_AFTER_DEATH).into()).await;
        gate.release();
    };
    let (output, ()) = tokio::join!(send, heal);
    output
}

/// Another client tries `key` until `until`; panics if it gets the lock
/// while the first holder's lease (valid until `until`) still claims it.
async fn assert_not_taken_before(other: &EtcdLock, key: &LockKey, until: Instant) {
    while Instant::now() < until {
        if let Ok(AcquireAttempt::Acquired(taken)) =
            other.try_acquire(key, Duration::from_secs(30)).await
        {
            let left = until.saturating_duration_since(Instant::now());
            assert!(
                left.is_zero(),
                "another client acquired {key} while the first lease still had {left:?} left"
            );
            other.release(&taken).await.expect("release");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Another client acquires `key` (and releases it) within 15 s.
async fn assert_freed(other: &EtcdLock, key: &LockKey, why: &str) {
    let give_up = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(AcquireAttempt::Acquired(taken)) =
            other.try_acquire(key, Duration::from_secs(30)).await
        {
            other.release(&taken).await.expect("release");
            return;
        }
        assert!(Instant::now() < give_up, "{key} never freed: {why}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client `a` whose connections go through a [`ReplyGate`] in front of
/// `server` (with `query` in its URL), and a direct client `b`.
async fn gated_clients(server: &ServerHandle, query: &str) -> (ReplyGate, EtcdLock, EtcdLock) {
    let gate = ReplyGate::start(addr_of(&server.url())).await;
    let a = EtcdLock::connect(&format!("etcd://{}?{query}", gate.addr))
        .await
        .expect("connect a through the reply gate");
    let b = EtcdLock::connect(&server.url()).await.expect("connect b");
    (gate, a, b)
}

/// Makes sure `lock` has a live session for `ttl`, its keep-alives answered.
async fn warm_session(lock: &EtcdLock, ttl: Duration) {
    let AcquireAttempt::Acquired(warm) = lock
        .try_acquire_renewing(&key("session-warm"), ttl)
        .await
        .expect("renewing acquire")
    else {
        panic!("a free key must be acquired");
    };
    lock.release(&warm).await.expect("release");
}

/// Issue 12, bug 1: a renewing acquire whose session dies while its
/// transaction is in flight must not return a lease dated from the send
/// time: the dead session's lease is revoked (deleting the key), so another
/// client can take the lock at once. The acquire is refused (transient
/// error), or its lease is already expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_acquire_on_a_session_that_dies_in_flight_gets_no_live_lease() {
    let server = any_server();
    let (gate, a, b) = gated_clients(&server, "operation_timeout_ms=8000").await;
    let ttl = Duration::from_secs(2);
    for round in 0..2 {
        warm_session(&a, ttl).await;
        let k = key("session-dies");
        let outcome = kill_session_during(&gate, ttl, a.try_acquire_renewing(&k, ttl)).await;
        match outcome {
            Ok(AcquireAttempt::Acquired(lease)) => {
                eprintln!(
                    "round {round}: acquired, {:?} left on the lease",
                    lease
                        .valid_until()
                        .saturating_duration_since(Instant::now())
                );
                assert_not_taken_before(&b, &k, lease.valid_until()).await;
                let _ = a.release(&lease).await;
            }
            Ok(AcquireAttempt::Held { .. }) => panic!("round {round}: {k} was free"),
            Err(e) => {
                eprintln!("round {round}: refused: {e}");
                assert!(e.is_transient(), "round {round}: {e}");
            }
        }
        // Either way the key does not stay held by the dead session.
        assert_freed(&b, &k, "the dead session's lock").await;
    }
}

/// A waiting acquire (30 s TTL, 20 s deadline) running in a task.
struct Waiting {
    task: tokio::task::JoinHandle<Result<Option<Lease>, lock_core::LockError>>,
    deadline: Instant,
}

impl Waiting {
    /// Starts one on `waiter`; returns once it made its first attempt (so
    /// it is queued and its watch is live).
    async fn start(waiter: &Arc<ObservedLock>, key: &LockKey) -> Self {
        let deadline = Instant::now() + Duration::from_secs(20);
        let task = {
            let waiter = waiter.clone();
            let key = key.clone();
            tokio::spawn(async move {
                waiter
                    .acquire(&key, Duration::from_secs(30), deadline)
                    .await
            })
        };
        while waiter.attempts() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Self { task, deadline }
    }

    /// The lease it got: it must have been woken, and acquired, before its
    /// deadline (the lock is free long before).
    async fn acquired(self) -> Lease {
        let lease = self
            .task
            .await
            .expect("waiting task")
            .expect("acquire")
            .expect("acquired before the deadline");
        assert!(
            Instant::now() < self.deadline,
            "the waiter was woken by its deadline, not when the lock was freed"
        );
        lease
    }
}

/// A pseudo-random duration below `max`.
fn random_below(max: Duration) -> Duration {
    Duration::from_micros(random() % u64::try_from(max.as_micros()).unwrap_or(1).max(1))
}

/// Issue 12, bug 2: waiting calls dropped at any await point (a timeout
/// around the raw trait's `acquire` and `watch`) leave no queue entries, so
/// a later waiter is woken by the release, not by its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waits_leave_no_queue_entries_and_do_not_stall_later_waiters() {
    let server = any_server();
    let ns = format!("drop{:x}", random() as u32);
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = EtcdLock::connect(&url).await.expect("holder");
    let k = key("dropped-waits");
    let queue = format!("{ns}/lock/{}/waiters/", k.as_str());
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;

    // How long one wait takes to queue, so the timeouts below fall inside it.
    let waiter = EtcdLock::connect(&url).await.expect("waiter");
    let started = Instant::now();
    drop(waiter.watch(&k).await.expect("watch"));
    let queueing = started.elapsed() * 2;
    for i in 0..60 {
        let limit = random_below(queueing);
        if i % 2 == 0 {
            let deadline = Instant::now() + Duration::from_secs(30);
            let wait = waiter.acquire(&k, Duration::from_secs(30), deadline);
            assert!(
                tokio::time::timeout(limit, wait).await.is_err(),
                "{k} is held"
            );
        } else if let Ok(watched) = tokio::time::timeout(limit, waiter.watch(&k)).await {
            drop(watched.expect("watch"));
        }
    }

    // A later waiter, on another client, is woken by the release.
    let late = Arc::new(ObservedLock::new(Arc::new(
        EtcdLock::connect(&url).await.expect("late waiter"),
    )));
    let waiting = Waiting::start(&late, &k).await;
    holder.release(&held).await.expect("release");
    let got = waiting.acquired().await;
    assert!(late.attempts() <= 2, "{} attempts", late.attempts());
    late.release(&got).await.expect("release");

    // Every dropped wait left the queue (the waiter's client, whose session
    // lease would keep leaked entries, is still alive).
    assert_queue_empties(&mut raw, &queue).await;
    drop(waiter);
}

/// Issue 12, audit of dropped raw futures: a renewing acquire dropped after
/// its transaction reached the server (the reply held back, then a timeout)
/// created a lock on the client's session lease that nobody renews; the
/// session must still expire it after its TTL, though the client (and so
/// the session lease) lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_acquire_dropped_in_flight_still_expires() {
    let server = any_server();
    let (gate, a, b) = gated_clients(&server, "").await;
    let ttl = Duration::from_secs(2);
    warm_session(&a, ttl).await;

    let k = key("dropped-renewing");
    gate.hold();
    let dropped = tokio::time::timeout(ttl / 4, a.try_acquire_renewing(&k, ttl)).await;
    gate.release();
    assert!(dropped.is_err(), "the reply was held back");
    // The server applied it: the lock is there, on the live session lease.
    assert!(matches!(
        b.try_acquire(&k, ttl).await.expect("try_acquire"),
        AcquireAttempt::Held { .. }
    ));
    assert_freed(&b, &k, "a dropped renewing acquire's lock outlived its TTL").await;
    drop(a);
}

/// Issue 12, suspected item (watch reconnect bookkeeping): a release while
/// the waiter's watch stream is down is not missed; once the stream is back
/// the waiter is woken and acquires, long before its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_during_a_watch_outage_wakes_the_waiter() {
    let server = any_server();
    let (proxy, waiter) =
        behind_proxy(&server, "connect_timeout_ms=1000&operation_timeout_ms=1000").await;
    let waiter = Arc::new(ObservedLock::new(Arc::new(waiter)));
    let holder = EtcdLock::connect(&server.url()).await.expect("holder");
    let k = key("outage");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    let waiting = Waiting::start(&waiter, &k).await;
    // Cut the waiter's connections (its watch stream breaks) and keep new
    // ones from reaching the server while the lock is released.
    proxy.black_hole();
    proxy.drop_all();
    holder.release(&held).await.expect("release");
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.heal();
    let got = waiting.acquired().await;
    waiter.release(&got).await.expect("release");
}
