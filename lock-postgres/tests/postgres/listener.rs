//! Waiters woken by LISTEN/NOTIFY, and a listener whose runtime shut down.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::fault::Direction;
use distlock_conformance::ObservedLock;
use distlock_core::{LockBackend, LockClient};
use distlock_postgres::{PostgresConfig, PostgresLock};

use super::support::*;

#[tokio::test]
async fn blocked_waiter_is_woken_by_notify_not_polling() {
    let ns = unique_name("wait");
    let holder = client(&ns).await;
    let observed = Arc::new(ObservedLock::new(client(&ns).await.client));
    let waiter = LockClient::new(observed.clone());
    let k = key("job");
    let lease = take(&holder, &k, Duration::from_secs(30), "free").await;
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
    let attempts = observed.attempts();
    assert!(
        attempts <= 2,
        "{attempts} acquire attempts while blocked for 2 s"
    );
}

#[test]
fn a_listener_whose_runtime_shut_down_is_restarted() {
    let ns = unique_name("runtime");
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
        let waiter = Pg::new(PostgresLock::from_pool(pool, config).unwrap());
        // Waiting starts the listener task on this runtime.
        drop(waiter.watch(&k).await);
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
    let observed = Arc::new(ObservedLock::new(waiter.client));
    let waiter = LockClient::new(observed.clone());
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
        while observed.attempts() == 0 {
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
async fn a_listener_whose_server_is_silent_fails_in_bounded_time_and_reconnects_later() {
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("listen_silent");
    let waiter = Pg::connect(&format!(
        "{proxied}?namespace={ns}&connect_timeout_ms=500&operation_timeout_ms=500"
    ))
    .await;
    let holder = client(&ns).await;
    let k = key("k");
    // The listener connects for the first waiter; the server's replies to
    // it are held back. Subscribing fails with a transient error, it does
    // not hang (the outer timeout only guards the test run).
    proxy.hold(Direction::ToClient);
    let watched = tokio::time::timeout(
        Duration::from_secs(30),
        waiter
            .backend
            .watch(&k, distlock_core::OwnerToken::random()),
    )
    .await
    .expect("subscribing through a silent server hung");
    match watched {
        Err(e) => assert!(e.is_transient(), "{e}"),
        Ok(_) => panic!("subscribed without a reply from the server"),
    }
    // Once the server answers again, the next waiter connects anew and
    // hears a release.
    proxy.pass(Direction::ToClient);
    assert_release_heard(
        &holder,
        &waiter,
        &k,
        "the listener never reconnected once its server answered again",
    )
    .await;
}
