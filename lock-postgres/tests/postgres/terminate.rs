//! Connections the server ends under the client: `pg_terminate_backend`
//! in the middle of acquire, extend, release and while listening, and
//! `idle_session_timeout` closing idle pooled connections.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::ObservedLock;
use distlock_core::{Lease, LockClient, LockError, LockKey, LockState};

use super::support::*;

/// Runs `op` on `k` while another transaction holds the row locked, kills
/// the backend running it once it waits for that row lock, then lets the
/// row go. Returns the call's result.
async fn interrupted(
    lock: &Pg,
    app: &str,
    admin: &Pg,
    k: &LockKey,
    lease: Option<Lease>,
    op: Op,
) -> Result<Option<Lease>, LockError> {
    let blocker = lock_row(admin, lock, k).await;
    let call = spawn_op(lock, k, lease, op);
    let pid = backend(admin, app, "wait_event_type = 'Lock'").await;
    terminate(admin, pid).await;
    blocker.commit().await.unwrap();
    call.await.unwrap()
}

#[tokio::test]
async fn terminated_in_the_middle_of_a_call_the_call_is_sent_again() {
    let ns = unique_name("terminate");
    let admin = client(&ns).await;
    let (lock, app) = named_client(&ns, "").await;
    let k = key("interrupted");
    // The row exists, so there is something to lock.
    let first = take(&lock, &k, Duration::from_secs(30), "free").await;
    lock.release(&first).await.unwrap();

    // Each call's statement is running (waiting for a row lock) when its
    // backend is terminated: the client sends it again on a new connection
    // and reports the outcome, no error.
    let lease = interrupted(&lock, &app, &admin, &k, None, Op::Acquire)
        .await
        .expect("acquire sent again after its backend was terminated")
        .expect("the free lock was acquired");
    assert!(lease.fencing_token() > first.fencing_token());
    let lease = interrupted(&lock, &app, &admin, &k, Some(lease), Op::Extend)
        .await
        .expect("extend sent again after its backend was terminated")
        .expect("extended");
    match admin.inspect(&k).await.unwrap() {
        LockState::Held { fencing_token, .. } => assert_eq!(fencing_token, lease.fencing_token()),
        state => panic!("extended, yet {state:?}"),
    }
    interrupted(&lock, &app, &admin, &k, Some(lease.clone()), Op::Release)
        .await
        .expect("release sent again after its backend was terminated");
    assert_eq!(admin.inspect(&k).await.unwrap(), LockState::Free);
    // And the client goes on working.
    let next = take(&lock, &k, Duration::from_secs(30), "free again").await;
    assert!(next.fencing_token() > lease.fencing_token());
    lock.release(&next).await.unwrap();
}

#[tokio::test]
async fn a_terminated_listener_reconnects_and_wakes_its_waiters() {
    let ns = unique_name("terminate_listen");
    let holder = client(&ns).await;
    let (lock, app) = named_client(&ns, "").await;
    let observed = Arc::new(ObservedLock::new(lock.client.clone()));
    let waiter = LockClient::new(observed.clone());
    let k = key("listened");
    let lease = take(&holder, &k, Duration::from_secs(60), "free").await;
    let waiting = {
        let k = k.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            waiter.acquire(&k, Duration::from_secs(5), deadline).await
        })
    };
    let listening = "query LIKE 'LISTEN%'";
    let first = backend(&holder, &app, listening).await;
    while observed.attempts() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    terminate(&holder, first).await;
    // The waiter is woken by the lost connection, subscribes again (a new
    // listener connection) and waits on.
    let again = "query LIKE 'LISTEN%' AND pid <> ";
    backend(&holder, &app, &format!("{again}{first}")).await;
    holder.release(&lease).await.unwrap();
    let got = waiting
        .await
        .unwrap()
        .expect("waiting rides through a terminated listener without an error")
        .expect("woken by the release long before the holder's 60 s lease ran out");
    assert!(got.fencing_token() > lease.fencing_token());
}

#[tokio::test]
async fn idle_session_timeout_closing_pooled_connections_costs_no_error() {
    let ns = unique_name("idle_timeout");
    let admin = client(&ns).await;
    // The server closes this client's connections after 300 ms idle:
    // the listener's (a waiter below keeps one) and every pooled one.
    let (lock, app) = named_client(&ns, "&options=-c%20idle_session_timeout%3D300").await;
    let keys: Vec<LockKey> = (0..8).map(|i| key(&format!("k{i}"))).collect();
    for round in 0..3 {
        // Several calls at once: several pooled connections.
        let calls = keys.iter().map(|k| {
            let lock = lock.clone();
            let k = k.clone();
            async move {
                let lease = take(&lock, &k, Duration::from_secs(30), "free").await;
                let lease = lock.extend(&lease, Duration::from_secs(30)).await?;
                lock.release(&lease).await
            }
        });
        for result in futures_util::future::join_all(calls).await {
            result.unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        // Wait until the server closed every one of them.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !backends(&admin, &app, "true").await.is_empty() {
            assert!(Instant::now() < deadline, "idle connections never closed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Waiting works too: the listener connection is closed and reopened as
    // the timeout fires, and the release still wakes the waiter.
    let k = key("waited");
    let lease = take(&admin, &k, Duration::from_secs(60), "free").await;
    let waiting = {
        let lock = lock.clone();
        let k = k.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            lock.acquire(&k, Duration::from_secs(5), deadline).await
        })
    };
    let first = backend(&admin, &app, "query LIKE 'LISTEN%'").await;
    // The timeout closed the first listener connection and the waiter
    // subscribed again on a new one.
    backend(
        &admin,
        &app,
        &format!("query LIKE 'LISTEN%' AND pid <> {first}"),
    )
    .await;
    admin.release(&lease).await.unwrap();
    let got = waiting.await.unwrap().unwrap();
    assert!(got.is_some(), "the waiter was not woken by the release");
}
