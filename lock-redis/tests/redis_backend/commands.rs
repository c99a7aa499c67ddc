//! One command per operation, credentials, foreign values, the fencing
//! counter's retention, expiry, restarts, an application's connection.

use std::time::{Duration, Instant};

use distlock_conformance::server;
use distlock_core::{AcquireAttempt, ClientOptions, ErrorKind, LockClient, LockKey};
use distlock_redis::redis::{self, AsyncCommands};
use distlock_redis::{RedisConfig, RedisLock};

use crate::support::*;

#[tokio::test]
async fn acquire_extend_release_are_one_command_each() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&url).await.unwrap();
    // Warm up the lazily connected command connection.
    let warm = acquired(
        lock.try_acquire(&unique_key("warm"), Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&warm).await.unwrap();
    let mut monitor = Monitor::start(&url).await;
    let acquire_sha = distlock_redis::acquire_script_sha();

    let key = unique_key("count");
    let lease = acquired(
        lock.try_acquire(&key, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let acquire = monitor.mark().await;
    let lease = lock.extend(&lease, Duration::from_secs(5)).await.unwrap();
    let extend = monitor.mark().await;
    lock.release(&lease).await.unwrap();
    let release = monitor.mark().await;

    assert_eq!(names(&acquire), ["evalsha"], "acquire: {acquire:?}");
    assert_eq!(acquire[0].1, acquire_sha);
    assert_eq!(names(&extend), ["evalsha"], "extend: {extend:?}");
    assert_ne!(extend[0].1, acquire_sha);
    assert_eq!(names(&release), ["evalsha"], "release: {release:?}");
    assert_ne!(release[0].1, acquire_sha);

    // A refused attempt is one command too, and reports the holder's PTTL.
    let holder = acquired(
        lock.try_acquire(&key, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    monitor.mark().await;
    match lock
        .try_acquire(&key, Duration::from_secs(5))
        .await
        .unwrap()
    {
        AcquireAttempt::Held { expires_in } => {
            let expires_in = expires_in.expect("redis reports the holder's PTTL");
            assert!(expires_in <= Duration::from_secs(30) && expires_in > Duration::ZERO);
        }
        AcquireAttempt::Acquired(_) => panic!("the lock is held"),
    }
    assert_eq!(names(&monitor.mark().await), ["evalsha"]);
    lock.release(&holder).await.unwrap();
}

/// A waiter on a held key tries once unsubscribed (Redis declares
/// `attempt_before_watch`: a free key would have needed no subscription),
/// subscribes, tries again (joining the line), then waits: one more
/// attempt after the release, none while held.
#[tokio::test]
async fn a_blocked_waiter_tries_subscribes_tries_then_waits_for_the_release() {
    let server = start(server::Redis::default());
    let url = server.url();
    let holder = connect(&url).await.unwrap();
    let waiter = connect(&url).await.unwrap();
    let key = unique_key("wait");

    let lease = acquired(
        holder
            .try_acquire(&key, Duration::from_secs(10))
            .await
            .unwrap(),
    );
    let mut monitor = Monitor::start(&url).await;
    let task = spawn_acquire(&waiter, &key, Duration::from_secs(30));
    // The holder keeps the lock for 2 s.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!task.is_finished(), "the waiter must not get a held lock");
    let while_held = monitor.mark().await;
    holder.release(&lease).await.unwrap();
    let got = task
        .await
        .unwrap()
        .unwrap()
        .expect("the waiter gets the lock after the release");
    let after_release = monitor.mark().await;

    let acquire_sha = distlock_redis::acquire_script_sha();
    let attempts = |phase: &[(String, String)]| {
        phase
            .iter()
            .filter(|(n, a)| (n == "evalsha" && a == acquire_sha) || n == "eval")
            .count()
    };
    let order: Vec<&str> = while_held
        .iter()
        .filter(|(n, a)| (n == "evalsha" && a == acquire_sha) || n == "subscribe")
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        order,
        ["evalsha", "subscribe", "evalsha"],
        "while held: {while_held:?}"
    );
    assert_eq!(
        attempts(&after_release),
        1,
        "after the release: {after_release:?}"
    );
    assert!(got.fencing_token() > lease.fencing_token());
    waiter.release(&got).await.unwrap();
}

#[tokio::test]
async fn password_in_the_url_and_wrong_password() {
    let server = start(server::Redis::with_password("s3cret-pw"));
    let url = server.url();
    assert!(url.starts_with("redis://:s3cret-pw@127.0.0.1:"));
    let lock = connect(&url).await.unwrap();
    let lease = acquired(
        lock.try_acquire(&unique_key("auth"), Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&lease).await.unwrap();
    // Waiting uses the same credentials on its pub/sub connection.
    assert!(lock
        .backend()
        .watch(
            &unique_key("auth-watch"),
            distlock_core::OwnerToken::random()
        )
        .await
        .unwrap()
        .is_some());

    let addr = server.addr();
    for bad in [
        format!("redis://:wrong@{addr}"),
        format!("redis://{addr}"),
        format!("redis://nobody:s3cret-pw@{addr}"),
    ] {
        let err = connect(&bad).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{bad}: {err}");
        assert!(
            err.message().contains("authentication failed"),
            "{bad}: unclear message: {err}"
        );
        assert!(
            !err.to_string().contains("wrong"),
            "the password leaked: {err}"
        );
    }
}

#[tokio::test]
async fn foreign_values_are_reported_and_untouched() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&format!("{url}/?namespace=fv")).await.unwrap();
    let mut conn = raw(&url).await;

    // A foreign string at the lock key.
    let key = LockKey::new("job:{a}").unwrap();
    let redis_key = "fv:{job:%7Ba%7D}:lock";
    let _: () = conn.set(redis_key, "someone else's value").await.unwrap();
    let err = lock
        .try_acquire(&key, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(
        err.message().contains(redis_key),
        "the error names the key: {err}"
    );
    let value: String = conn.get(redis_key).await.unwrap();
    assert_eq!(value, "someone else's value");
    let ttl: i64 = conn.pttl(redis_key).await.unwrap();
    assert_eq!(ttl, -1, "no expiry was added");

    // Another type at the lock key.
    let key2 = LockKey::new("hashed").unwrap();
    let _: () = conn.hset("fv:{hashed}:lock", "f", "v").await.unwrap();
    let err = lock
        .try_acquire(&key2, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    let field: String = conn.hget("fv:{hashed}:lock", "f").await.unwrap();
    assert_eq!(field, "v");

    // A lock we wrote, then overwritten by someone else: extend and release
    // report it and leave it.
    let key3 = LockKey::new("taken").unwrap();
    let lease = acquired(
        lock.try_acquire(&key3, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let _: () = conn.set("fv:{taken}:lock", "foreign").await.unwrap();
    assert_eq!(
        lock.extend(&lease, Duration::from_secs(5))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::Corrupted
    );
    assert_eq!(
        lock.release(&lease).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    let value: String = conn.get("fv:{taken}:lock").await.unwrap();
    assert_eq!(value, "foreign");

    // A foreign fencing counter.
    let key4 = LockKey::new("fenced").unwrap();
    let _: () = conn.set("fv:{fenced}:fence", "not a number").await.unwrap();
    let err = lock
        .try_acquire(&key4, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.message().contains("fv:{fenced}:fence"), "{err}");
    let exists: bool = conn.exists("fv:{fenced}:lock").await.unwrap();
    assert!(!exists, "nothing was written");
}

#[tokio::test]
async fn fencing_counter_expires_yet_tokens_keep_growing() {
    let server = start(server::Redis::default());
    let url = server.url();
    let config = RedisConfig::from_url(&format!("{url}/?namespace=fr"))
        .unwrap()
        .with_fence_retention(Duration::from_millis(30));
    let lock = LockClient::new(RedisLock::with_config(config).await.unwrap());
    let mut conn = raw(&url).await;
    let key = unique_key("retention");

    let mut last = 0;
    for round in 0..4 {
        let lease = acquired(
            lock.try_acquire(&key, Duration::from_millis(10))
                .await
                .unwrap(),
        );
        assert!(lease.fencing_token().get() > last, "round {round}");
        last = lease.fencing_token().get();
        if round % 2 == 0 {
            // On a loaded machine the 10 ms lock may expire before the
            // release arrives; either way it is free.
            if let Err(e) = lock.release(&lease).await {
                assert_eq!(e.kind(), ErrorKind::NotHeld, "round {round}: {e}");
            }
        }
        // Past the lock TTL and the counter retention (max(30 ms, 2 * 10 ms)).
        tokio::time::sleep(Duration::from_millis(80)).await;
        let mut left: Vec<String> = conn.keys("fr:*").await.unwrap();
        // The namespace's format marker stays for good, by design.
        left.retain(|k| k != "fr:format");
        assert!(left.is_empty(), "keys left behind: {left:?}");
    }
}

#[tokio::test]
async fn expired_lock_is_not_extended_or_recreated() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&format!("{url}/?namespace=ex")).await.unwrap();
    let mut conn = raw(&url).await;
    let key = LockKey::new("short").unwrap();
    let lease = acquired(
        lock.try_acquire(&key, Duration::from_millis(20))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(
        lock.extend(&lease, Duration::from_secs(5))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotHeld
    );
    let exists: bool = conn.exists("ex:{short}:lock").await.unwrap();
    assert!(!exists);
    assert_eq!(
        lock.release(&lease).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
}

#[tokio::test]
async fn survives_a_server_restart() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = connect(&format!(
        "{url}/?operation_timeout_ms=500&connect_timeout_ms=500"
    ))
    .await
    .unwrap();
    let key = unique_key("restart");
    let lease = acquired(
        lock.try_acquire(&key, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&lease).await.unwrap();

    server.kill();
    let err = lock
        .try_acquire(&key, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(
        err.is_transient(),
        "a dead server is Unavailable or Timeout: {err}"
    );

    server.restart().unwrap();
    // The client reconnects by itself (the script cache is empty again:
    // EVALSHA falls back to loading the script).
    let deadline = Instant::now() + Duration::from_secs(20);
    let lease = loop {
        match lock.try_acquire(&key, Duration::from_secs(5)).await {
            Ok(attempt) => break acquired(attempt),
            Err(e) if e.is_transient() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("no reconnect: {e}"),
        }
    };
    lock.release(&lease).await.unwrap();
}

#[tokio::test]
async fn from_an_application_connection_manager() {
    let server = start(server::Redis::default());
    let url = server.url();
    let client = redis::Client::open(url.as_str()).unwrap();
    let manager = redis::aio::ConnectionManager::new(client.clone())
        .await
        .unwrap();
    let config = RedisConfig::default();
    let config = config.with_client(ClientOptions::default().with_namespace("app"));
    let lock =
        LockClient::new(RedisLock::from_connection_manager(manager, client, config).unwrap());
    let other = connect(&format!("{url}/?namespace=app")).await.unwrap();
    let key = unique_key("shared");
    let lease = acquired(
        lock.try_acquire(&key, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    assert!(matches!(
        other
            .try_acquire(&key, Duration::from_secs(5))
            .await
            .unwrap(),
        AcquireAttempt::Held { .. }
    ));
    let waiting = spawn_acquire(&lock, &key, Duration::from_secs(20));
    tokio::time::sleep(Duration::from_millis(100)).await;
    lock.release(&lease).await.unwrap();
    let again = waiting
        .await
        .unwrap()
        .unwrap()
        .expect("woken by the release");
    lock.release(&again).await.unwrap();
}
