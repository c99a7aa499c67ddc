//! The pub/sub connection of waiters: lost, stalled, dropped mid-subscribe
//! (regression tests, through `distlock_core::Listener`).

use std::time::Duration;

use distlock_conformance::server;
use distlock_redis::redis;

use crate::support::*;

#[tokio::test]
async fn waiters_resubscribe_after_the_pubsub_connection_is_killed() {
    let server = start(server::Redis::default());
    let url = server.url();
    let holder = connect(&url).await.unwrap();
    let waiter = connect(&url).await.unwrap();
    let mut conn = raw(&url).await;
    let waiting = Waiting::start(&holder, &waiter, &mut conn, "resub").await;
    // Cut its pub/sub connection.
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    // The waiter's client subscribes again on a new connection by itself.
    await_numsub(&mut conn, &waiting.channel, 1, "the waiter resubscribes").await;
    let got = waiting.release_wakes_the_waiter(&holder, &mut conn).await;
    waiter.release(&got).await.unwrap();
}

/// A SUBSCRIBE that times out (the server stalled) used to
/// drop the shared pub/sub connection without resubscribing: every other
/// waiter of the client lost its subscription and slept until the holder's
/// TTL although the lock was released.
#[tokio::test]
async fn a_timed_out_subscribe_leaves_other_waiters_subscribed() {
    let server = start(server::Redis::default());
    let url = server.url();
    let holder = connect(&url).await.unwrap();
    // The stall below lasts 1.6 operation timeouts: a SUBSCRIBE sent at its
    // start times out, a request sent after that timeout is answered in time.
    let waiter = connect(&format!("{url}/?operation_timeout_ms=500"))
        .await
        .unwrap();
    let mut conn = raw(&url).await;
    let waiting = Waiting::start(&holder, &waiter, &mut conn, "stalled").await;

    // From the reply on, the server runs no client's command for 800 ms.
    pause_all(&mut conn, 800).await;
    let other = waiter
        .backend()
        .watch(&unique_key("other"), distlock_core::OwnerToken::random())
        .await;
    let err = other.expect_err("a SUBSCRIBE sent during the stall times out");
    assert!(err.is_transient(), "{err}");

    // The first waiter is subscribed again, and the release wakes it.
    await_numsub(
        &mut conn,
        &waiting.channel,
        1,
        "the other waiter stays subscribed",
    )
    .await;
    let got = waiting.release_wakes_the_waiter(&holder, &mut conn).await;
    waiter.release(&got).await.unwrap();
}

/// Cancellation: a `watch` dropped (here by a timeout) while
/// its SUBSCRIBE was in flight used to leave the channel subscribed on the
/// server with no local waiter, never unsubscribed by the idle sweep.
#[tokio::test]
async fn a_watch_dropped_during_its_subscribe_leaves_no_subscription() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&url).await.unwrap();
    let mut conn = raw(&url).await;
    // Open the pub/sub connection, so the dropped call is in its SUBSCRIBE.
    drop(
        lock.backend()
            .watch(&unique_key("first"), distlock_core::OwnerToken::random())
            .await
            .unwrap(),
    );
    let key = unique_key("dropped");
    let channel = channel_of(&key);

    pause_all(&mut conn, 300).await;
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        lock.backend()
            .watch(&key, distlock_core::OwnerToken::random()),
    )
    .await;
    assert!(dropped.is_err(), "the server was paused: {dropped:?}");
    // The server ran the SUBSCRIBE after the pause...
    await_numsub(&mut conn, &channel, 1, "the SUBSCRIBE reached the server").await;
    // ... and the idle sweep (every 10 s) takes it back.
    await_numsub_within(
        &mut conn,
        &channel,
        0,
        "the channel nobody waits on is unsubscribed",
        Duration::from_secs(25),
    )
    .await;
}
