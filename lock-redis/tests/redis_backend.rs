//! Redis-specific tests beyond the shared suite, each against its own
//! `redis-server` started on a loopback port (never an external server,
//! so command counts are exact).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conformance_tests::server::{self, ServerProcess};
use futures_util::StreamExt;
use lock_core::{AcquireAttempt, DistributedLock, ErrorKind, Lease, LockKey};
use lock_redis::redis::{self, aio::MultiplexedConnection, AsyncCommands};
use lock_redis::{RedisConfig, RedisLock};

fn start(kind: server::Redis) -> ServerProcess {
    ServerProcess::start(Arc::new(kind)).expect("cannot start redis-server (is it installed?)")
}

fn unique(prefix: &str) -> LockKey {
    LockKey::new(format!("{prefix}-{:016x}", rand_u64())).unwrap()
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    h.finish()
}

/// A plain connection for the test's own commands. No response timeout: a
/// command sent while the test stalls the server waits for the stall's end.
async fn raw(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection_with_config(
            &redis::AsyncConnectionConfig::new().set_response_timeout(None),
        )
        .await
        .expect("raw connection to the test server")
}

/// How many clients are subscribed to `channel`.
async fn numsub(conn: &mut MultiplexedConnection, channel: &str) -> i64 {
    let (_, count): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    count
}

/// Waits (up to 10 s) until `channel` has exactly `want` subscribers.
async fn await_numsub(conn: &mut MultiplexedConnection, channel: &str, want: i64, what: &str) {
    await_numsub_within(conn, channel, want, what, Duration::from_secs(10)).await
}

