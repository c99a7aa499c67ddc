//! Behind a transaction pooler, and notifications on pooled connections.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::checker::ExclusionChecker;
use distlock_conformance::ObservedLock;
use distlock_core::{LockBackend, LockClient, LockState};
use distlock_postgres::{PoolMode, PostgresConfig, PostgresLock};

use super::support::*;

#[tokio::test]
async fn release_through_a_transaction_pooler_reports_success() {
    let pooler = transaction_pooler().await;
    let ns = unique_name("pooler");
    // One pooled connection: the statements and the listener's LISTEN all
    // run in PgBouncer's single server session. `pool_mode=session` says
    // so, which skips the probe that would find the transaction pooler
    // (and keep waiters from listening through it).
    let config = PostgresConfig::from_url(&format!(
        "{}?namespace={ns}&pool_mode=session",
        pooler.url()
    ))
    .unwrap()
    .with_max_connections(1);
    let lock = Pg::with_config(config).await;
    let direct = client(&ns).await;
    let k = key("pooled");
    let lease = take(&lock, &k, Duration::from_secs(30), "free").await;
    // A waiter makes the client LISTEN, through the pooler: the server
    // session that runs the release below now listens on the channel the
    // release notifies, so the notification arrives on a pooled connection.
    let _watch = lock.watch(&k).await;
    lock.release(&lease)
        .await
        .expect("the row was released, so release reports success");
    assert_eq!(direct.inspect(&k).await.unwrap(), LockState::Free);
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
    let ns = unique_name("stray");
    let config = PostgresConfig::from_url(&format!("{}?namespace={ns}", server().url())).unwrap();
    // Like the client's own pool: no check (which would skip the
    // notifications) before a connection is handed out.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(sqlx::postgres::PgConnectOptions::from_str(&server().url()).unwrap())
        .await
        .unwrap();
    let lock = Pg::new(PostgresLock::from_pool(pool, config).unwrap());
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
            LockState::Held { fencing_token, .. } => {
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
            LockState::Free,
            "round {round}"
        );
    }
}

#[tokio::test]
async fn waiters_behind_a_transaction_pooler_listen_on_listen_url() {
    let pooler = transaction_pooler().await;
    let ns = unique_name("pooler_listen");
    let direct = percent_encode(&server().url());
    let config = PostgresConfig::from_url(&format!(
        "{}?namespace={ns}&listen_url={direct}",
        pooler.url()
    ))
    .unwrap()
    .with_max_connections(1);
    let lock = Pg::with_config(config).await;
    // Released through the pooler; heard on the direct listener connection.
    assert_release_heard(&lock, &lock, &key("pooled"), "the waiter was not woken").await;
}

