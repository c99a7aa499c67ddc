//! What the PostgreSQL tests share: the server, clients in fresh
//! namespaces, superuser SQL, a transaction pooler.

use std::future::Future;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use distlock_conformance::fault::{Direction, Proxy};
use distlock_conformance::server::{PgBouncer, PoolMode, Postgres, ServerHandle, ServerProcess};
use distlock_core::{AcquireAttempt, Lease, LockBackend, LockClient, LockError, LockKey};
use distlock_postgres::{PgPool, PostgresConfig, PostgresLock};

pub fn server() -> &'static ServerHandle {
    static SERVER: OnceLock<ServerHandle> = OnceLock::new();
    SERVER.get_or_init(|| {
        ServerHandle::from_env_or_start(Arc::new(Postgres))
            .unwrap_or_else(|e| panic!("cannot start or reach PostgreSQL: {e}"))
    })
}

/// A fresh name (`{prefix}_{16 hex digits}`, a valid SQL identifier).
pub use distlock_conformance::naming::unique_name;

/// A backend and the lease-level client over it.
#[derive(Debug, Clone)]
pub struct Pg {
    pub backend: Arc<PostgresLock>,
    pub client: LockClient,
}

impl Pg {
    pub fn new(backend: PostgresLock) -> Self {
        let backend = Arc::new(backend);
        Self {
            client: LockClient::new(backend.clone()),
            backend,
        }
    }

    pub async fn connect(url: &str) -> Self {
        Self::new(PostgresLock::connect(url).await.expect("connect"))
    }

    pub async fn with_config(config: PostgresConfig) -> Self {
        Self::new(PostgresLock::with_config(config).await.expect("connect"))
    }

    pub fn pool(&self) -> &PgPool {
        self.backend.pool()
    }

    pub fn table(&self) -> String {
        self.backend.qualified_table()
    }

    /// The quoted, schema-qualified semaphore table.
    pub fn semaphore_table(&self) -> String {
        let config = self.backend.config();
        format!("\"{}\".\"{}\"", config.schema(), config.semaphore_table())
    }

    /// Subscribes to releases of `k` (returns once the server listens).
    pub async fn watch(&self, k: &LockKey) -> distlock_core::ReleaseWatch {
        self.backend
            .watch(k, distlock_core::OwnerToken::random())
            .await
            .unwrap()
            .expect("native wait")
    }
}

impl Deref for Pg {
    type Target = LockClient;
    fn deref(&self) -> &LockClient {
        &self.client
    }
}

/// A client in namespace `namespace` (a fresh one keeps tests apart).
pub async fn client(namespace: &str) -> Pg {
    Pg::connect(&format!("{}?namespace={namespace}", server().url())).await
}

pub fn key(name: &str) -> LockKey {
    LockKey::new(name).expect("valid key")
}

