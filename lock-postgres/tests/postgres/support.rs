//! What the PostgreSQL tests share: the server, clients in fresh
//! namespaces, superuser SQL, a transaction pooler.

use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use distlock_conformance::fault::{Direction, Proxy};
use distlock_conformance::server::{PgBouncer, PoolMode, Postgres, ServerHandle, ServerProcess};
use distlock_core::{Lease, LockBackend, LockClient, LockKey};
use distlock_postgres::{PgPool, PostgresConfig, PostgresLock};

pub fn server() -> &'static ServerHandle {
    static SERVER: OnceLock<ServerHandle> = OnceLock::new();
    SERVER.get_or_init(|| {
        ServerHandle::from_env_or_start(Arc::new(Postgres))
            .unwrap_or_else(|e| panic!("cannot start or reach PostgreSQL: {e}"))
    })
}

pub fn random_name(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

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
        self.backend.table()
    }

    /// Subscribes to releases of `k` (returns once the server listens).
    pub async fn watch(&self, k: &LockKey) -> distlock_core::ReleaseWatch {
        self.backend.watch(k).await.unwrap().expect("native wait")
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

/// `text` with every byte but ASCII letters and digits %-escaped, for a URL.
pub fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

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
