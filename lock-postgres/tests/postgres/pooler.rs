//! Behind a transaction pooler, and notifications on pooled connections.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::checker::ExclusionChecker;
use distlock_conformance::ObservedLock;
use distlock_core::{LockBackend, LockClient, LockState};
use distlock_postgres::{PostgresConfig, PostgresLock};

use super::support::*;

#[tokio::test]
async fn release_through_a_transaction_pooler_reports_success() {
    let pooler = transaction_pooler().await;
    let ns = random_name("pooler");
    // One pooled connection: the statements and the listener's LISTEN all
    // run in PgBouncer's single server session.
    let config = PostgresConfig::from_url(&format!("{}?namespace={ns}", pooler.url()))
        .unwrap()
        .max_connections(1);
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
    let ns = random_name("pooler_listen");
    let direct = percent_encode(&server().url());
    let config = PostgresConfig::from_url(&format!(
        "{}?namespace={ns}&listen_url={direct}",
        pooler.url()
    ))
    .unwrap()
    .max_connections(1);
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
    let ns = random_name("pooled_many");
    // A table of its own, so creating it runs through the pooler too.
    let table = random_name("pooled_locks");
    let url = format!(
        "{}?namespace={ns}&table={table}&pool_mode=transaction&listen_url={}",
        pooler.url(),
        percent_encode(&server().url())
    );
    let mut clients = Vec::new();
    for _ in 0..3 {
        let config = PostgresConfig::from_url(&url).unwrap().max_connections(4);
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
    let ns = random_name("pooled_poll");
    let url = format!(
        "{}?namespace={ns}&pool_mode=transaction&poll_interval_ms=50",
        pooler.url()
    );
    let holder = Pg::connect(&url).await;
    let waiter = Pg::connect(&url).await;
    // Nothing can wake it: it says so, and never LISTENs through the pooler.
    assert!(!waiter.backend.capabilities().native_wait);
    assert!(waiter.backend.watch(&key("x")).await.unwrap().is_none());
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
