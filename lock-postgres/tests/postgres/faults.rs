//! A killed server, black-holed connections, cancelled statements.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::server::{Postgres, ServerProcess};
use distlock_core::AcquireAttempt;
use distlock_postgres::PostgresConfig;

use super::support::*;

#[tokio::test]
async fn survives_a_server_kill_and_restart() {
    // Its own server: this test kills it.
    let server = tokio::task::spawn_blocking(|| ServerProcess::start(Arc::new(Postgres)))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start PostgreSQL: {e}"));
    let url = format!(
        "{}?namespace=fault&connect_timeout_ms=1000&operation_timeout_ms=1000",
        server.url()
    );
    let a = Pg::connect(&url).await;
    let b = Pg::connect(&url).await;
    let k = key("fault");
    let lease = take(&a, &k, Duration::from_secs(60), "free").await;
    let mut watch = b.watch(&k).await;

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
    // The listener noticed and woke its waiters, telling them to subscribe
    // again.
    let woken = tokio::time::timeout(Duration::from_secs(30), watch.released())
        .await
        .expect("waiters woken when the listener connection died");
    assert!(woken.is_err(), "woken as if released: {woken:?}");

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

#[tokio::test]
async fn black_holed_connections_time_out_and_the_client_recovers() {
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("blackhole");
    let lock = Pg::connect(&format!(
        "{proxied}?namespace={ns}&connect_timeout_ms=500&operation_timeout_ms=500"
    ))
    .await;
    let k = key("k");
    let lease = take(&lock, &k, Duration::from_secs(60), "free").await;
    let mut watch = lock.watch(&k).await;

    black_hole_current(&proxy);
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
    // pings, notices, and wakes its waiters to subscribe again (reconnecting); a waiter then gets
    // a lock released by another client through NOTIFY, long before the
    // holder's 60 s lease would run out.
    let woken = tokio::time::timeout(Duration::from_secs(30), watch.released())
        .await
        .expect("the dead listener was noticed and its waiters woken");
    assert!(woken.is_err(), "woken as if released: {woken:?}");
    let holder = client(&ns).await;
    let k2 = key("held-across-the-black-hole");
    let held = take(&holder, &k2, Duration::from_secs(60), "free").await;
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

#[tokio::test]
async fn a_cancelled_statement_never_keeps_its_pool_slot() {
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("cancel_slot");
    let config = PostgresConfig::from_url(&format!(
        "{proxied}?namespace={ns}&connect_timeout_ms=5000&operation_timeout_ms=1000"
    ))
    .unwrap()
    .with_max_connections(1);
    let lock = Pg::with_config(config).await;
    // sqlx checks a connection given back to the pool with a round trip of
    // its own (not bounded in time); black-hole it only once that is done.
    while lock.pool().num_idle() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    black_hole_current(&proxy);
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
    let ns = unique_name("cancel_grant");
    // Its own table: no other test touches its rows.
    let table = unique_name("cancel_locks");
    let url = format!("{}?namespace={ns}&table={table}", server().url());
    let lock = Pg::connect(&url).await;
    let other = Pg::connect(&url).await;
    let k = key("granted-late");
    let first = take(&lock, &k, Duration::from_secs(60), "free").await;
    lock.release(&first).await.unwrap();

    // A transaction locks the (free) row, so the next acquire blocks on it.
    let mut tx = other.pool().begin().await.unwrap();
    let tx_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
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
            // Found by what it waits for: its text is cut short in
            // pg_stat_activity (track_activity_query_size).
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND $1 = ANY (pg_blocking_pids(pid))",
            )
            .bind(tx_pid)
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
