//! What the Redis tests share: a server of their own, raw connections,
//! pub/sub counts, MONITOR phases, ACL users.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_conformance::server::{self, ServerProcess};
use distlock_core::{AcquireAttempt, Lease, LockClient, LockError, LockKey};
use distlock_redis::redis::{self, aio::MultiplexedConnection, AsyncCommands};
use distlock_redis::RedisLock;
use futures_util::StreamExt;

/// A client over a new [`RedisLock`] connected to `url`.
pub async fn connect(url: &str) -> Result<LockClient, LockError> {
    Ok(LockClient::new(RedisLock::connect(url).await?))
}

pub fn start(kind: server::Redis) -> ServerProcess {
    ServerProcess::start(Arc::new(kind)).expect("cannot start redis-server (is it installed?)")
}

/// A fresh key with `prefix` in it.
pub use distlock_conformance::naming::unique_key;

/// A plain connection for the test's own commands. No response timeout: a
/// command sent while the test stalls the server waits for the stall's end.
pub async fn raw(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection_with_config(
            &redis::AsyncConnectionConfig::new().set_response_timeout(None),
        )
        .await
        .expect("raw connection to the test server")
}

/// How many clients are subscribed to `channel` (`which` is `NUMSUB`, or
/// `SHARDNUMSUB` for a shard channel).
/// Subscribers of the channels of `base` (one per client waiting on the
/// key: `<base>:<client id>`), in all.
async fn numsub_of(conn: &mut MultiplexedConnection, which: &str, base: &str) -> i64 {
    let list = if which == "SHARDNUMSUB" {
        "SHARDCHANNELS"
    } else {
        "CHANNELS"
    };
    let channels: Vec<String> = redis::cmd("PUBSUB")
        .arg(list)
        .arg(format!("{base}:*"))
        .query_async(conn)
        .await
        .unwrap();
    if channels.is_empty() {
        return 0;
    }
    let counts: Vec<(String, i64)> = redis::cmd("PUBSUB")
        .arg(which)
        .arg(&channels)
        .query_async(conn)
        .await
        .unwrap();
    counts.iter().map(|(_, n)| n).sum()
}

/// Waits (up to 10 s) until `channel` has exactly `want` subscribers.
pub async fn await_numsub(conn: &mut MultiplexedConnection, channel: &str, want: i64, what: &str) {
    await_numsub_within(conn, channel, want, what, Duration::from_secs(10)).await
}

/// Waits (up to 10 s) until shard channel `channel` has exactly `want`
/// subscribers on the node of `conn`.
pub async fn await_shard_numsub(
    conn: &mut MultiplexedConnection,
    channel: &str,
    want: i64,
    what: &str,
) {
    await_subscribers(
        conn,
        "SHARDNUMSUB",
        channel,
        want,
        what,
        Duration::from_secs(10),
    )
    .await
}

/// Waits up to `within` until `channel` has exactly `want` subscribers.
pub async fn await_numsub_within(
    conn: &mut MultiplexedConnection,
    channel: &str,
    want: i64,
    what: &str,
    within: Duration,
) {
    await_subscribers(conn, "NUMSUB", channel, want, what, within).await
}