/// Runs SQL as the superuser of the test server.
pub async fn admin(lock: &Pg, sql: &str) {
    sqlx::query(sql)
        .execute(lock.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Takes `k` for `ttl`, which must be free (`why` says why it must).
pub async fn take(lock: &LockClient, k: &LockKey, ttl: Duration, why: &str) -> Lease {
    lock.try_acquire(k, ttl).await.unwrap().lease().expect(why)
}

/// The URL of the test server with other credentials.
pub fn url_with_user(user: &str, password: &str) -> String {
    format!("postgres://{user}:{password}@{}", server_rest())
}

/// What follows the credentials in the test server's URL.
pub fn server_rest() -> String {
    let url = server().url();
    url.split_once('@')
        .map(|(_, rest)| rest.to_owned())
        .expect("URL with credentials")
}

/// `text` percent-encoded for a URL.
pub use distlock_conformance::url::percent_encode;

/// The address of the shared test server.
pub fn server_addr() -> SocketAddr {
    server_rest()
        .split_once('/')
        .and_then(|(addr, _)| addr.parse().ok())
        .expect("the server URL names 127.0.0.1:port")
}

/// A fault proxy in front of the shared server, and the server's URL
/// through it.
pub async fn proxied() -> (Proxy, String) {
    let proxy = Proxy::start(server_addr()).await.expect("start the proxy");
    let url = server()
        .url()
        .replace(&server_addr().to_string(), &proxy.addr().to_string());
    (proxy, url)
}

/// A client of 16 connections to a new database whose transactions are
/// serializable unless they say otherwise.
pub async fn serializable_client() -> Pg {
    let admin_client = client("serializable").await;
    let database = unique_name("distlock_serializable");
    admin(&admin_client, &format!("CREATE DATABASE {database}")).await;
    admin(
        &admin_client,
        &format!("ALTER DATABASE {database} SET default_transaction_isolation = 'serializable'"),
    )
    .await;
    let url = server().url();
    let base = url.rsplit_once('/').map(|(base, _)| base).unwrap();
    let config = PostgresConfig::from_url(&format!("{base}/{database}?namespace=iso"))
        .unwrap()
        .with_max_connections(16);
    Pg::with_config(config).await
}

/// Ten rounds of 16 attempts at once, each `attempt(lock, key)`, on a new
/// key every other round (first inserts race) and on the key just released
/// in between (updates race): at most `most` are granted in a round, and
/// released after it. Returns the attempts' errors.
pub async fn contended_rounds<F, Fut>(lock: &Pg, most: usize, attempt: F) -> Vec<String>
where
    F: Fn(Pg, LockKey) -> Fut,
    Fut: Future<Output = Result<AcquireAttempt, LockError>> + Send + 'static,
{
    let mut errors = Vec::new();
    for round in 0..10 {
        let k = key(&format!("contended-{}", round / 2));
        let attempts: Vec<_> = (0..16)
            .map(|_| tokio::spawn(attempt(lock.clone(), k.clone())))
            .collect();
        let mut granted = Vec::new();
        for attempt in attempts {
            match attempt.await.unwrap() {
                Ok(AcquireAttempt::Acquired(lease)) => granted.push(lease),
                Ok(AcquireAttempt::Held { .. }) => {}
                Err(e) => errors.push(e.to_string()),
            }
        }
        assert!(
            granted.len() <= most,
            "{} granted at once, at most {most} may be",
            granted.len()
        );
        for lease in granted {
            lock.release(&lease).await.unwrap();
        }
    }
    errors
}

/// A client of one pooled connection at `url` in namespace `ns`, whose
/// statements time out after 1 s: a test that holds its replies knows
/// which statement is in flight.
pub async fn one_connection(url: &str, ns: &str) -> Pg {
    let config =
        PostgresConfig::from_url(&format!("{url}?namespace={ns}&operation_timeout_ms=1000"))
            .unwrap()
            .with_max_connections(1);
    Pg::with_config(config).await
}

/// Stalls every connection open through `proxy` now, in both directions,
/// for longer than any test: a partition that lost those flows. Connections
/// opened later work.
pub fn black_hole_current(proxy: &Proxy) {
    for connection in 0..proxy.connections_accepted() {
        for direction in [Direction::ToServer, Direction::ToClient] {
            proxy.delay_connection(connection, direction, Duration::from_secs(3600));
        }
    }
}

/// A PgBouncer 1.18 in transaction mode in front of the shared server, with
/// one server connection: every client of it shares one server session, so
/// what transaction pooling does to session state (LISTEN) is deterministic.
pub async fn transaction_pooler() -> ServerProcess {
    transaction_pooler_of(1).await
}

/// A PgBouncer 1.18 in transaction mode in front of the shared server, with
/// `server_connections` server connections.
pub async fn transaction_pooler_of(server_connections: u32) -> ServerProcess {
    let kind = PgBouncer::new(server_addr(), PoolMode::Transaction).pool_size(server_connections);
    tokio::task::spawn_blocking(move || ServerProcess::start(Arc::new(kind)))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start PgBouncer: {e}"))
}

/// A PgBouncer 1.18 in session mode in front of the shared server, with
/// `server_connections` server connections.
pub async fn session_pooler_of(server_connections: u32) -> ServerProcess {
    let kind = PgBouncer::new(server_addr(), PoolMode::Session).pool_size(server_connections);
    tokio::task::spawn_blocking(move || ServerProcess::start(Arc::new(kind)))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start PgBouncer: {e}"))
}

/// `holder` takes `k` for 60 s, `waiter` subscribes, `holder` releases: the
/// waiter must hear of it long before the 60 s run out (`why_not` says
/// what it means if it does not).
pub async fn assert_release_heard(holder: &Pg, waiter: &Pg, k: &LockKey, why_not: &str) {
    let lease = take(holder, k, Duration::from_secs(60), "free").await;
    let mut watch = waiter.watch(k).await;
    holder.release(&lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), watch.released())
        .await
        .expect(why_not)
        .unwrap();
}

/// A client whose connections carry a unique `application_name`, so the
/// test can find its server backends.
pub async fn named_client(ns: &str, extra: &str) -> (Pg, String) {
    let app = unique_name("app");
    let lock = Pg::connect(&format!(
        "{}?namespace={ns}&application_name={app}{extra}",
        server().url()
    ))
    .await;
    (lock, app)
}

/// The backends of `app` matching `condition` (SQL on pg_stat_activity).
pub async fn backends(admin: &Pg, app: &str, condition: &str) -> Vec<i32> {
    sqlx::query_scalar(&format!(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND {condition}"
    ))
    .bind(app)
    .fetch_all(admin.pool())
    .await
    .unwrap()
}

/// Waits for a backend of `app` matching `condition` and returns its pid.
pub async fn backend(admin: &Pg, app: &str, condition: &str) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(pid) = backends(admin, app, condition).await.first() {
            return *pid;
        }
        assert!(
            Instant::now() < deadline,
            "no backend of {app} with {condition}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Ends backend `pid` (`pg_terminate_backend`).
pub async fn terminate(admin: &Pg, pid: i32) {
    let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(admin.pool())
        .await
        .unwrap();
    assert!(done, "backend {pid} was not terminated");
}

/// Waits until no statement of `lock` is in flight: every connection of its
/// pool is back and idle (statements a caller left behind run on tasks of
/// their own, which give the connection back, or close it, when done).
pub async fn settled(lock: &Pg) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while lock.pool().num_idle() < lock.pool().size() as usize {
        assert!(
            Instant::now() < deadline,
            "statements left behind by their callers never finished"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The row of `k` in `lock`'s namespace and table: its owner, fencing
/// counter and the milliseconds until it expires by the database clock
/// (negative once expired); `None` if there is no row.
pub async fn row(lock: &Pg, k: &LockKey) -> Option<(Option<String>, i64, i64)> {
    sqlx::query_as(&format!(
        "SELECT owner, fencing,
                floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000)::bigint
         FROM {} WHERE namespace = $1 AND key = $2",
        lock.table()
    ))
    .bind(lock.backend.config().client().namespace())
    .bind(k.as_str())
    .fetch_optional(lock.pool())
    .await
    .unwrap()
}

/// A lock call a test interrupts.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    Acquire,
    Extend,
    Release,
}

/// Runs `op` on `k` (extend and release on `lease`) with a 30 s TTL on a
/// task of its own.
pub fn spawn_op(
    lock: &Pg,
    k: &LockKey,
    lease: Option<Lease>,
    op: Op,
) -> tokio::task::JoinHandle<Result<Option<Lease>, LockError>> {
    let lock = lock.clone();
    let k = k.clone();
    tokio::spawn(async move {
        let ttl = Duration::from_secs(30);
        let lease = || lease.clone().expect("a lease to extend or release");
        match op {
            Op::Acquire => lock.try_acquire(&k, ttl).await.map(|a| a.lease()),
            Op::Extend => lock.extend(&lease(), ttl).await.map(Some),
            Op::Release => lock.release(&lease()).await.map(|()| None),
        }
    })
}

/// A transaction of `admin` holding the row of `k` in `lock`'s namespace
/// and table locked (`FOR UPDATE`): `lock`'s statements on it wait.
pub async fn lock_row(
    admin: &Pg,
    lock: &Pg,
    k: &LockKey,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = admin.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE namespace = $1 AND key = $2 FOR UPDATE",
        lock.table()
    ))
    .bind(lock.backend.config().client().namespace())
    .bind(k.as_str())
    .execute(&mut *blocker)
    .await
    .unwrap();
    blocker
}

/// Rows one plan read, from its `EXPLAIN (ANALYZE)` text: the rows each
/// scan returned and those its filters removed, times the node's loops
/// (`EXPLAIN` shows both per loop).
pub fn rows_read(plan: &[String]) -> u64 {
    let number = |line: &str, after: &str| -> Option<u64> {
        let rest = &line[line.find(after)? + after.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    let mut loops = 1;
    let mut read = 0;
    for line in plan {
        if line.contains("(actual time=") {
            loops = number(line, " loops=").unwrap_or(1);
            if line.contains(" Scan ") {
                read += number(line, " rows=").unwrap_or(0) * loops;
            }
        }
        for removed in ["Rows Removed by Join Filter: ", "Rows Removed by Filter: "] {
            read += number(line, removed).unwrap_or(0) * loops;
        }
    }
    read
}