#[tokio::test]
async fn several_clients_with_several_connections_through_a_transaction_pooler() {
    // Fewer server connections than the clients open: PgBouncer moves each
    // client's transactions between server sessions, which breaks named
    // (and unnamed extended-protocol) prepared statements.
    let pooler = transaction_pooler_of(3).await;
    let ns = unique_name("pooled_many");
    // A table of its own, so creating it runs through the pooler too.
    let table = unique_name("pooled_locks");
    let url = format!(
        "{}?namespace={ns}&table={table}&pool_mode=transaction&listen_url={}",
        pooler.url(),
        percent_encode(&server().url())
    );
    let mut clients = Vec::new();
    for _ in 0..3 {
        let config = PostgresConfig::from_url(&url)
            .unwrap()
            .with_max_connections(4);
        clients.push(Pg::with_config(config).await);
    }
    let checker = ExclusionChecker::new();
    let shared = key("shared");
    let mut tasks = Vec::new();
    for (i, client) in clients.iter().enumerate() {
        for task in 0..4 {
            let client = client.clone();
            let checker = checker.clone();
            let shared = shared.clone();
            tasks.push(tokio::spawn(async move {
                let own = key(&format!("own-{i}-{task}"));
                for round in 0..10 {
                    let lease = take(&client, &own, Duration::from_secs(30), "own key").await;
                    let lease = client
                        .extend(&lease, Duration::from_secs(30))
                        .await
                        .unwrap();
                    assert!(matches!(
                        client.inspect(&own).await.unwrap(),
                        LockState::Held { .. }
                    ));
                    client.release(&lease).await.unwrap();
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let lease = client
                        .acquire(&shared, Duration::from_secs(30), deadline)
                        .await
                        .unwrap()
                        .unwrap_or_else(|| panic!("round {round}: waited 30 s for the shared key"));
                    checker
                        .critical_section(&shared, lease.fencing_token())
                        .await;
                    client.release(&lease).await.unwrap();
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("every call through the pooler succeeds");
    }
    let report = checker.verify().expect("no overlap, tokens grow");
    assert_eq!(report.sections, 120);
}

#[tokio::test]
async fn waiters_behind_a_transaction_pooler_without_listen_url_poll() {
    let pooler = transaction_pooler_of(2).await;
    let ns = unique_name("pooled_poll");
    let url = format!(
        "{}?namespace={ns}&pool_mode=transaction&retry_interval_ms=50",
        pooler.url()
    );
    let holder = Pg::connect(&url).await;
    let waiter = Pg::connect(&url).await;
    // Nothing can wake it: it says so, and never LISTENs through the pooler.
    assert!(!waiter.backend.capabilities().native_wait);
    assert!(waiter
        .backend
        .watch(&key("x"), distlock_core::OwnerToken::random())
        .await
        .unwrap()
        .is_none());
    // Nor an observer: it reads.
    assert!(!waiter.backend.capabilities().holder_watch);
    let admin = waiter.backend.admin().expect("operator calls");
    assert!(admin.watch_holder(&key("x")).await.unwrap().is_none());
    let observed = Arc::new(ObservedLock::new(waiter.client.clone()));
    let waiting = LockClient::new(observed.clone());
    let k = key("polled");
    let lease = take(&holder, &k, Duration::from_secs(60), "free").await;
    let task = {
        let k = k.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            waiting.acquire(&k, Duration::from_secs(5), deadline).await
        })
    };
    while observed.attempts() < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    holder.release(&lease).await.unwrap();
    let got = task
        .await
        .unwrap()
        .unwrap()
        .expect("a polling waiter gets the released lock long before the holder's 60 s");
    assert!(got.fencing_token() > lease.fencing_token());
}

/// What `clients` clients, connecting at once with `url` (one table of
/// their own, so creating it runs through the pooler too) and each taking,
/// extending and releasing keys of its own a few times, ended with: the
/// clients if every one of them completed; otherwise every error must be
/// a connect-time `Config` error naming the pooler parameters, and there
/// must be no client that completed — a URL that half works fails the test.
/// Every client ended up in `mode` with wake-ups from the server, and a
/// release by the first wakes a waiter of the second.
async fn assert_mode_and_woken(clients: &[Pg], mode: PoolMode) {
    for lock in clients {
        assert_eq!(lock.backend.pool_mode(), mode);
        assert!(lock.backend.capabilities().native_wait);
        assert!(lock.backend.capabilities().holder_watch);
    }
    assert_release_heard(
        &clients[0],
        &clients[1],
        &key("heard"),
        "the waiter was not woken",
    )
    .await;
}

async fn all_or_none(url: &str, clients: usize) -> Option<Vec<Pg>> {
    let mut tasks = Vec::new();
    for i in 0..clients {
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let lock = match PostgresLock::connect(&url).await {
                Ok(lock) => Pg::new(lock),
                Err(e) => return Err(format!("client {i}: connect: {e}")),
            };
            for round in 0..5 {
                let k = key(&format!("own-{i}-{round}"));
                let step = |what: &str, e: distlock_core::LockError| {
                    format!("client {i} round {round}: {what}: {e}")
                };
                let lease = lock
                    .try_acquire(&k, Duration::from_secs(30))
                    .await
                    .map_err(|e| step("acquire", e))?
                    .lease()
                    .ok_or_else(|| format!("client {i} round {round}: its own key was held"))?;
                let lease = lock
                    .extend(&lease, Duration::from_secs(30))
                    .await
                    .map_err(|e| step("extend", e))?;
                match lock.inspect(&k).await.map_err(|e| step("inspect", e))? {
                    LockState::Held { fencing_token, .. }
                        if fencing_token == lease.fencing_token() => {}
                    state => return Err(format!("client {i} round {round}: held, yet {state:?}")),
                }
                lock.release(&lease).await.map_err(|e| step("release", e))?;
            }
            Ok(lock)
        }));
    }
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for task in tasks {
        match task.await.expect("client task") {
            Ok(lock) => done.push(lock),
            Err(e) => failed.push(e),
        }
    }
    if failed.is_empty() {
        return Some(done);
    }
    assert!(
        done.is_empty(),
        "the URL half works: {} of {clients} clients completed, {} failed; first failure: {}",
        done.len(),
        failed.len(),
        failed[0]
    );
    for e in &failed {
        assert!(
            e.contains("connect:")
                && e.contains("pool_mode=transaction")
                && e.contains("listen_url"),
            "every client fails at connect, naming pool_mode=transaction and listen_url: {e}"
        );
    }
    None
}

#[tokio::test]
async fn a_plain_url_through_a_transaction_pooler_never_half_works() {
    // Fewer server connections than the clients open, as with a busy
    // PgBouncer: transactions of one client connection move between
    // server sessions, which breaks the driver's prepared statements.
    let pooler = transaction_pooler_of(3).await;
    let url = format!(
        "{}?namespace={}&table={}",
        pooler.url(),
        unique_name("plain"),
        unique_name("plain_locks")
    );
    let clients = all_or_none(&url, 12)
        .await
        .expect("the clients find the pooler at connect and work");
    for lock in &clients {
        assert_eq!(lock.backend.pool_mode(), PoolMode::Transaction);
        // Nothing can wake a waiter through the pooler: it polls.
        assert!(!lock.backend.capabilities().native_wait);
        assert!(lock
            .backend
            .watch(&key("x"), distlock_core::OwnerToken::random())
            .await
            .unwrap()
            .is_none());
    }
    // Waiting works (by polling) and a release hands the key over.
    let (holder, waiter) = (&clients[0], &clients[1]);
    let k = key("handed-over");
    let lease = take(holder, &k, Duration::from_secs(60), "free").await;
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            waiter.acquire(&k, Duration::from_secs(30), deadline).await
        })
    };
    holder.release(&lease).await.unwrap();
    let got = waiting
        .await
        .unwrap()
        .unwrap()
        .expect("the waiter gets the released key long before the holder's 60 s");
    assert!(got.fencing_token() > lease.fencing_token());
}