async fn await_subscribers(
    conn: &mut MultiplexedConnection,
    which: &str,
    channel: &str,
    want: i64,
    what: &str,
    within: Duration,
) {
    let deadline = Instant::now() + within;
    loop {
        let count = numsub_of(conn, which, channel).await;
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
pub async fn server_time_us(conn: &mut MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000 + micros
}

/// `lock.acquire(key)` with a 10 s TTL on its own task, waiting up to `wait`.
pub fn spawn_acquire(
    lock: &LockClient,
    key: &LockKey,
    wait: Duration,
) -> tokio::task::JoinHandle<Result<Option<Lease>, distlock_core::LockError>> {
    let lock = lock.clone();
    let key = key.clone();
    tokio::spawn(async move {
        lock.acquire(&key, Duration::from_secs(10), Instant::now() + wait)
            .await
    })
}

/// A lock held for 60 s by one client and a waiter of another client,
/// subscribed, that may wait 20 s: only a release notification can wake it.
pub struct Waiting {
    key: LockKey,
    pub channel: String,
    lease: Lease,
    task: tokio::task::JoinHandle<Result<Option<Lease>, distlock_core::LockError>>,
}

impl Waiting {
    pub async fn start(
        holder: &LockClient,
        waiter: &LockClient,
        conn: &mut MultiplexedConnection,
        prefix: &str,
    ) -> Self {
        let key = unique_key(prefix);
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
    pub async fn release_wakes_the_waiter(
        self,
        holder: &LockClient,
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

/// The base of the release channels of `key` in the default namespace
/// (each waiting client subscribes `<base>:<client id>`; test keys need no
/// escaping).
pub fn channel_of(key: &LockKey) -> String {
    format!("distlock:{{{}}}:released", key.as_str())
}

/// The Redis key of lock `key` in the default namespace.
pub fn lock_key_of(key: &LockKey) -> String {
    format!("distlock:{{{}}}:lock", key.as_str())
}

/// Stalls the server: from the reply on, it runs no client's command for
/// `ms` milliseconds (`CLIENT PAUSE … ALL`).
pub async fn pause_all(conn: &mut MultiplexedConnection, ms: u64) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("ALL")
        .query_async(conn)
        .await
        .unwrap();
}

pub fn acquired(attempt: AcquireAttempt) -> Lease {
    match attempt {
        AcquireAttempt::Acquired(lease) => lease,
        AcquireAttempt::Held { .. } => panic!("expected the lock to be free"),
    }
}

/// Watches the server with MONITOR and splits what clients sent into phases.
pub struct Monitor {
    lines: Arc<Mutex<Vec<String>>>,
    conn: MultiplexedConnection,
    marks: u32,
}

impl Monitor {
    pub async fn start(url: &str) -> Self {
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
    pub async fn mark(&mut self) -> Vec<(String, String)> {
        let phase = self.phase().await;
        phase.iter().filter_map(|l| parse_monitor_line(l)).collect()
    }

    /// The commands scripts ran since the previous mark, as (name, first
    /// argument) pairs.
    pub async fn mark_scripted(&mut self) -> Vec<(String, String)> {
        let phase = self.phase().await;
        phase.iter().filter_map(|l| parse_script_line(l)).collect()
    }

    /// The MONITOR lines since the previous mark.
    async fn phase(&mut self) -> Vec<String> {
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
                    return lines
                        .drain(..=at)
                        .filter(|l| !l.contains("distlock-test-mark-"))
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
pub fn parse_monitor_line(line: &str) -> Option<(String, String)> {
    let (client, rest) = line.split_once('[')?.1.split_once(']')?;
    if client.ends_with("lua") {
        return None;
    }
    let mut quoted = rest.split('"').skip(1).step_by(2);
    let name = quoted.next()?.to_ascii_lowercase();
    let arg = quoted.next().unwrap_or("").to_owned();
    Some((name, arg))
}

/// As [`parse_monitor_line`], for the commands a script ran only.
pub fn parse_script_line(line: &str) -> Option<(String, String)> {
    let (client, _) = line.split_once('[')?.1.split_once(']')?;
    if !client.ends_with("lua") {
        return None;
    }
    parse_monitor_line(&line.replacen("lua]", "script]", 1))
}

pub fn names(commands: &[(String, String)]) -> Vec<&str> {
    commands.iter().map(|(n, _)| n.as_str()).collect()
}

/// Exactly the permissions the crate docs list for namespace `distlock`.
pub const DOC_PERMISSIONS: &[&str] = &[
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
    "+zrange",
    "+zadd",
    "+zrem",
    "+zremrangebyscore",
];

/// Creates (or resets) the ACL user `name` with password `pw` and `rules`.
pub async fn acl_user(admin: &mut MultiplexedConnection, name: &str, rules: &[&str]) {
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

/// Starts a server group of the harness (blocking work) from async code.
pub async fn start_group<T: Send + 'static>(start: fn() -> std::io::Result<T>) -> T {
    tokio::task::spawn_blocking(start)
        .await
        .unwrap()
        .expect("cannot start the redis servers")
}

/// A guard of one client on a lock and a waiter of another client on the
/// same lock, for a fault in between.
pub struct HeldAndAwaited {
    pub guard: distlock_core::LockGuard,
    pub waiter: tokio::task::JoinHandle<Result<Option<distlock_core::LockGuard>, LockError>>,
}

impl HeldAndAwaited {
    /// `holder` takes `key` with a renewing guard (TTL `ttl`); `waiter`
    /// waits for it for up to 60 s (the caller sees it subscribe).
    pub async fn start(
        holder: &LockClient,
        waiter: &LockClient,
        key: &LockKey,
        ttl: Duration,
    ) -> Self {
        let options = distlock_core::LockOptions::new(ttl);
        let guard = distlock_core::Locker::new(holder.clone())
            .try_lock(key, &options)
            .await
            .unwrap()
            .expect("the key is free");
        let waiting = distlock_core::Locker::new(waiter.clone());
        let key2 = key.clone();
        let waiter_task = tokio::spawn(async move {
            waiting
                .acquire(&key2, &options.with_wait(Duration::from_secs(60)))
                .await
        });
        Self {
            guard,
            waiter: waiter_task,
        }
    }

    /// After the fault: the guard either still holds the lock (then it is
    /// released, and the waiter gets it; at its TTL if the release failed)
    /// or reported it lost (then the waiter gets it, never before the
    /// loss). Either way the waiter's
    /// fencing token is greater. Returns the waiter's guard.
    pub async fn settle(self) -> distlock_core::LockGuard {
        let Self { guard, waiter } = self;
        // Read in this order: a waiter that already got the lock implies
        // the guard knew it had lost it.
        let waiter_done = waiter.is_finished();
        let lost = guard.is_lost();
        assert!(
            !waiter_done || lost,
            "the waiter got the lock while the guard held it"
        );
        let token = guard.fencing_token();
        if !lost {
            // The first request on a connection to the dead primary fails
            // (Unavailable) and the next one finds the new primary; a
            // release that fails so leaves the lock to its TTL.
            if let Err(e) = guard.release().await {
                assert!(
                    matches!(
                        e.kind(),
                        distlock_core::ErrorKind::NotHeld | distlock_core::ErrorKind::Unavailable
                    ),
                    "{e}"
                );
            }
        }
        let next = waiter
            .await
            .unwrap()
            .expect("the waiter rides through the failover")
            .expect("the waiter gets the lock once it is free");
        assert!(
            next.fencing_token() > token,
            "fencing tokens grow across the failover"
        );
        next
    }
}

/// A proxy in front of `server`, and a client through it whose requests
/// time out after 300 ms (so a held reply is an unknown outcome soon).
pub async fn behind_proxy(
    server: &ServerProcess,
) -> (distlock_conformance::fault::Proxy, RedisLock) {
    let proxy = distlock_conformance::fault::Proxy::start(server.addr())
        .await
        .unwrap();
    let lock = RedisLock::connect(&format!(
        "redis://{}/?operation_timeout_ms=300&connect_timeout_ms=2000",
        proxy.addr()
    ))
    .await
    .unwrap();
    (proxy, lock)
}

/// One raw acquisition attempt on `lock` for `owner` (no client around it:
/// no owner token minted, nothing released on a timeout).
pub async fn raw_acquire(
    lock: &RedisLock,
    key: &LockKey,
    owner: distlock_core::OwnerToken,
    ttl: Duration,
) -> Result<distlock_core::AcquireReply, LockError> {
    use distlock_core::LockBackend;
    lock.acquire(distlock_core::AcquireRequest {
        key,
        owner,
        ttl,
        renewing: false,
        settling: false,
        holder: None,
    })
    .await
}

/// Polls `check` every 20 ms until it gives a value (up to 20 s).
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value at `redis_key` once there is one.
pub async fn value_appears(conn: &MultiplexedConnection, redis_key: &str) -> String {
    eventually(&format!("{redis_key} is written"), || {
        let mut conn = conn.clone();
        async move { conn.get::<_, Option<String>>(redis_key).await.unwrap() }
    })
    .await
}

/// The fencing token in a lock value `dl1:<owner>:<token>`.
pub fn token_of(value: &str) -> u64 {
    value
        .rsplit(':')
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("not a distlock lock value: {value:?}"))
}

/// Every connection the proxy accepted so far stalls for an hour in both
/// directions (dead, though open); connections opened later pass.
pub fn kill_connections_so_far(proxy: &distlock_conformance::fault::Proxy) -> usize {
    use distlock_conformance::fault::Direction;
    let accepted = proxy.connections_accepted();
    for connection in 0..accepted {
        for direction in [Direction::ToServer, Direction::ToClient] {
            proxy.delay_connection(connection, direction, Duration::from_secs(3600));
        }
    }
    accepted
}

/// Tries an acquisition on a fresh key up to `attempts` times, until one
/// answers; the errors before it (each a `Timeout` or `Unavailable`).
pub async fn first_answer_within(
    lock: &LockClient,
    attempts: usize,
) -> Result<Vec<LockError>, Vec<LockError>> {
    let mut failures = Vec::new();
    for _ in 0..attempts {
        let key = unique_key("recover");
        match lock.try_acquire(&key, Duration::from_secs(5)).await {
            Ok(attempt) => {
                lock.release(&acquired(attempt)).await.unwrap();
                return Ok(failures);
            }
            Err(e) => {
                assert!(e.is_transient(), "{e}");
                failures.push(e);
            }
        }
    }
    Err(failures)
}

/// The WARN events emitted on this thread while it lives (for tests on a
/// current-thread runtime), as text.
pub struct Warnings {
    events: Arc<Mutex<Vec<String>>>,
    _guard: tracing::subscriber::DefaultGuard,
}

impl Warnings {
    pub fn capture() -> Self {
        let events = Arc::new(Mutex::new(Vec::new()));
        let guard = tracing::subscriber::set_default(Capture {
            events: events.clone(),
        });
        Self {
            events,
            _guard: guard,
        }
    }

    /// Every warning so far, emptying the list.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }

    /// Whether a warning so far names `name`, emptying the list.
    pub fn named(&self, name: &str) -> bool {
        self.take().iter().any(|w| w.contains(name))
    }
}

struct Capture {
    events: Arc<Mutex<Vec<String>>>,
}

struct Text(String);

impl tracing::field::Visit for Text {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        let _ = write!(self.0, "{}={:?} ", field.name(), value);
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut text = Text(String::new());
        event.record(&mut text);
        self.events.lock().unwrap().push(text.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Checks that what is at `name` is still `before` (a [`snapshot`]), its
/// expiry kept or none, as it was.
pub async fn left_alone(
    conn: &mut MultiplexedConnection,
    name: &str,
    before: &(Vec<u8>, i64),
    what: &str,
) {
    let after = snapshot(conn, name).await;
    assert_eq!(after.0, before.0, "{what}: the garbage was changed");
    assert_eq!(after.1 < 0, before.1 < 0, "{what}: its expiry changed");
}

/// What is at `name`: its serialized value and its PTTL.
pub async fn snapshot(conn: &mut MultiplexedConnection, name: &str) -> (Vec<u8>, i64) {
    let dump: Vec<u8> = redis::cmd("DUMP")
        .arg(name)
        .query_async(conn)
        .await
        .unwrap();
    let pttl: i64 = conn.pttl(name).await.unwrap();
    (dump, pttl)
}