/// Waits up to `within` until `channel` has exactly `want` subscribers.
async fn await_numsub_within(
    conn: &mut MultiplexedConnection,
    channel: &str,
    want: i64,
    what: &str,
    within: Duration,
) {
    let deadline = Instant::now() + within;
    loop {
        let count = numsub(conn, channel).await;
        if count == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {channel} has {count} subscribers, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The server's clock (`TIME`) in microseconds.
async fn server_time_us(conn: &mut MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000 + micros
}

/// `lock.acquire(key)` with a 10 s TTL on its own task, waiting up to `wait`.
fn spawn_acquire(
    lock: &Arc<RedisLock>,
    key: &LockKey,
    wait: Duration,
) -> tokio::task::JoinHandle<Result<Option<Lease>, lock_core::LockError>> {
    let lock = lock.clone();
    let key = key.clone();
    tokio::spawn(async move {
        lock.acquire(&key, Duration::from_secs(10), Instant::now() + wait)
            .await
    })
}

/// A lock held for 60 s by one client and a waiter of another client,
/// subscribed, that may wait 20 s: only a release notification can wake it.
struct Waiting {
    key: LockKey,
    channel: String,
    lease: Lease,
    task: tokio::task::JoinHandle<Result<Option<Lease>, lock_core::LockError>>,
}

impl Waiting {
    async fn start(
        holder: &RedisLock,
        waiter: &Arc<RedisLock>,
        conn: &mut MultiplexedConnection,
        prefix: &str,
    ) -> Self {
        let key = unique(prefix);
        let channel = channel_of(&key);
        let lease = acquired(
            holder
                .try_acquire(&key, Duration::from_secs(60))
                .await
                .unwrap(),
        );
        let task = spawn_acquire(waiter, &key, Duration::from_secs(20));
        await_numsub(conn, &channel, 1, "the waiter subscribes").await;
        Self {
            key,
            channel,
            lease,
            task,
        }
    }

    /// Releases the holder's lock and returns the waiter's lease, checking
    /// by the server's clock that the waiter got it while the holder's key
    /// would still have been live (woken by the release, not by the TTL).
    async fn release_wakes_the_waiter(
        self,
        holder: &RedisLock,
        conn: &mut MultiplexedConnection,
    ) -> Lease {
        assert!(!self.task.is_finished(), "the lock is still held");
        let now = server_time_us(conn).await;
        let pttl: i64 = conn.pttl(lock_key_of(&self.key)).await.unwrap();
        let holder_expiry = now + u64::try_from(pttl).expect("the holder's key has a TTL") * 1000;
        holder.release(&self.lease).await.unwrap();
        let got = self
            .task
            .await
            .unwrap()
            .unwrap()
            .expect("the release wakes the waiter");
        let acquired_by = server_time_us(conn).await;
        assert!(
            acquired_by < holder_expiry,
            "the waiter got the lock only after the holder's TTL ran out"
        );
        assert!(got.fencing_token() > self.lease.fencing_token());
        got
    }
}

/// The release channel of `key` in the default namespace (test keys need no escaping).
fn channel_of(key: &LockKey) -> String {
    format!("distlock:{{{}}}:released", key.as_str())
}

/// The Redis key of lock `key` in the default namespace.
fn lock_key_of(key: &LockKey) -> String {
    format!("distlock:{{{}}}:lock", key.as_str())
}

/// Stalls the server: from the reply on, it runs no client's command for
/// `ms` milliseconds (`CLIENT PAUSE … ALL`).
async fn pause_all(conn: &mut MultiplexedConnection, ms: u64) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("ALL")
        .query_async(conn)
        .await
        .unwrap();
}

fn acquired(attempt: AcquireAttempt) -> Lease {
    match attempt {
        AcquireAttempt::Acquired(lease) => lease,
        AcquireAttempt::Held { .. } => panic!("expected the lock to be free"),
    }
}

/// Watches the server with MONITOR and splits what clients sent into phases.
struct Monitor {
    lines: Arc<Mutex<Vec<String>>>,
    conn: MultiplexedConnection,
    marks: u32,
}

impl Monitor {
    async fn start(url: &str) -> Self {
        let monitor = redis::Client::open(url)
            .unwrap()
            .get_async_monitor()
            .await
            .expect("MONITOR connection");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        tokio::spawn(async move {
            let mut stream = monitor.into_on_message::<String>();
            while let Some(line) = stream.next().await {
                sink.lock().unwrap().push(line);
            }
        });
        let mut monitor = Self {
            lines,
            conn: raw(url).await,
            marks: 0,
        };
        monitor.mark().await;
        monitor
    }

    /// The commands clients sent since the previous mark (commands run by
    /// scripts excluded), as (name, first argument) pairs.
    async fn mark(&mut self) -> Vec<(String, String)> {
        self.marks += 1;
        let marker = format!("distlock-test-mark-{}", self.marks);
        let _: String = redis::cmd("ECHO")
            .arg(&marker)
            .query_async(&mut self.conn)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            {
                let mut lines = self.lines.lock().unwrap();
                if let Some(at) = lines.iter().position(|l| l.contains(&marker)) {
                    let phase: Vec<String> = lines.drain(..=at).collect();
                    return phase
                        .iter()
                        .filter(|l| !l.contains("distlock-test-mark-"))
                        .filter_map(|l| parse_monitor_line(l))
                        .collect();
                }
            }
            assert!(Instant::now() < deadline, "MONITOR never showed {marker}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `1700000000.123456 [0 127.0.0.1:5555] "evalsha" "abc" "2" ...` ->
/// `("evalsha", "abc")`; `None` for commands a script ran (`[0 lua]`).
fn parse_monitor_line(line: &str) -> Option<(String, String)> {
    let (client, rest) = line.split_once('[')?.1.split_once(']')?;
    if client.ends_with("lua") {
        return None;
    }
    let mut quoted = rest.split('"').skip(1).step_by(2);
    let name = quoted.next()?.to_ascii_lowercase();
    let arg = quoted.next().unwrap_or("").to_owned();
    Some((name, arg))
}

fn names(commands: &[(String, String)]) -> Vec<&str> {
    commands.iter().map(|(n, _)| n.as_str()).collect()
}

#[tokio::test]
async fn acquire_extend_release_are_one_command_each() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = RedisLock::connect(&url).await.unwrap();
    // Warm up the lazily connected command connection.
    let warm = acquired(
        lock.try_acquire(&unique("warm"), Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&warm).await.unwrap();
    let mut monitor = Monitor::start(&url).await;
    let acquire_sha = lock_redis::acquire_script_sha();

    let key = unique("count");
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

#[tokio::test]
async fn a_blocked_waiter_attempts_at_most_twice() {
    let server = start(server::Redis::default());
    let url = server.url();
    let holder = RedisLock::connect(&url).await.unwrap();
    let waiter = Arc::new(RedisLock::connect(&url).await.unwrap());
    let key = unique("wait");

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

    let acquire_sha = lock_redis::acquire_script_sha();
    let attempts = |phase: &[(String, String)]| {
        phase
            .iter()
            .filter(|(n, a)| (n == "evalsha" && a == acquire_sha) || n == "eval")
            .count()
    };
    assert_eq!(attempts(&while_held), 1, "while held: {while_held:?}");
    assert!(
        names(&while_held).contains(&"subscribe"),
        "the waiter subscribed: {while_held:?}"
    );
    let total = attempts(&while_held) + attempts(&after_release);
    assert!(
        total <= 2,
        "the waiter made {total} acquire attempts: {while_held:?} {after_release:?}"
    );
    assert!(got.fencing_token() > lease.fencing_token());
    waiter.release(&got).await.unwrap();
}

#[tokio::test]
async fn password_in_the_url_and_wrong_password() {
    let server = start(server::Redis::with_password("s3cret-pw"));
    let url = server.url();
    assert!(url.starts_with("redis://:s3cret-pw@127.0.0.1:"));
    let lock = RedisLock::connect(&url).await.unwrap();
    let lease = acquired(
        lock.try_acquire(&unique("auth"), Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&lease).await.unwrap();
    // Waiting uses the same credentials on its pub/sub connection.
    assert!(lock.watch(&unique("auth-watch")).await.unwrap().is_some());

    let addr = server.addr();
    for bad in [
        format!("redis://:wrong@{addr}"),
        format!("redis://{addr}"),
        format!("redis://nobody:s3cret-pw@{addr}"),
    ] {
        let err = RedisLock::connect(&bad).await.unwrap_err();
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
    let lock = RedisLock::connect(&format!("{url}/?namespace=fv"))
        .await
        .unwrap();
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
        .fence_retention(Duration::from_millis(30));
    let lock = RedisLock::with_config(config).await.unwrap();
    let mut conn = raw(&url).await;
    let key = unique("retention");

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
            lock.release(&lease).await.unwrap();
        }
        // Past the lock TTL and the counter retention (max(30 ms, 2 * 10 ms)).
        tokio::time::sleep(Duration::from_millis(80)).await;
        let left: Vec<String> = conn.keys("fr:*").await.unwrap();
        assert!(left.is_empty(), "keys left behind: {left:?}");
    }
}

#[tokio::test]
async fn expired_lock_is_not_extended_or_recreated() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = RedisLock::connect(&format!("{url}/?namespace=ex"))
        .await
        .unwrap();
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
    let lock = RedisLock::connect(&format!(
        "{url}/?operation_timeout_ms=500&connect_timeout_ms=500"
    ))
    .await
    .unwrap();
    let key = unique("restart");
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
async fn waiters_resubscribe_after_the_pubsub_connection_is_killed() {
    let server = start(server::Redis::default());
    let url = server.url();
    let holder = RedisLock::connect(&url).await.unwrap();
    let waiter = Arc::new(RedisLock::connect(&url).await.unwrap());
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

#[tokio::test]
async fn from_an_application_connection_manager() {
    let server = start(server::Redis::default());
    let url = server.url();
    let client = redis::Client::open(url.as_str()).unwrap();
    let manager = redis::aio::ConnectionManager::new(client.clone())
        .await
        .unwrap();
    let lock = Arc::new(
        RedisLock::from_connection_manager(manager, client, RedisConfig::new().namespace("app"))
            .unwrap(),
    );
    let other = RedisLock::connect(&format!("{url}/?namespace=app"))
        .await
        .unwrap();
    let key = unique("shared");
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

/// Issue 12, bug 3: a SUBSCRIBE that times out (the server stalled) used to
/// drop the shared pub/sub connection without resubscribing: every other
/// waiter of the client lost its subscription and slept until the holder's
/// TTL although the lock was released.
#[tokio::test]
async fn a_timed_out_subscribe_leaves_other_waiters_subscribed() {
    let server = start(server::Redis::default());
    let url = server.url();
    let holder = RedisLock::connect(&url).await.unwrap();
    // The stall below lasts 1.6 operation timeouts: a SUBSCRIBE sent at its
    // start times out, a request sent after that timeout is answered in time.
    let waiter = Arc::new(
        RedisLock::connect(&format!("{url}/?operation_timeout_ms=500"))
            .await
            .unwrap(),
    );
    let mut conn = raw(&url).await;
    let waiting = Waiting::start(&holder, &waiter, &mut conn, "stalled").await;

    // From the reply on, the server runs no client's command for 800 ms.
    pause_all(&mut conn, 800).await;
    let other = waiter.watch(&unique("other")).await;
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

/// Creates (or resets) the ACL user `name` with password `pw` and `rules`.
async fn acl_user(admin: &mut MultiplexedConnection, name: &str, rules: &[&str]) {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(name)
        .arg("reset")
        .arg("on")
        .arg(">pw")
        .arg(rules)
        .query_async(admin)
        .await
        .unwrap();
}

/// Issue 12, bug 9: an ACL user without `SCRIPT` (so no `SCRIPT LOAD`) used
/// to connect and then fail every acquire with Config; the scripts are now
/// sent with EVAL when the server does not have them. The user has exactly
/// the permissions the crate docs list.
#[tokio::test]
async fn an_acl_user_without_script_permission_runs_the_scripts_with_eval() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    // Exactly the permissions the crate docs list (no SCRIPT).
    acl_user(
        &mut admin,
        "noscript",
        &[
            "~distlock:*",
            "&distlock:*",
            "+evalsha",
            "+eval",
            "+subscribe",
            "+unsubscribe",
            "+ping",
            "+type",
            "+get",
            "+set",
            "+del",
            "+pttl",
            "+pexpire",
            "+time",
            "+publish",
        ],
    )
    .await;
    let flush = || async {
        let mut admin = raw(&server.url()).await;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
    };
    flush().await;
    let url = format!("redis://noscript:pw@{}", server.addr());
    let holder = RedisLock::connect(&url).await.unwrap();
    let waiter = Arc::new(RedisLock::connect(&url).await.unwrap());

    let key = unique("noscript");
    let lease = acquired(
        holder
            .try_acquire(&key, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let lease = holder.extend(&lease, Duration::from_secs(5)).await.unwrap();
    holder.release(&lease).await.unwrap();

    // The script cache emptied (a restart, a failover): EVAL again.
    flush().await;
    let waiting = Waiting::start(&holder, &waiter, &mut admin, "noscript-wait").await;
    let got = waiting.release_wakes_the_waiter(&holder, &mut admin).await;
    flush().await;
    assert!(matches!(
        waiter.inspect(got.key()).await.unwrap(),
        lock_core::LockState::Held { .. }
    ));
    assert!(waiter.force_release(got.key()).await.unwrap());
}

/// Issue 12, bug 9: an ACL user that cannot do what distlock needs is
/// refused at connect, with a message naming the missing permission, instead
/// of failing (or silently not notifying waiters) later.
#[tokio::test]
async fn acl_users_missing_permissions_are_refused_at_connect() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "noeval",
            &["~distlock:*", "&distlock:*", "+@all", "-eval", "-evalsha"],
            "EVAL",
        ),
        (
            "nochannels",
            &["~distlock:*", "resetchannels", "+@all"],
            "&distlock:*",
        ),
        ("otherkeys", &["~other:*", "&*", "+@all"], "~distlock:*"),
        (
            "readonly",
            &["%R~distlock:*", "&distlock:*", "+@all"],
            "~distlock:*",
        ),
        (
            "nopublish",
            &["~distlock:*", "&distlock:*", "+@all", "-publish"],
            "PUBLISH",
        ),
    ];
    for (user, rules, named) in cases {
        acl_user(&mut admin, user, rules).await;
        let url = format!("redis://{user}:pw@{}", server.addr());
        let err = RedisLock::connect(&url)
            .await
            .expect_err(&format!("{user} ({rules:?}) is refused at connect"));
        assert_eq!(err.kind(), ErrorKind::Config, "{user}: {err}");
        assert!(
            err.message().contains(named),
            "{user}: the message does not name {named:?}: {err}"
        );
        assert!(
            !err.to_string().contains(":pw@"),
            "the password leaked: {err}"
        );
    }
    // The same user works in a namespace it may use.
    let lock = RedisLock::connect(&format!(
        "redis://otherkeys:pw@{}/?namespace=other",
        server.addr()
    ))
    .await
    .unwrap();
    let lease = acquired(
        lock.try_acquire(&unique("other"), Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&lease).await.unwrap();
}

/// Issue 12, bug 9: the release script deletes the key before it publishes;
/// a refused PUBLISH (channel permission revoked) used to turn a release
/// that happened into an error. Releases and force-releases now report
/// success (the lost notification is logged; waiters fall back to timers).
#[tokio::test]
async fn a_release_whose_notification_is_refused_still_succeeds() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    acl_user(
        &mut admin,
        "revoked",
        &["~distlock:*", "&distlock:*", "+@all"],
    )
    .await;
    let lock = RedisLock::connect(&format!("redis://revoked:pw@{}", server.addr()))
        .await
        .unwrap();
    let released = unique("revoked");
    let forced = unique("revoked-forced");
    let lease = acquired(
        lock.try_acquire(&released, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    acquired(
        lock.try_acquire(&forced, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("revoked")
        .arg("resetchannels")
        .query_async(&mut admin)
        .await
        .unwrap();

    lock.release(&lease).await.unwrap();
    assert!(lock.force_release(&forced).await.unwrap());
    for key in [&released, &forced] {
        let exists: bool = admin.exists(lock_key_of(key)).await.unwrap();
        assert!(!exists, "{key:?} was released");
    }
    assert_eq!(
        lock.release(&lease).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
}

/// Issue 12, cancellation audit: a `watch` dropped (here by a timeout) while
/// its SUBSCRIBE was in flight used to leave the channel subscribed on the
/// server with no local waiter, never unsubscribed by the idle sweep.
#[tokio::test]
async fn a_watch_dropped_during_its_subscribe_leaves_no_subscription() {
    let server = start(server::Redis::default());
    let url = server.url();
    let lock = RedisLock::connect(&url).await.unwrap();
    let mut conn = raw(&url).await;
    // Open the pub/sub connection, so the dropped call is in its SUBSCRIBE.
    drop(lock.watch(&unique("first")).await.unwrap());
    let key = unique("dropped");
    let channel = channel_of(&key);

    pause_all(&mut conn, 300).await;
    let dropped = tokio::time::timeout(Duration::from_millis(100), lock.watch(&key)).await;
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