#[tokio::test]
async fn a_plain_url_through_a_transaction_pooler_of_one_session_never_half_works() {
    // Every client shares PgBouncer's one server session: one session, yet
    // many clients' prepared statements in it.
    let pooler = transaction_pooler().await;
    let url = format!(
        "{}?namespace={}&table={}",
        pooler.url(),
        unique_name("plain1"),
        unique_name("plain1_locks")
    );
    let clients = all_or_none(&url, 8)
        .await
        .expect("the clients find the pooler at connect and work");
    for lock in &clients {
        assert_eq!(lock.backend.pool_mode(), PoolMode::Transaction);
    }
}

#[tokio::test]
async fn a_plain_url_with_listen_url_through_a_transaction_pooler_wakes_waiters() {
    let pooler = transaction_pooler_of(2).await;
    let url = format!(
        "{}?namespace={}&listen_url={}",
        pooler.url(),
        unique_name("plain_listen"),
        percent_encode(&server().url())
    );
    let clients = all_or_none(&url, 4).await.expect("the clients work");
    assert_mode_and_woken(&clients, PoolMode::Transaction).await;
}

#[tokio::test]
async fn a_direct_connection_is_not_taken_for_a_transaction_pooler() {
    let url = format!("{}?namespace={}", server().url(), unique_name("direct"));
    let clients = all_or_none(&url, 4).await.expect("direct clients work");
    // Prepared statements: sqlx's cache holds the lock statements.
    let prepared: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'sqlx_s_%'",
    )
    .fetch_one(clients[0].pool())
    .await
    .unwrap();
    assert!(
        prepared > 0,
        "no prepared statements on a direct connection"
    );
    assert_mode_and_woken(&clients, PoolMode::Session).await;
}

#[tokio::test]
async fn a_session_pooler_is_not_taken_for_a_transaction_pooler() {
    // Enough server sessions for every client connection of the test (the
    // clients', their listeners' and the probes'), as a session pool
    // needs: one per client connection for as long as it is connected.
    let pooler = session_pooler_of(40).await;
    let url = format!("{}?namespace={}", pooler.url(), unique_name("session"));
    let clients = all_or_none(&url, 6)
        .await
        .expect("clients through a session pool work");
    assert_mode_and_woken(&clients, PoolMode::Session).await;
}

#[tokio::test]
async fn the_probe_finds_a_transaction_pooler_at_connect() {
    // A client alone on a new pooler: no prepared statement of anyone's is
    // in its server sessions, so no statement of the client can have made
    // the switch; the probe found the pooler.
    for sessions in [1, 3, 20] {
        let pooler = transaction_pooler_of(sessions).await;
        let url = format!("{}?namespace={}", pooler.url(), unique_name("probe"));
        let lock = Pg::connect(&url).await;
        assert_eq!(
            lock.backend.pool_mode(),
            PoolMode::Transaction,
            "{sessions} server sessions"
        );
    }
}

#[tokio::test]
async fn a_statement_meeting_shared_prepared_statements_switches_to_the_simple_protocol() {
    // pool_mode=session says there is no transaction pooler (no probe);
    // one server session behind PgBouncer in transaction mode: the second
    // client's first prepared statement, sqlx_s_1, meets the first
    // client's (42P05). It was refused, so it is sent again, with literals,
    // as every later statement of that client.
    let pooler = transaction_pooler().await;
    let url = format!(
        "{}?namespace={}&table={}&pool_mode=session",
        pooler.url(),
        unique_name("switch"),
        unique_name("switch_locks")
    );
    let connect = |url: String| async move {
        Pg::with_config(
            PostgresConfig::from_url(&url)
                .unwrap()
                .with_max_connections(1),
        )
        .await
    };
    let first = connect(url.clone()).await;
    assert_eq!(first.backend.pool_mode(), PoolMode::Session);
    let second = connect(url).await;
    assert_eq!(second.backend.pool_mode(), PoolMode::Transaction);
    for (name, lock) in [("first", &first), ("second", &second)] {
        let k = key(name);
        let lease = take(lock, &k, Duration::from_secs(30), "free").await;
        let lease = lock.extend(&lease, Duration::from_secs(30)).await.unwrap();
        lock.release(&lease).await.unwrap();
    }
    // Nothing to hear through the pooler any more: the second one polls.
    assert!(second
        .backend
        .watch(&key("x"), distlock_core::OwnerToken::random())
        .await
        .unwrap()
        .is_none());
}
