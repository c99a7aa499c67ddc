//! Helpers shared by the etcd-specific test files: servers, clients,
//! keys, raw etcd reads and etcd's request counters.

// Each test file uses a different subset.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::fault::{Direction, Proxy};
use distlock_conformance::server::{self, ServerHandle, ServerProcess};
use distlock_conformance::ObservedLock;
use distlock_core::{AcquireAttempt, Lease, LockClient, LockError, LockKey};
use distlock_etcd::etcd_client::{self, Client};
use distlock_etcd::EtcdLock;

/// A fresh key with `label` in it.
pub use distlock_conformance::naming::unique_key;

/// A server for tests that do not control the process.
pub fn any_server() -> ServerHandle {
    ServerHandle::from_env_or_start(Arc::new(server::Etcd)).expect("etcd must start")
}

/// A server this test owns (kill, restart, auth setup, request counts).
pub fn own_server() -> ServerProcess {
    ServerProcess::start(Arc::new(server::Etcd)).expect("etcd must start")
}

/// `host:port` of an `etcd://` URL.
pub fn endpoint(url: &str) -> String {
    url.strip_prefix("etcd://")
        .expect("etcd URL")
        .split('?')
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// The server address in an `etcd://` URL.
pub fn addr_of(url: &str) -> SocketAddr {
    endpoint(url).parse().expect("an etcd URL with IP:port")
}

/// A plain etcd client, to look at (or tamper with) what the backend wrote.
pub async fn raw_client(url: &str) -> Client {
    Client::connect([endpoint(url)], None)
        .await
        .expect("raw etcd client")
}

/// A lock client of its own on `url`.
pub async fn connect(url: &str) -> LockClient {
    LockClient::new(EtcdLock::connect(url).await.expect("connect"))
}

/// A lock client on `url` whose acquisition attempts are counted.
pub async fn observed(url: &str) -> (Arc<ObservedLock>, LockClient) {
    let observed = Arc::new(ObservedLock::new(
        EtcdLock::connect(url).await.expect("connect"),
    ));
    (observed.clone(), LockClient::new(observed))
}

/// Takes a free `key` without waiting; panics if it is held.
pub async fn acquire(client: &LockClient, key: &LockKey, ttl: Duration) -> Lease {
    match client.try_acquire(key, ttl).await.expect("try_acquire") {
        AcquireAttempt::Acquired(lease) => lease,
        AcquireAttempt::Held { .. } => panic!("{key} unexpectedly held"),
    }
}

/// As [`acquire`], for a lock its holder renews (on the session lease).
pub async fn acquire_renewing(client: &LockClient, key: &LockKey, ttl: Duration) -> Lease {
    match client
        .try_acquire_renewing(key, ttl)
        .await
        .expect("renewing acquire")
    {
        AcquireAttempt::Acquired(lease) => lease,
        AcquireAttempt::Held { .. } => panic!("{key} unexpectedly held"),
    }
}

/// A fault proxy in front of `server`.
pub async fn proxy_for(server: &ServerHandle) -> Proxy {
    Proxy::start(addr_of(&server.url()))
        .await
        .expect("fault proxy")
}

/// The URL of `proxy`'s server as seen through it, with `query`.
pub fn through(proxy: &Proxy, query: &str) -> String {
    format!("etcd://{}?{query}", proxy.addr())
}

/// Releases `lease` with `client` (behind `proxy`, whose operation timeout
/// is 6 s) while its first send's reply is held 2.5 s: past that send's
/// third of the timeout, so the release is sent again, and the second
/// send's reply follows the first at once (bytes keep their order).
pub async fn release_resent(
    proxy: &Proxy,
    client: &LockClient,
    lease: Lease,
) -> Result<(), LockError> {
    proxy.delay(Direction::ToClient, Duration::from_millis(2500));
    let release = {
        let client = client.clone();
        tokio::spawn(async move { client.release(&lease).await })
    };
    tokio::time::sleep(Duration::from_millis(1000)).await;
    proxy.delay(Direction::ToClient, Duration::ZERO);
    release.await.expect("release task")
}

/// Short timeouts for a client behind a fault, so it notices quickly.
pub const SHORT_TIMEOUTS: &str = "connect_timeout_ms=1000&operation_timeout_ms=1000";

/// Another client acquires `key` (and releases it) within 15 s.
pub async fn assert_freed(other: &LockClient, key: &LockKey, why: &str) {
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

/// A waiting acquire (30 s TTL, 20 s deadline) running in a task.
pub struct Waiting {
    task: tokio::task::JoinHandle<Result<Option<Lease>, LockError>>,
    deadline: Instant,
}

impl Waiting {
    /// Starts one on `client` (whose attempts `observed` counts); returns
    /// once it made its first attempt (so it is queued and its watch is
    /// live).
    pub async fn start(observed: &ObservedLock, client: &LockClient, key: &LockKey) -> Self {
        let before = observed.attempts_in_line();
        let deadline = Instant::now() + Duration::from_secs(20);
        let task = {
            let client = client.clone();
            let key = key.clone();
            tokio::spawn(async move {
                client
                    .acquire(&key, Duration::from_secs(30), deadline)
                    .await
            })
        };
        while observed.attempts_in_line() == before {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Self { task, deadline }
    }

    /// The lease it got: it must have been woken, and acquired, before its
    /// deadline (the lock is free long before).
    pub async fn acquired(self) -> Lease {
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

/// The keys under `prefix`, read with a raw client.
pub async fn keys_under(raw: &mut Client, prefix: &str) -> Vec<String> {
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
pub async fn assert_queue_empties(raw: &mut Client, queue: &str) {
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

/// Deletes everything under `prefix` with a raw client.
pub async fn delete_prefix(raw: &mut Client, prefix: &str) {
    raw.delete(
        prefix,
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .expect("raw delete");
}

/// etcd's per-method gRPC request counters (`grpc_server_started_total`,
/// [`server::etcd_grpc_started`]).
pub async fn grpc_started(addr: SocketAddr) -> BTreeMap<String, u64> {
    grpc_counters(addr, server::etcd_grpc_started, "grpc_server_started_total").await
}

/// etcd's per-method gRPC message counters (`grpc_server_msg_received_total`,
/// [`server::etcd_grpc_received`]): a stream's requests (each watch
/// created or cancelled) count one each.
pub async fn grpc_received(addr: SocketAddr) -> BTreeMap<String, u64> {
    grpc_counters(
        addr,
        server::etcd_grpc_received,
        "grpc_server_msg_received_total",
    )
    .await
}

/// The per-method counters `read` takes from etcd's `/metrics` (named
/// `metric` there), which must have the key-value methods.
async fn grpc_counters(
    addr: SocketAddr,
    read: fn(u16) -> std::io::Result<BTreeMap<String, u64>>,
    metric: &'static str,
) -> BTreeMap<String, u64> {
    let counts = tokio::task::spawn_blocking(move || read(addr.port()))
        .await
        .expect("the metrics reader ran")
        .expect("etcd's metrics endpoint answers");
    assert!(
        counts.contains_key("Range") || counts.contains_key("Txn"),
        "etcd's /metrics has no {metric} counters: {counts:?}"
    );
    counts
}

/// The Raft proposals etcd committed so far (`etcd_server_proposals_committed_total`):
/// every write, and every transaction that could write, even one whose
/// compare failed; reads and lease keep-alives are none.
pub async fn proposals_committed(addr: SocketAddr) -> f64 {
    tokio::task::spawn_blocking(move || {
        server::etcd_metric(addr.port(), "etcd_server_proposals_committed_total")
    })
    .await
    .expect("the metrics reader ran")
    .expect("etcd's metrics endpoint answers")
}

/// The gRPC requests started between two counter readings, by method,
/// without the keep-alive stream (its messages are not requests).
pub fn requests_between(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(method, _)| method.as_str() != "LeaseKeepAlive")
        .map(|(method, n)| (method.clone(), n - before.get(method).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}
