//! PostgreSQL-specific tests beyond the conformance suite, against a real
//! server started by the harness (or `DISTLOCK_POSTGRES_URL`).

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use conformance_tests::server::{Postgres, ServerHandle};
use conformance_tests::ObservedLock;
use lock_core::{AcquireAttempt, DistributedLock, ErrorKind, LockKey};
use lock_postgres::{PostgresConfig, PostgresLock};

fn server() -> &'static ServerHandle {
    static SERVER: OnceLock<ServerHandle> = OnceLock::new();
    SERVER.get_or_init(|| {
        ServerHandle::from_env_or_start(Arc::new(Postgres))
            .unwrap_or_else(|e| panic!("cannot start or reach PostgreSQL: {e}"))
    })
}

fn random_name(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

/// A client in a fresh namespace (so tests never see each other's rows).
async fn client(namespace: &str) -> PostgresLock {
    let url = format!("{}?namespace={namespace}", server().url());
    PostgresLock::connect(&url).await.expect("connect")
}

fn key(name: &str) -> LockKey {
    LockKey::new(name).expect("valid key")
}

/// Runs SQL as the superuser of the test server.
async fn admin(lock: &PostgresLock, sql: &str) {
    sqlx::query(sql)
        .execute(lock.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The URL of the test server with other credentials.
fn url_with_user(user: &str, password: &str) -> String {
    let url = server().url();
    let rest = url
        .split_once('@')
        .map(|(_, rest)| rest.to_owned())
        .expect("URL with credentials");
    format!("postgres://{user}:{password}@{rest}")
}

/// `text` with every byte but ASCII letters and digits %-escaped, for a URL.
fn percent_encode(text: &str) -> String {
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

#[tokio::test]
async fn password_authentication_through_the_url() {
    let admin_client = client("auth").await;
    let role = random_name("distlock_role");
    let password = format!("pw'{}\\x", rand::random::<u32>());
    let escaped = password.replace('\'', "''");
    admin(
        &admin_client,
        &format!("CREATE ROLE {role} LOGIN PASSWORD '{escaped}'"),
    )
    .await;
    admin(
        &admin_client,
        &format!("GRANT CREATE, USAGE ON SCHEMA public TO {role}"),
    )
    .await;
    let table = random_name("auth_locks");
    let encoded = percent_encode(&password);
    let url = format!("{}?table={table}", url_with_user(&role, &encoded));
    let lock = PostgresLock::connect(&url)
        .await
        .expect("the role connects with its password");
    let k = key("auth");
    let lease = lock
        .try_acquire(&k, Duration::from_secs(5))
        .await
        .unwrap()
        .lease()
        .expect("free");
    lock.release(&lease).await.unwrap();

    let wrong = format!("{}?table={table}", url_with_user(&role, "not-the-password"));
    let err = PostgresLock::connect(&wrong).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(
        err.to_string().contains("authentication failed")
            && err.to_string().contains("user and password"),
        "{err}"
    );
    let url = server().url();
    let rest = url
        .split_once('@')
        .map(|(_, rest)| rest.to_owned())
        .unwrap();
    let no_password = format!("postgres://{role}@{rest}?table={table}");
    let err = PostgresLock::connect(&no_password).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    let unknown = format!("{}?table={table}", url_with_user("no_such_role", "x"));
    let err = PostgresLock::connect(&unknown).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
}

#[tokio::test]
async fn row_edited_into_an_impossible_state_is_reported_not_overwritten() {
    let ns = random_name("corrupt");
    let a = client(&ns).await;
    let b = client(&ns).await;
    let table = a.table();
    let ttl = Duration::from_secs(30);

    // A foreign owner value.
    let k = key("owner");
    let lease = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    admin(
        &a,
        &format!(
            "UPDATE {table} SET owner = 'not-a-token' WHERE namespace = '{ns}' AND key = 'owner'"
        ),
    )
    .await;
    let err = b.try_acquire(&k, ttl).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.to_string().contains("owner"), "{err}");
    assert_eq!(
        a.release(&lease).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    assert_eq!(
        a.extend(&lease, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    // Expired, still never taken over.
    admin(&a, &format!("UPDATE {table} SET expires_at = now() - interval '1 hour' WHERE namespace = '{ns}' AND key = 'owner'")).await;
    assert_eq!(
        b.try_acquire(&k, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    let owner: String = sqlx::query_scalar(&format!(
        "SELECT owner FROM {table} WHERE namespace = $1 AND key = 'owner'"
    ))
    .bind(&ns)
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(owner, "not-a-token", "the foreign row is left untouched");

    // A negative fencing counter.
    let k = key("negative");
    let lease = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    admin(
        &a,
        &format!("UPDATE {table} SET fencing = -5 WHERE namespace = '{ns}' AND key = 'negative'"),
    )
    .await;
    assert_eq!(
        b.try_acquire(&k, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    assert_eq!(
        a.release(&lease).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );

    // A fencing counter lower than the lease's (reset by hand).
    let k = key("backwards");
    let first = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    a.release(&first).await.unwrap();
    let lease = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    assert!(lease.fencing_token() > first.fencing_token());
    admin(&a, &format!("UPDATE {table} SET fencing = 0, owner = NULL WHERE namespace = '{ns}' AND key = 'backwards'")).await;
    let err = a.release(&lease).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.to_string().contains("backwards"), "{err}");
    assert_eq!(
        a.extend(&lease, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
}

#[tokio::test]
async fn awkward_keys_are_bind_parameters() {
    let ns = random_name("keys");
    let a = client(&ns).await;
    let b = client(&ns).await;
    let names = vec![
        "a".to_owned(),
        "a/b".to_owned(),
        "a:b".to_owned(),
        "a{b}".to_owned(),
        "a%2Fb".to_owned(),
        "it's".to_owned(),
        "\"quoted\"".to_owned(),
        "back\\slash\\".to_owned(),
        "'); DROP TABLE distlock_locks; --".to_owned(),
        "ünïcødé ключ 鍵 🔒".to_owned(),
        "x".repeat(512),
        "é".repeat(256),
        "$1".to_owned(),
        "%".to_owned(),
        "_".to_owned(),
    ];
    let ttl = Duration::from_secs(30);
    let mut leases = Vec::new();
    for name in &names {
        let k = key(name);
        let lease = a
            .try_acquire(&k, ttl)
            .await
            .unwrap()
            .lease()
            .unwrap_or_else(|| panic!("{name:?} is free"));
        assert!(
            matches!(
                b.try_acquire(&k, ttl).await.unwrap(),
                AcquireAttempt::Held { .. }
            ),
            "{name:?} is held"
        );
        leases.push(lease);
    }
    // Waiting works for such keys too (the key is the NOTIFY payload).
    let k = key(&"é".repeat(256));
    let mut watch = b.watch(&k).await.unwrap().expect("native wait");
    for lease in &leases {
        a.release(lease).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), watch.released())
        .await
        .expect("notified")
        .unwrap();
    for name in &names {
        let lease = b.try_acquire(&key(name), ttl).await.unwrap().lease();
        assert!(lease.is_some(), "{name:?} is free again");
    }
}

#[tokio::test]
async fn blocked_waiter_is_woken_by_notify_not_polling() {
    let ns = random_name("wait");
    let holder = client(&ns).await;
    let waiter = ObservedLock::new(Arc::new(client(&ns).await));
    let k = key("job");
    let lease = holder
        .try_acquire(&k, Duration::from_secs(30))
        .await
        .unwrap()
        .lease()
        .expect("free");
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        holder.release(&lease).await.unwrap();
        lease
    });
    let got = waiter
        .acquire(
            &k,
            Duration::from_secs(30),
            Instant::now() + Duration::from_secs(20),
        )
        .await
        .unwrap()
        .expect("acquired after the release");
    let released = release.await.unwrap();
    assert!(got.fencing_token() > released.fencing_token());
    let attempts = waiter.attempts();
    assert!(
        attempts <= 2,
        "{attempts} acquire attempts while blocked for 2 s"
    );
}

#[tokio::test]
async fn many_clients_create_the_table_at_once() {
    let table = random_name("race");
    let base = server().url();
    let connects = (0..8).map(|i| {
        let url = format!("{base}?table={table}&namespace=n{i}");
        tokio::spawn(async move { PostgresLock::connect(&url).await })
    });
    for task in connects {
        let lock = task
            .await
            .unwrap()
            .expect("connect while others create the table");
        let lease = lock
            .try_acquire(&key("k"), Duration::from_secs(5))
            .await
            .unwrap()
            .lease()
            .expect("free");
        lock.release(&lease).await.unwrap();
    }
}

#[tokio::test]
async fn schema_and_table_are_configurable_and_quoted() {
    let schema = random_name("Sch\"ema");
    let url = server().url();
    let config = PostgresConfig::from_url(&url)
        .unwrap()
        .schema(schema.clone())
        .table("my \"locks\"")
        .namespace("cfg");
    let lock = PostgresLock::with_config(config).await.unwrap();
    let lease = lock
        .try_acquire(&key("k"), Duration::from_secs(5))
        .await
        .unwrap()
        .lease()
        .expect("free");
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE owner IS NOT NULL",
        lock.table()
    ))
    .fetch_one(lock.pool())
    .await
    .unwrap();
    assert_eq!(n, 1);
    lock.release(&lease).await.unwrap();
}

#[tokio::test]
async fn expiry_uses_the_database_clock_and_is_never_revived() {
    let ns = random_name("expiry");
    let a = client(&ns).await;
    let b = client(&ns).await;
    let k = key("short");
    let lease = a
        .try_acquire(&k, Duration::from_millis(200))
        .await
        .unwrap()
        .lease()
        .expect("free");
    match b.try_acquire(&k, Duration::from_secs(5)).await.unwrap() {
        AcquireAttempt::Held { expires_in } => {
            let left = expires_in.expect("the server says how long");
            assert!(left <= Duration::from_millis(200), "{left:?}");
        }
        other => panic!("expected held, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        a.extend(&lease, Duration::from_secs(5))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotHeld
    );
    assert_eq!(
        a.release(&lease).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
    let next = b
        .try_acquire(&k, Duration::from_secs(5))
        .await
        .unwrap()
        .lease()
        .expect("expired");
    assert!(next.fencing_token() > lease.fencing_token());
}

#[tokio::test]
async fn unreachable_server_is_unavailable_in_bounded_time() {
    let port = conformance_tests::server::free_port().unwrap();
    let url =
        format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres?connect_timeout_ms=500");
    let err = PostgresLock::connect(&url).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test]
async fn survives_a_server_kill_and_restart() {
    use conformance_tests::server::ServerProcess;
    // Its own server: this test kills it.
    let server = tokio::task::spawn_blocking(|| ServerProcess::start(Arc::new(Postgres)))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start PostgreSQL: {e}"));
    let url = format!(
        "{}?namespace=fault&connect_timeout_ms=1000&operation_timeout_ms=1000",
        server.url()
    );
    let a = PostgresLock::connect(&url).await.unwrap();
    let b = PostgresLock::connect(&url).await.unwrap();
    let k = key("fault");
    let lease = a
        .try_acquire(&k, Duration::from_secs(60))
        .await
        .unwrap()
        .lease()
        .expect("free");
    let mut watch = b.watch(&k).await.unwrap().expect("native wait");

    let server = Arc::new(server);
    let killer = server.clone();
    tokio::task::spawn_blocking(move || killer.kill())
        .await
        .unwrap();
    // A dead server: a typed error, never a hang (the outer timeout only
    // guards the test run).
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        a.try_acquire(&key("other"), Duration::from_secs(5)),
    )
    .await
    .expect("bounded")
    .unwrap_err();
    assert!(err.is_transient(), "{err}");
    // The listener noticed and woke its waiters.
    tokio::time::timeout(Duration::from_secs(30), watch.released())
        .await
        .expect("waiters woken when the listener connection died")
        .unwrap();

    let restarter = server.clone();
    tokio::task::spawn_blocking(move || restarter.restart())
        .await
        .unwrap()
        .expect("restart");
    // The clients reconnect by themselves; the lease survived (durable).
    let mut held = None;
    for _ in 0..100 {
        match b.try_acquire(&k, Duration::from_secs(5)).await {
            Ok(attempt) => {
                held = Some(attempt);
                break;
            }
            Err(e) if e.is_transient() => {
                eprintln!("retrying after: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        matches!(held, Some(AcquireAttempt::Held { .. })),
        "{held:?}"
    );
    // Waiting works again through the new listener connection: woken by the
    // release long before the lease's 60 s run out.
    let waiter = tokio::spawn(async move {
        let got = b
            .acquire(
                &k,
                Duration::from_secs(5),
                Instant::now() + Duration::from_secs(20),
            )
            .await;
        (b, got)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut released = false;
    for _ in 0..50 {
        match a.release(&lease).await {
            Ok(()) => {
                released = true;
                break;
            }
            Err(e) if e.is_transient() => {
                eprintln!("retrying after: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(released);
    let (_b, got) = waiter.await.unwrap();
    let got = got.unwrap().expect("woken by NOTIFY after the restart");
    assert!(got.fencing_token() > lease.fencing_token());
}

/// A loopback TCP proxy whose current connections can be black-holed: bytes
/// are swallowed and never answered, and they stay dead after `heal` (as
/// flows lost in a network partition); new connections forward normally.
struct Proxy {
    addr: std::net::SocketAddr,
    generation: Arc<AtomicUsize>,
}

impl Proxy {
    async fn start(target: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let generation = Arc::new(AtomicUsize::new(0));
        let live = generation.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let born = live.load(Ordering::SeqCst);
                let live = live.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pipe(cr, sw, born, live.clone());
                    let down = pipe(sr, cw, born, live);
                    let _ = tokio::join!(up, down);
                });
            }
        });
        Self { addr, generation }
    }

    /// Black-holes every connection open now, for good.
    fn black_hole_current(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    born: usize,
    live: Arc<AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if live.load(Ordering::SeqCst) != born {
            continue; // swallowed
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test]
async fn black_holed_connections_time_out_and_the_client_recovers() {
    let url = server().url();
    let target: std::net::SocketAddr = url
        .split_once('@')
        .and_then(|(_, rest)| rest.split_once('/'))
        .map(|(addr, _)| addr.parse().unwrap())
        .unwrap();
    let proxy = Proxy::start(target).await;
    let proxied = url.replace(&target.to_string(), &proxy.addr.to_string());
    let ns = random_name("blackhole");
    let lock = PostgresLock::connect(&format!(
        "{proxied}?namespace={ns}&connect_timeout_ms=500&operation_timeout_ms=500"
    ))
    .await
    .unwrap();
    let k = key("k");
    let lease = lock
        .try_acquire(&k, Duration::from_secs(60))
        .await
        .unwrap()
        .lease()
        .expect("free");
    let mut watch = lock.watch(&k).await.unwrap().expect("native wait");

    proxy.black_hole_current();
    // Requests on the black-holed connections fail in bounded time with a
    // typed error (the outer timeout only guards the run); the pool drops
    // those connections and opens new ones, which work: the client recovers
    // by itself. More requests than the pool has connections.
    let mut failed = 0;
    let mut last_ok = false;
    for i in 0..20 {
        let k = key(&format!("dead-{i}"));
        let attempt = tokio::time::timeout(
            Duration::from_secs(30),
            lock.try_acquire(&k, Duration::from_secs(5)),
        )
        .await
        .expect("bounded");
        match attempt {
            Ok(attempt) => last_ok = attempt.lease().is_some(),
            Err(e) => {
                assert!(e.is_transient(), "{e}");
                failed += 1;
                last_ok = false;
            }
        }
    }
    assert!(failed >= 1, "the black hole was not noticed");
    assert!(last_ok, "the client never recovered from the black hole");
    lock.extend(&lease, Duration::from_secs(60)).await.unwrap();
    lock.release(&lease).await.unwrap();

    // The listener's connection was black-holed too. After a quiet spell it
    // pings, notices, reconnects and wakes its waiters; a waiter then gets
    // a lock released by another client through NOTIFY, long before the
    // holder's 60 s lease would run out.
    tokio::time::timeout(Duration::from_secs(30), watch.released())
        .await
        .expect("the dead listener was noticed and its waiters woken")
        .unwrap();
    let holder = client(&ns).await;
    let k2 = key("held-across-the-black-hole");
    let held = holder
        .try_acquire(&k2, Duration::from_secs(60))
        .await
        .unwrap()
        .lease()
        .expect("free");
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        holder.release(&held).await.unwrap();
    });
    let got = lock
        .acquire(
            &k2,
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(30),
        )
        .await
        .unwrap();
    release.await.unwrap();
    assert!(
        got.is_some(),
        "woken by NOTIFY on the new listener connection"
    );
}

/// Takes `k` for `ttl`, which must be free (`why` says why it must).
async fn take(lock: &PostgresLock, k: &LockKey, ttl: Duration, why: &str) -> lock_core::Lease {
    lock.try_acquire(k, ttl).await.unwrap().lease().expect(why)
}

/// The address of the shared test server.
fn server_addr() -> std::net::SocketAddr {
    server()
        .url()
        .split_once('@')
        .and_then(|(_, rest)| rest.split_once('/'))
        .and_then(|(addr, _)| addr.parse().ok())
        .expect("the server URL names 127.0.0.1:port")
}

/// A PgBouncer 1.18 in transaction mode in front of the shared server, with
/// one server connection: every client of it shares one server session, so
/// what transaction pooling does to session state (LISTEN) is deterministic.
async fn transaction_pooler() -> conformance_tests::server::ServerProcess {
    use conformance_tests::server::{PgBouncer, PoolMode, ServerProcess};
    let kind = PgBouncer::new(server_addr(), PoolMode::Transaction).pool_size(1);
    tokio::task::spawn_blocking(move || ServerProcess::start(Arc::new(kind)))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start PgBouncer: {e}"))
}

#[tokio::test]
async fn release_through_a_transaction_pooler_reports_success() {
    let pooler = transaction_pooler().await;
    let ns = random_name("pooler");
    // One pooled connection: the statements and the listener's LISTEN all
    // run in PgBouncer's single server session.
    let config = PostgresConfig::from_url(&format!("{}?namespace={ns}", pooler.url()))
        .unwrap()
        .max_connections(1);
    let lock = PostgresLock::with_config(config).await.unwrap();
    let direct = client(&ns).await;
    let k = key("pooled");
    let lease = take(&lock, &k, Duration::from_secs(30), "free").await;
    // A waiter makes the client LISTEN, through the pooler: the server
    // session that runs the release below now listens on the channel the
    // release notifies, so the notification arrives on a pooled connection.
    let _watch = lock.watch(&k).await.unwrap().expect("native wait");
    lock.release(&lease)
        .await
        .expect("the row was released, so release reports success");
    assert_eq!(
        direct.inspect(&k).await.unwrap(),
        lock_core::LockState::Free
    );
    // The pooled connection is still usable, and the next acquire is fine.
    let next = take(&lock, &k, Duration::from_secs(30), "free again").await;
    assert!(next.fencing_token() > lease.fencing_token());
    lock.release(&next).await.expect("released again");
}

#[tokio::test]
async fn notifications_on_a_pooled_connection_never_fail_an_operation() {
    // The one pooled connection of a client LISTENs (as a server session
    // behind a transaction pooler may), and notifications reach it while
    // it is idle: they sit before the reply to its next statement.
    let ns = random_name("stray");
    let config = PostgresConfig::from_url(&format!("{}?namespace={ns}", server().url())).unwrap();
    // Like the client's own pool: no check (which would skip the
    // notifications) before a connection is handed out.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(sqlx::postgres::PgConnectOptions::from_str(&server().url()).unwrap())
        .await
        .unwrap();
    let lock = PostgresLock::from_pool(pool, config).unwrap();
    let other = client(&ns).await;
    let k = key("stray");
    // Once without notifications, so sqlx has every statement prepared and
    // cached: the reply then starts with the notification.
    let lease = take(&lock, &k, Duration::from_secs(30), "free").await;
    let lease = lock.extend(&lease, Duration::from_secs(30)).await.unwrap();
    lock.release(&lease).await.unwrap();
    sqlx::raw_sql("LISTEN distlock_stray")
        .execute(lock.pool())
        .await
        .unwrap();
    let notify = || async {
        admin(&other, "NOTIFY distlock_stray, 'x'").await;
        // Let the server send it to the idle connection first (the
        // assertions hold whenever it arrives).
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for round in 0..3 {
        notify().await;
        let lease = lock
            .try_acquire(&k, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("round {round}: acquire failed: {e}"))
            .lease()
            .unwrap_or_else(|| panic!("round {round}: the free lock was reported held"));
        match other.inspect(&k).await.unwrap() {
            lock_core::LockState::Held { fencing_token, .. } => {
                assert_eq!(fencing_token, lease.fencing_token(), "round {round}")
            }
            state => panic!("round {round}: acquired, yet {state:?}"),
        }
        notify().await;
        let lease = lock
            .extend(&lease, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("round {round}: extend failed: {e}"));
        notify().await;
        lock.release(&lease)
            .await
            .unwrap_or_else(|e| panic!("round {round}: release failed: {e}"));
        assert_eq!(
            other.inspect(&k).await.unwrap(),
            lock_core::LockState::Free,
            "round {round}"
        );
    }
}

#[tokio::test]
async fn waiters_behind_a_transaction_pooler_listen_on_listen_url() {
    let pooler = transaction_pooler().await;
    let ns = random_name("pooler_listen");
    let direct = percent_encode(&server().url());
    let config = PostgresConfig::from_url(&format!(
        "{}?namespace={ns}&listen_url={direct}",
        pooler.url()
    ))
    .unwrap()
    .max_connections(1);
    let lock = PostgresLock::with_config(config).await.unwrap();
    // Released through the pooler; heard on the direct listener connection.
    assert_release_heard(&lock, &lock, &key("pooled"), "the waiter was not woken").await;
}

/// `holder` takes `k` for 60 s, `waiter` subscribes, `holder` releases: the
/// waiter must hear of it long before the 60 s run out (`why_not` says
/// what it means if it does not).
async fn assert_release_heard(
    holder: &PostgresLock,
    waiter: &PostgresLock,
    k: &LockKey,
    why_not: &str,
) {
    let lease = take(holder, k, Duration::from_secs(60), "free").await;
    // Returns once the server listens for releases on this client.
    let mut watch = waiter.watch(k).await.unwrap().expect("native wait");
    holder.release(&lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), watch.released())
        .await
        .expect(why_not)
        .unwrap();
}

#[tokio::test]
async fn serializable_default_isolation_never_fails_concurrent_acquires() {
    // A database whose transactions are serializable unless they say
    // otherwise: concurrent acquires of one key conflict there (SQLSTATE
    // 40001), and such a statement was rolled back, so it can be sent again.
    let admin_client = client("serializable").await;
    let database = random_name("distlock_serializable");
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
        .max_connections(16);
    let lock = Arc::new(PostgresLock::with_config(config).await.unwrap());
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(lock.pool())
        .await
        .unwrap();
    assert_eq!(isolation, "serializable");

    let mut errors = Vec::new();
    for round in 0..10 {
        // A new key (first inserts race) every other round; the same key,
        // just released (updates race), in between.
        let k = key(&format!("contended-{}", round / 2));
        let attempts: Vec<_> = (0..16)
            .map(|_| {
                let lock = lock.clone();
                let k = k.clone();
                tokio::spawn(async move { lock.try_acquire(&k, Duration::from_secs(30)).await })
            })
            .collect();
        let mut granted = Vec::new();
        for attempt in attempts {
            match attempt.await.unwrap() {
                Ok(AcquireAttempt::Acquired(lease)) => granted.push(lease),
                Ok(AcquireAttempt::Held { .. }) => {}
                Err(e) => errors.push(e.to_string()),
            }
        }
        assert!(granted.len() <= 1, "two holders at once: {granted:?}");
        for lease in granted {
            lock.release(&lease).await.unwrap();
        }
    }
    assert!(
        errors.is_empty(),
        "{} of 160 acquires failed, e.g. {:?}",
        errors.len(),
        errors.first()
    );
}

#[test]
fn a_listener_whose_runtime_shut_down_is_restarted() {
    let ns = random_name("runtime");
    let k = key("job");
    // The waiter's client is made, and first waits, on a runtime that then
    // shuts down, taking the listener task with it. Its pool connects
    // lazily, so it holds no connection of the dead runtime.
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let waiter = first.block_on(async {
        let config =
            PostgresConfig::from_url(&format!("{}?namespace={ns}", server().url())).unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(
                sqlx::postgres::PgConnectOptions::from_str(&server().url()).unwrap(),
            );
        let waiter = PostgresLock::from_pool(pool, config).unwrap();
        // Waiting starts the listener task on this runtime.
        drop(waiter.watch(&k).await.unwrap().expect("native wait"));
        waiter
    });
    drop(first);

    let second = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let holder = client(&ns).await;
        assert_release_heard(
            &holder,
            &waiter,
            &k,
            "the release was not delivered: the listener task died with its runtime",
        )
        .await;
    });

    // The listener task now runs on `second`. A waiter on a third runtime is
    // waiting when `second` shuts down: it must be woken, start a new
    // listener, and get the lock released meanwhile long before its holder's
    // 60 s TTL.
    let waiter = Arc::new(ObservedLock::new(Arc::new(waiter)));
    let third = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    third.block_on(async {
        let holder = client(&ns).await;
        let lease = take(&holder, &k, Duration::from_secs(60), "free").await;
        let waiting = {
            let waiter = waiter.clone();
            let k = k.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(60);
                waiter.acquire(&k, Duration::from_secs(5), deadline).await
            })
        };
        while waiter.attempts() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::task::spawn_blocking(move || drop(second))
            .await
            .unwrap();
        holder.release(&lease).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(20), waiting)
            .await
            .expect("the waiter slept on: its listener task died with its runtime while it waited")
            .unwrap()
            .unwrap();
        assert!(
            got.is_some(),
            "the waiter gave up although the lock was released"
        );
    });
}

#[tokio::test]
async fn a_cancelled_statement_never_keeps_its_pool_slot() {
    let proxy = Proxy::start(server_addr()).await;
    let proxied = server()
        .url()
        .replace(&server_addr().to_string(), &proxy.addr.to_string());
    let ns = random_name("cancel_slot");
    let config = PostgresConfig::from_url(&format!(
        "{proxied}?namespace={ns}&connect_timeout_ms=5000&operation_timeout_ms=1000"
    ))
    .unwrap()
    .max_connections(1);
    let lock = PostgresLock::with_config(config).await.unwrap();
    // sqlx checks a connection given back to the pool with a round trip of
    // its own (not bounded in time); black-hole it only once that is done.
    while lock.pool().num_idle() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.black_hole_current();
    // A caller's own timeout drops the call while its statement waits for
    // a reply that never comes.
    let cancelled = tokio::time::timeout(
        Duration::from_millis(200),
        lock.try_acquire(&key("a"), Duration::from_secs(30)),
    )
    .await;
    assert!(
        cancelled.is_err(),
        "the black-holed call returned: {cancelled:?}"
    );
    // The pool's only connection is dead. The next call must get a new one,
    // not wait forever behind the dead one.
    let next = lock
        .try_acquire(&key("b"), Duration::from_secs(30))
        .await
        .expect("the cancelled call's pool slot was freed");
    assert!(next.lease().is_some());
}

#[tokio::test]
async fn a_cancelled_acquire_that_the_server_granted_is_undone() {
    let ns = random_name("cancel_grant");
    // Its own table, so the blocked statement is easy to find.
    let table = random_name("cancel_locks");
    let url = format!("{}?namespace={ns}&table={table}", server().url());
    let lock = PostgresLock::connect(&url).await.unwrap();
    let other = PostgresLock::connect(&url).await.unwrap();
    let k = key("granted-late");
    let first = take(&lock, &k, Duration::from_secs(60), "free").await;
    lock.release(&first).await.unwrap();

    // A transaction locks the (free) row, so the next acquire blocks on it.
    let mut tx = other.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE namespace = $1 AND key = $2 FOR UPDATE",
        other.table()
    ))
    .bind(&ns)
    .bind(k.as_str())
    .execute(&mut *tx)
    .await
    .unwrap();
    let attempt = lock.try_acquire(&k, Duration::from_secs(60));
    let stats = sqlx::PgPool::connect(&server().url()).await.unwrap();
    let blocked = async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'",
            )
            .bind(&table)
            .fetch_one(&stats)
            .await
            .unwrap();
            if waiting > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        result = attempt => panic!("the acquire did not block on the row lock: {result:?}"),
        () = blocked => {}
    }
    // The acquire was dropped while its statement waits on the server. Once
    // the row is unlocked, that statement takes the free lock; nobody has
    // its lease, so it must be given back, not left held for its 60 s TTL.
    tx.commit().await.unwrap();
    let got = other
        .acquire(
            &k,
            Duration::from_secs(60),
            Instant::now() + Duration::from_secs(20),
        )
        .await
        .unwrap();
    assert!(
        got.is_some(),
        "the lock granted to a dropped acquire stayed held"
    );
}
