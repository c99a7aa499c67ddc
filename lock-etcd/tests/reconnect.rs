//! Reconnection: fencing order survives a server restart, and the watch
//! stream comes back by itself without losing a release that happened
//! while it was down.

mod common;

use std::time::{Duration, Instant};

use common::{
    acquire, any_server, connect, observed, own_server, proxy_for, through, unique_key, Waiting,
    SHORT_TIMEOUTS,
};
use distlock_core::LockBackend;
use distlock_etcd::EtcdLock;

/// Fencing tokens survive a restart; a waiter's watch reconnects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_fencing_order_and_watches_reconnect() {
    let server = own_server();
    let url = format!(
        "{}?operation_timeout_ms=1000&connect_timeout_ms=1000",
        server.url()
    );
    let holder = connect(&url).await;
    let waiter = connect(&url).await;
    let k = unique_key("restart");
    let before = acquire(&holder, &k, Duration::from_secs(30)).await;

    let task = {
        let waiter = waiter.clone();
        let k = k.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(25);
            waiter.acquire(&k, Duration::from_secs(30), deadline).await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| server.kill());
    // A dead server gives a typed error in bounded time.
    let err = holder
        .extend(&before, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    tokio::task::block_in_place(|| server.restart()).expect("restart");
    // The holder's lock survived (etcd keeps leases across restarts).
    let mut renewed = None;
    for _ in 0..50 {
        match holder.extend(&before, Duration::from_secs(30)).await {
            Ok(lease) => {
                renewed = Some(lease);
                break;
            }
            Err(e) if e.is_transient() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("extend after restart: {e}"),
        }
    }
    let renewed = renewed.expect("the client reconnects after a restart");
    // Give the waiter's watch time to be re-created, then release.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    holder
        .release(&renewed)
        .await
        .expect("release after restart");
    let after = task
        .await
        .unwrap()
        .expect("acquire across restart")
        .expect("woken after the release");
    assert!(after.fencing_token() > before.fencing_token());
    waiter.release(&after).await.unwrap();
}

/// Watch reconnect bookkeeping: a release while
/// the waiter's watch stream is down is not missed; once the stream is back
/// the waiter is woken and acquires, long before its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_during_a_watch_outage_wakes_the_waiter() {
    let server = any_server();
    let proxy = proxy_for(&server).await;
    let (attempts, waiter) = observed(&through(&proxy, SHORT_TIMEOUTS)).await;
    let holder = connect(&server.url()).await;
    let k = unique_key("outage");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    let waiting = Waiting::start(&attempts, &waiter, &k).await;
    // Cut the waiter's connections (its watch stream breaks) and keep new
    // ones from reaching the server while the lock is released.
    proxy.black_hole();
    proxy.drop_all();
    holder.release(&held).await.expect("release");
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.heal();
    let got = waiting.acquired().await;
    waiter.release(&got).await.expect("release");
}

/// After a reconnect, a waiter that leaves before
/// its watch is live again must not keep the other waiters of the client
/// from being woken (a release may have been missed while the stream was
/// down). Raw watches, so the test sees exactly the wake-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_leaving_during_a_reconnect_does_not_stop_the_wake_up() {
    let server = any_server();
    let proxy = proxy_for(&server).await;
    let lock = EtcdLock::connect(&through(&proxy, SHORT_TIMEOUTS))
        .await
        .expect("connect through the proxy");
    let holder = connect(&server.url()).await;
    let (stays_key, leaves_key) = (unique_key("stays"), unique_key("leaves"));
    let held_stays = acquire(&holder, &stays_key, Duration::from_secs(30)).await;
    let held_leaves = acquire(&holder, &leaves_key, Duration::from_secs(30)).await;
    let mut stays = lock
        .watch(&stays_key, distlock_core::OwnerToken::random())
        .await
        .expect("watch")
        .expect("etcd has watches");
    let leaves = lock
        .watch(&leaves_key, distlock_core::OwnerToken::random())
        .await
        .expect("watch")
        .expect("etcd has watches");
    // Both watches were live on a stream that breaks; both locks are
    // released while no new connection reaches the server, and one waiter
    // leaves before its watch is back.
    proxy.black_hole();
    proxy.drop_all();
    holder.release(&held_stays).await.expect("release");
    holder.release(&held_leaves).await.expect("release");
    drop(leaves);
    proxy.heal();
    let woken = tokio::time::timeout(Duration::from_secs(10), stays.released()).await;
    assert!(
        matches!(woken, Ok(Ok(()))),
        "the remaining waiter was not woken after the reconnect: {woken:?}"
    );
}

/// After the watch stream was lost and came back while the lock stayed
/// held, the waiter watches again: the release that follows wakes it (a
/// waiter that only re-checked once after the reconnect would sleep until
/// its deadline). Also when it waits behind another waiter, whose leaving
/// it must see on the new stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_a_watch_outage_wakes_the_waiter() {
    let server = any_server();
    let proxy = proxy_for(&server).await;
    let url = through(&proxy, SHORT_TIMEOUTS);
    let (first_attempts, first) = observed(&url).await;
    let (second_attempts, second) = observed(&url).await;
    let holder = connect(&server.url()).await;
    let k = unique_key("after-outage");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    let waiting_first = Waiting::start(&first_attempts, &first, &k).await;
    let waiting_second = Waiting::start(&second_attempts, &second, &k).await;
    // Both watches break; the lock stays held meanwhile.
    proxy.drop_all();
    // Time to watch again, so the release lands on the new watches (either
    // order must wake the waiter).
    tokio::time::sleep(Duration::from_secs(1)).await;
    holder.release(&held).await.expect("release");
    let got = waiting_first.acquired().await;
    first.release(&got).await.expect("release");
    let got = waiting_second.acquired().await;
    second.release(&got).await.expect("release");
}
