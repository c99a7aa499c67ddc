//! Behind a transaction pooler, and notifications on pooled connections.

use std::str::FromStr;
use std::time::Duration;

use lock_core::LockState;
use lock_postgres::{PostgresConfig, PostgresLock};

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
