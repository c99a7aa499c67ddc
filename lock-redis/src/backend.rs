//! [`RedisLock`]: the client, its requests (scripts, replication waits) and the [`LockBackend`] and [`LockAdmin`] implementation; connecting lives in `connect`.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use distlock_core::{
    async_trait, with_timeout, AcquireReply, AcquireRequest, Capabilities, ExtendReply, HeldLock,
    HolderId, Listener, LockAdmin, LockBackend, LockError, LockKey, LockState, OwnerToken,
    ReleaseReply, ReleaseWatch, SemaphoreBackend, Unclaimed, IN_LOCK_CALL,
};
use redis::aio::ConnectionManager;
use redis::{Client, Value};

use crate::config::RedisConfig;
use crate::connect::replaceable_manager;
use crate::connection::{connect_budget, Commands};
use crate::errors;
use crate::keys::RedisKeys;
use crate::listener::{PubSub, Source};
use crate::replies;
use crate::scripts::{
    self, LuaScript, ACQUIRE_SCRIPT, EXTEND_MANY_SCRIPT, EXTEND_SCRIPT, FORCE_RELEASE_SCRIPT,
    INSPECT_SCRIPT, LEAVE_PERMIT_SCRIPT, LEAVE_SCRIPT, RELEASE_SCRIPT,
};
use crate::tls;
use crate::waiters::{Line, Waiters, TURN};

/// The most locks one extend script renews: a script blocks the server
/// while it runs, so a batch stays short (about a millisecond).
const EXTEND_BATCH: usize = 250;

/// A lock server on Redis: one server, the primary of a Sentinel group, or
/// a Redis Cluster.
///
/// One `RedisLock` is one client: a multiplexed command connection shared
/// by every lock operation (a [`ConnectionManager`] to one server; a
/// connection to the Sentinel primary, found again by asking the sentinels;
/// a cluster connection that routes each script to its slot's node), each
/// replaced by a new one after a request on it fails or times out, plus
/// one pub/sub connection (opened on the first wait) shared by every
/// waiter. Job code uses it through
/// [`LockClient`](distlock_core::LockClient) or [`Locker`](distlock_core::Locker).
///
/// ```no_run
/// use std::time::Duration;
/// use distlock_core::{LockClient, LockKey};
/// use distlock_redis::RedisLock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let client = LockClient::new(RedisLock::connect("redis://127.0.0.1:6379/?namespace=jobs").await?);
/// let key = LockKey::new("nightly-report")?;
/// if let Some(lease) = client.try_acquire(&key, Duration::from_secs(30)).await?.lease() {
///     // ... run the job, passing lease.fencing_token() to what it writes ...
///     client.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
pub struct RedisLock {
    commands: Arc<Commands>,
    config: RedisConfig,
    channels: Channels,
    listener: Listener<Source>,
    waiters: Arc<Waiters>,
}

/// The pub/sub commands: sharded (`SPUBLISH`, `SSUBSCRIBE`) in a cluster,
/// so a release reaches only the nodes of its slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Channels {
    pub(crate) publish: &'static str,
    pub(crate) subscribe: &'static str,
    pub(crate) unsubscribe: &'static str,
}

impl Channels {
    pub(crate) const CLASSIC: Channels = Channels {
        publish: "PUBLISH",
        subscribe: "SUBSCRIBE",
        unsubscribe: "UNSUBSCRIBE",
    };
    pub(crate) const SHARDED: Channels = Channels {
        publish: "SPUBLISH",
        subscribe: "SSUBSCRIBE",
        unsubscribe: "SUNSUBSCRIBE",
    };
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("server", &self.config.to_string())
            .field("namespace", &self.config.client().namespace())
            .finish_non_exhaustive()
    }
}

impl RedisLock {
    /// Connects to the server at `url` (see [`RedisConfig`] for the URL
    /// forms and parameters).
    ///
    /// Fails with [`ErrorKind::Config`](distlock_core::ErrorKind::Config) for a bad URL, wrong credentials, an
    /// ACL user missing a permission distlock needs (named), a TLS file
    /// that cannot be read or a certificate that is refused (which one and
    /// why), [`ErrorKind::Unavailable`](distlock_core::ErrorKind::Unavailable) or [`ErrorKind::Timeout`](distlock_core::ErrorKind::Timeout) if the
    /// server cannot be reached within the connect timeout.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(RedisConfig::from_url(url)?).await
    }

    /// Connects with explicit settings.
    pub async fn with_config(config: RedisConfig) -> Result<Self, LockError> {
        config.validate()?;
        let Some(server) = config.server_settings().cloned() else {
            return Err(LockError::config(
                "RedisConfig names no server; build it with RedisConfig::from_url or RedisConfig::with_server, or use RedisLock::from_connection_manager",
            ));
        };
        #[cfg(feature = "tls")]
        {
            // rustls needs a process-wide crypto provider; keep one the
            // application installed, else install ring.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let options = config.client();
        let what = format!("connecting to redis at {config}");
        let tls = tls::is_tls(&server);
        let certificates = tls::certificates(options.tls(), tls).await?;
        let connected = Self::open(server, &config, certificates, &what)
            .await
            .map_err(|e| tls::connect_hint(e, tls))?;
        let (commands, pubsub, channels) = connected;
        tracing::debug!(server = %config, namespace = %options.namespace(), "redis lock client ready");
        Ok(Self::new(commands, pubsub, channels, config))
    }

    /// Uses a connection the application already has (its [`ConnectionManager`]
    /// is cloned, not reconnected), and `pubsub` to open the one pub/sub
    /// connection waiters share (a `ConnectionManager` cannot carry pub/sub
    /// messages on RESP2). The server in `config`, if any, is ignored; its
    /// namespace, timeouts, retention and `min_replicas` apply. Permissions,
    /// the namespace's format marker and the `maxmemory-policy` are not
    /// checked up front: a missing
    /// permission shows at first use ([`ErrorKind::Config`](distlock_core::ErrorKind::Config), with the
    /// server's reason).
    ///
    /// If a request on the application's manager fails or times out, this
    /// client goes on with a `ConnectionManager` of its own to `pubsub`'s
    /// server (the driver's manager reconnects only once a connection
    /// closes, not after a timeout on one that stays open).
    ///
    /// ```no_run
    /// use distlock_core::ClientOptions;
    /// use distlock_redis::{RedisConfig, RedisLock};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let manager = redis::aio::ConnectionManager::new(client.clone()).await?;
    /// let config = RedisConfig::default().with_client(ClientOptions::default().with_namespace("jobs"));
    /// let lock = RedisLock::from_connection_manager(manager, client, config)?;
    /// # let _ = lock; Ok(()) }
    /// ```
    pub fn from_connection_manager(
        manager: ConnectionManager,
        pubsub: Client,
        config: RedisConfig,
    ) -> Result<Self, LockError> {
        config.validate()?;
        let commands = replaceable_manager(manager, &pubsub, config.client());
        Ok(Self::new(
            Commands::Single(commands),
            PubSub::Node(pubsub),
            Channels::CLASSIC,
            config,
        ))
    }

    fn new(commands: Commands, pubsub: PubSub, channels: Channels, config: RedisConfig) -> Self {
        let commands = Arc::new(commands);
        let unclaimed = Arc::new(OnceLock::new());
        let listener = Listener::new(Source::new(pubsub, unclaimed.clone()), config.client());
        let pass_on = {
            let (commands, publish) = (commands.clone(), channels.publish);
            let timeout = config.client().operation_timeout();
            move |channel: &str, owner: &str| {
                let Some((line, keys, client)) = RedisKeys::of_waiter_channel(channel) else {
                    return;
                };
                let member = format!("{client}:{owner}");
                let commands = commands.clone();
                tokio::spawn(async move {
                    let left = leave_line(&commands, publish, timeout, line, &keys, member);
                    match left.await {
                        Ok(_) => {
                            tracing::debug!(line = %keys.waiters, "a wake-up for a waiter that no longer waits: passed on")
                        }
                        Err(e) => {
                            tracing::debug!(line = %keys.waiters, error = %e, "passing on a wake-up for a waiter that no longer waits failed; the waiters behind it fall back to their timers")
                        }
                    }
                });
            }
        };
        let _ = unclaimed.set(Unclaimed::new(listener.notifier().clone(), pass_on));
        Self {
            commands,
            listener,
            channels,
            config,
            waiters: Waiters::new(),
        }
    }

    /// The settings of this client.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// A clone of the command connection (the current one: it is replaced
    /// after a request on it fails or times out), for the application's
    /// own use: `None` for Sentinel and Cluster, whose connections this
    /// client finds and routes itself.
    pub fn connection_manager(&self) -> Option<ConnectionManager> {
        match &*self.commands {
            Commands::Single(manager) => Some(manager.current().0),
            _ => None,
        }
    }

    fn keys(&self, key: &LockKey) -> RedisKeys {
        RedisKeys::new(self.config.client().namespace(), key)
    }

    /// The names of `key`'s semaphore.
    pub(crate) fn semaphore_keys(&self, key: &LockKey) -> RedisKeys {
        RedisKeys::semaphore(self.config.client().namespace(), key)
    }

    /// The command a release script publishes with.
    pub(crate) fn publish_command(&self) -> &'static str {
        self.channels.publish
    }

    /// The waiter-line member an attempt sends: an open wait's (it joins
    /// the line if the key is held), else empty. A settling attempt never
    /// joins: its wait is over.
    pub(crate) fn line_member(
        &self,
        line: Line,
        key: &LockKey,
        owner: OwnerToken,
        settling: bool,
    ) -> String {
        if settling {
            return String::new();
        }
        self.waiters.attempting(line, key, owner)
    }

    /// An attempt of `owner` was granted: its wait (if any) left the line,
    /// unless the attempt was `settling` (see
    /// [`OpenWaits::granted`](distlock_core::OpenWaits::granted)).
    pub(crate) fn line_granted(
        &self,
        line: Line,
        key: &LockKey,
        owner: OwnerToken,
        settling: bool,
    ) {
        self.waiters.granted(line, key, owner, settling);
    }

    /// How long the fencing counter is kept after an acquisition for `ttl`.
    pub(crate) fn retention_ms(&self, ttl: Duration) -> String {
        arg_millis(self.config.fence_retention().max(ttl.saturating_mul(2)))
    }

    /// What is left of the operation timeout of a call first sent at `sent`.
    pub(crate) fn time_left(&self, sent: Instant) -> Duration {
        self.config
            .client()
            .operation_timeout()
            .saturating_sub(sent.elapsed())
    }

    /// Opens `waiter`'s wait in `line` of `key` (at `keys`): subscribes
    /// to this client's channel of that line, under the waiter's name, and
    /// when the watch drops, takes the waiter out of the line if it may be
    /// in it (see [`crate::waiters`]).
    pub(crate) async fn watch_line(
        &self,
        line: Line,
        key: &LockKey,
        keys: RedisKeys,
        waiter: OwnerToken,
    ) -> Result<ReleaseWatch, LockError> {
        let channel = self.waiters.channel(&keys);
        let name = waiter.to_hex();
        // Connecting (the first waiter) and subscribing, however long other
        // waiters' subscriptions hold the connection: one bound in all.
        let mut watch = with_timeout(
            connect_budget(self.config.client()),
            "subscribing to release notifications",
            self.listener.watch_as(channel.clone(), &name),
        )
        .await?;
        let registration = self.waiters.opened(line, key, waiter);
        let leaving = Leaving {
            commands: self.commands.clone(),
            waiters: self.waiters.clone(),
            publish: self.channels.publish,
            timeout: self.config.client().operation_timeout(),
            line,
            key: key.clone(),
            keys,
            waiter,
            registration,
        };
        watch.leave_with(leaving.leave());
        Ok(watch)
    }

    /// Runs one script invocation under the operation timeout.
    pub(crate) async fn run(&self, call: Call<'_>) -> Result<Value, LockError> {
        let timeout = self.config.client().operation_timeout();
        Ok(self.execute(call, None, timeout).await?.0)
    }

    /// Runs a writing script, then, with [`min_replicas`](RedisConfig::min_replicas)
    /// set, waits for that many replicas to acknowledge it (`WAIT`, on the
    /// same connection): the reply and whether they did.
    pub(crate) async fn run_replicated(
        &self,
        call: Call<'_>,
    ) -> Result<(Value, Replicated), LockError> {
        let wanted = self.config.min_replicas();
        if wanted == 0 {
            return Ok((self.run(call).await?, Replicated::Enough));
        }
        let wait = self.config.replica_wait();
        let timeout = self.config.client().operation_timeout();
        let (reply, acknowledged) = self.execute(call, Some((wanted, wait)), timeout).await?;
        let acknowledged = acknowledged.unwrap_or(0);
        let replicated = if acknowledged >= i64::from(wanted) {
            Replicated::Enough
        } else {
            Replicated::Only {
                acknowledged,
                wanted,
                wait,
            }
        };
        Ok((reply, replicated))
    }

    /// Runs an acquire script, waiting for replicas unless `settling`: a
    /// settling attempt's grant is given back at once, so its replication
    /// does not matter, and waiting for it would hold up the give-back.
    pub(crate) async fn run_acquire(
        &self,
        call: Call<'_>,
        settling: bool,
    ) -> Result<(Value, Replicated), LockError> {
        if settling {
            Ok((self.run(call).await?, Replicated::Enough))
        } else {
            self.run_replicated(call).await
        }
    }

    /// Runs an extend script of `held` for `ttl` (it answers 1 or 0), with
    /// replicas as [`run_replicated`](Self::run_replicated).
    pub(crate) async fn run_extend(
        &self,
        call: Call<'_>,
        held: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let (reply, replicated) = self.run_replicated(call).await?;
        let mut reply = replies::extend_reply(held.fencing, ttl, &reply)?;
        if let ExtendReply::Extended(grant) = &mut reply {
            // The lease keeps what its grant told (see `Labels`).
            grant.handle = held.handle;
            // The primary extended it, but a promoted replica might still
            // expire it at the old time: the lease keeps its old deadline.
            if let Some(shortfall) = replicated.shortfall("the lease keeps its previous expiry") {
                return Err(shortfall);
            }
        }
        Ok(reply)
    }

    /// Runs `call` within `timeout` (connecting, resending included),
    /// followed by `WAIT replicas timeout` if `wait` is given (then also
    /// returns its count).
    pub(crate) async fn execute(
        &self,
        call: Call<'_>,
        wait: Option<(u32, Duration)>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), LockError> {
        execute(&self.commands, call, wait, timeout).await
    }
}

/// A wait that ended: leaves its line on the server if it may be in it.
struct Leaving {
    commands: Arc<Commands>,
    waiters: Arc<Waiters>,
    publish: &'static str,
    timeout: Duration,
    line: Line,
    key: LockKey,
    keys: RedisKeys,
    waiter: OwnerToken,
    registration: u64,
}

impl Leaving {
    async fn leave(self) {
        let Leaving {
            commands,
            waiters,
            publish,
            timeout,
            line,
            key,
            keys,
            waiter,
            registration,
        } = self;
        if !waiters.closed(line, &key, waiter, registration) {
            return;
        }
        let left = leave_line(
            &commands,
            publish,
            timeout,
            line,
            &keys,
            waiters.member(waiter),
        );
        // Best effort: a waiter left behind is dropped by a later release
        // once its client is gone, or with the line when it expires; until
        // then a wake-up it takes falls back to the others' timers.
        match left.await {
            Ok(reply) => {
                if replies::deleted(&key, &reply).is_none() {
                    tracing::debug!(key = %key, ?reply, "unexpected reply to leaving the waiter line");
                }
            }
            Err(e) => {
                tracing::debug!(key = %key, error = %e, "leaving the waiter line failed; the line drops the waiter later");
            }
        }
    }
}

/// Takes `member` out of `line` at `keys` (its leave script): a lock's
/// line then serves its head if the lock is free, a semaphore's wakes the
/// next waiter if a permit is. The script's reply.
async fn leave_line(
    commands: &Commands,
    publish: &'static str,
    timeout: Duration,
    line: Line,
    keys: &RedisKeys,
    member: String,
) -> Result<Value, LockError> {
    let (script, redis_keys, args) = match line {
        Line::Lock => (
            &*LEAVE_SCRIPT,
            vec![keys.lock.as_str(), &keys.waiters, &keys.turn],
            vec![member, keys.channel.clone(), publish.to_owned(), turn_ms()],
        ),
        Line::Permits => (
            &*LEAVE_PERMIT_SCRIPT,
            vec![keys.lock.as_str(), &keys.waiters],
            vec![member, keys.channel.clone(), publish.to_owned()],
        ),
    };
    let call = Call {
        keys,
        script,
        redis_keys: &redis_keys,
        args: &args,
    };
    Ok(execute(commands, call, None, timeout).await?.0)
}

/// Whether a lock's acquisition may have stored a holder label: a lock
/// taken without one has none of its own, so its release and extend skip
/// the label key (one command less each). Carried in the grant's handle;
/// a lease from elsewhere (handle 0) is treated as possibly labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Labels {
    /// A label may be stored: read the label key as before.
    Maybe,
    /// Acquired without a label: none of this owner's is there.
    None,
}

impl Labels {
    /// The grant handle's bit for [`Labels::None`].
    const NONE_BIT: u64 = 1;

    fn of(holder: Option<&HolderId>) -> Self {
        if holder.is_some() {
            Labels::Maybe
        } else {
            Labels::None
        }
    }

    fn of_handle(handle: u64) -> Self {
        if handle & Self::NONE_BIT != 0 {
            Labels::None
        } else {
            Labels::Maybe
        }
    }

    fn handle(self) -> u64 {
        match self {
            Labels::Maybe => 0,
            Labels::None => Self::NONE_BIT,
        }
    }

    /// The scripts' argument: `1` when there is no label to look at.
    fn arg(self) -> &'static str {
        match self {
            Labels::Maybe => "",
            Labels::None => "1",
        }
    }
}

/// The turn a lock's woken waiter gets, as a script argument.
fn turn_ms() -> String {
    arg_millis(TURN)
}

/// Runs `call` on `commands` within `timeout`; see [`RedisLock::execute`].
async fn execute(
    commands: &Commands,
    call: Call<'_>,
    wait: Option<(u32, Duration)>,
    timeout: Duration,
) -> Result<(Value, Option<i64>), LockError> {
    {
        let Call {
            keys,
            script,
            redis_keys,
            args,
        } = call;
        let started = Instant::now();
        // Finding the Sentinel primary is part of the budget.
        let mut checkout = with_timeout(timeout, IN_LOCK_CALL, commands.checkout()).await?;
        let left = timeout.saturating_sub(started.elapsed());
        let request = async {
            match wait {
                None => script
                    .invoke(&mut checkout.conn, redis_keys, args)
                    .await
                    .map(|reply| (reply, None)),
                Some((replicas, wait)) => script
                    .invoke_and_wait(&mut checkout.conn, redis_keys, args, replicas, wait)
                    .await
                    .map(|(reply, acknowledged)| (reply, Some(acknowledged))),
            }
        };
        // Not `with_timeout`: this timeout, unlike a caller's cancellation,
        // says the connection may be dead.
        let Ok(result) = tokio::time::timeout(left, request).await else {
            checkout.timed_out();
            return Err(LockError::timeout(format!(
                "no reply within {timeout:?}; the server may be down or overloaded"
            )));
        };
        checkout.finish(&result);
        result.map_err(|e| errors::map_script(e, keys))
    }
}

impl RedisLock {
    /// Releases the lock at `keys` if it holds `value`, within `timeout`;
    /// `labels` says whether its acquisition may have stored a holder label.
    async fn release_value(
        &self,
        key: &LockKey,
        keys: &RedisKeys,
        value: String,
        labels: Labels,
        timeout: Duration,
    ) -> Result<ReleaseReply, LockError> {
        let args = [
            value,
            keys.channel.clone(),
            self.channels.publish.to_owned(),
            self.released_marker_ms(),
            // Identifies this release call: a resend of the same request
            // (by the driver) carries it, a second call does not.
            OwnerToken::random().to_hex(),
            turn_ms(),
            labels.arg().to_owned(),
        ];
        let call = Call {
            keys,
            script: &RELEASE_SCRIPT,
            redis_keys: &[
                &keys.lock,
                &keys.gone,
                &keys.waiters,
                &keys.holder,
                &keys.turn,
            ],
            args: &args,
        };
        let (reply, _) = self.execute(call, None, timeout).await?;
        replies::release_reply(key, &reply)
    }

    /// How long a release's released-by marker is kept (at most the lock's
    /// remaining TTL, the script decides): twice the operation timeout, so
    /// that a resend of the release (the cluster driver resends after a
    /// dropped connection, within the timeout) finds it.
    pub(crate) fn released_marker_ms(&self) -> String {
        arg_millis(self.config.client().operation_timeout().saturating_mul(2))
    }
}

/// One script invocation: the lock's Redis names, and the script's keys
/// and arguments.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) keys: &'a RedisKeys,
    pub(crate) script: &'a LuaScript,
    pub(crate) redis_keys: &'a [&'a str],
    pub(crate) args: &'a [String],
}

/// How many replicas acknowledged a write.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Replicated {
    /// As many as [`RedisConfig::min_replicas`] (or none was asked for).
    Enough,
    /// Fewer within the wait.
    Only {
        acknowledged: i64,
        wanted: u32,
        wait: Duration,
    },
}

impl Replicated {
    pub(crate) fn shortfall(self, outcome: &str) -> Option<LockError> {
        match self {
            Replicated::Enough => None,
            Replicated::Only {
                acknowledged,
                wanted,
                wait,
            } => Some(LockError::unavailable(format!(
                "only {acknowledged} of the {wanted} replicas required by min_replicas acknowledged it within {wait:?}, so a failover could lose it; {outcome}"
            ))),
        }
    }
}

/// The error for a grant fewer replicas acknowledged than asked
/// (`shortfall`), after giving it back with the result `given_back`.
pub(crate) fn not_replicated<T>(
    shortfall: LockError,
    given_back: Result<T, LockError>,
) -> LockError {
    match given_back {
        Ok(_) => shortfall,
        Err(e) => LockError::unavailable(format!(
            "{}; releasing it failed too ({e}), so it stays taken until its TTL runs out",
            shortfall
                .message()
                .trim_end_matches("; it was released again")
        )),
    }
}

/// A duration as a script argument: whole milliseconds, from 1 to the
/// scripts' bound (15 digits).
pub(crate) fn arg_millis(d: Duration) -> String {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1, scripts::MAX_ARG_MILLIS)
        .to_string()
}

#[async_trait]
impl LockBackend for RedisLock {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            min_ttl: Duration::from_millis(1),
            ttl_granularity: Duration::from_millis(1),
            native_wait: true,
            wakes_one_waiter: true,
            fair_handoff: true,
            durable: false,
            // A cluster's keys span slots: one script cannot reach them.
            extend_batch: match self.channels.publish == Channels::SHARDED.publish {
                true => 1,
                false => EXTEND_BATCH,
            },
            // Beside the lock, bound to its owner (see `scripts`).
            holder_ids: true,
            // Scripts publish a labelled holder's changes.
            holder_watch: true,
            // Beside the permits, bound to each permit (see `scripts`).
            permit_holder_ids: true,
            // A watch subscribes to the key's channel: a round trip (and
            // an unsubscribe after) that a free key does not need.
            attempt_before_watch: true,
            ..Capabilities::default()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        let key = request.key;
        let keys = self.keys(key);
        let owner = request.owner.to_hex();
        let mut args = vec![
            owner.clone(),
            arg_millis(request.ttl),
            self.retention_ms(request.ttl),
            self.line_member(Line::Lock, key, request.owner, request.settling),
        ];
        // A labelled holder is told to the key's observers; the channel
        // also wakes a waiter whose turn it is.
        args.extend([
            request
                .holder
                .map_or_else(String::new, |holder| holder.as_str().to_owned()),
            keys.channel.clone(),
            self.channels.publish.to_owned(),
            turn_ms(),
        ]);
        // The give-back below shares this operation's timeout.
        let sent = Instant::now();
        let call = Call {
            keys: &keys,
            script: &ACQUIRE_SCRIPT,
            redis_keys: &[
                &keys.lock,
                &keys.fence,
                &keys.waiters,
                &keys.holder,
                &keys.turn,
            ],
            args: &args,
        };
        let (reply, replicated) = self.run_acquire(call, request.settling).await?;
        let mut reply = replies::acquire_reply(key, &keys, request.ttl, &reply)?;
        let AcquireReply::Granted(grant) = &mut reply else {
            return Ok(reply);
        };
        grant.handle = Labels::of(request.holder).handle();
        self.line_granted(Line::Lock, key, request.owner, request.settling);
        let value = scripts::lock_value(&owner, grant.fencing.get());
        let Some(shortfall) = replicated.shortfall("it was released again") else {
            return Ok(reply);
        };
        // Not replicated enough to survive a failover: give it back rather
        // than hand out a lock a promoted replica would not know. (Its
        // outcome is known: the primary granted it.)
        let left = self.time_left(sent);
        let given_back = self
            .release_value(key, &keys, value, Labels::of(request.holder), left)
            .await;
        Err(not_replicated(shortfall, given_back))
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let keys = self.keys(lock.key);
        let args = [
            scripts::lock_value(&lock.owner.to_hex(), lock.fencing.get()),
            arg_millis(ttl),
            self.retention_ms(ttl),
            Labels::of_handle(lock.handle).arg().to_owned(),
        ];
        let call = Call {
            keys: &keys,
            script: &EXTEND_SCRIPT,
            redis_keys: &[&keys.lock, &keys.fence, &keys.holder],
            args: &args,
        };
        self.run_extend(call, lock, ttl).await
    }

    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        if locks.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<RedisKeys> = locks.iter().map(|lock| self.keys(lock.key)).collect();
        let redis_keys: Vec<&str> = keys
            .iter()
            .flat_map(|k| [k.lock.as_str(), k.fence.as_str(), k.holder.as_str()])
            .collect();
        let mut args = vec![arg_millis(ttl), self.retention_ms(ttl)];
        args.extend(
            locks
                .iter()
                .map(|lock| scripts::lock_value(&lock.owner.to_hex(), lock.fencing.get())),
        );
        let call = Call {
            keys: &keys[0],
            script: &EXTEND_MANY_SCRIPT,
            redis_keys: &redis_keys,
            args: &args,
        };
        let (reply, replicated) = self.run_replicated(call).await?;
        let held: Vec<_> = locks.iter().map(|l| l.fencing).zip(&keys).collect();
        let mut replies = replies::extend_many_reply(&held, ttl, &reply)?;
        for (reply, lock) in replies.iter_mut().zip(locks) {
            // As for one extend: a lock a promoted replica might still
            // expire at the old time keeps its old deadline.
            if let Ok(ExtendReply::Extended(grant)) = reply {
                grant.handle = lock.handle;
                if let Some(shortfall) = replicated.shortfall("the lease keeps its previous expiry")
                {
                    *reply = Err(shortfall);
                }
            }
        }
        Ok(replies)
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let keys = self.keys(lock.key);
        let value = scripts::lock_value(&lock.owner.to_hex(), lock.fencing.get());
        let timeout = self.config.client().operation_timeout();
        let labels = Labels::of_handle(lock.handle);
        self.release_value(lock.key, &keys, value, labels, timeout)
            .await
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let keys = self.keys(key);
        Ok(Some(self.watch_line(Line::Lock, key, keys, waiter).await?))
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        Some(self)
    }

    fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        Some(self)
    }
}

#[async_trait]
impl LockAdmin for RedisLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let keys = self.keys(key);
        let reply = self
            .run(Call {
                keys: &keys,
                script: &INSPECT_SCRIPT,
                redis_keys: &[&keys.lock, &keys.holder],
                args: &[],
            })
            .await?;
        replies::inspect_reply(&reply)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let keys = self.keys(key);
        let reply = self
            .run(Call {
                keys: &keys,
                script: &FORCE_RELEASE_SCRIPT,
                redis_keys: &[&keys.lock, &keys.waiters, &keys.holder, &keys.turn],
                args: &[
                    keys.channel.clone(),
                    self.channels.publish.to_owned(),
                    turn_ms(),
                ],
            })
            .await?;
        replies::force_release_reply(key, &reply)
    }

    /// A subscription to the key's observers channel, on the client's
    /// pub/sub connection: the acquire script publishes there when a
    /// labelled holder takes the lock, release and force release when they
    /// delete a labelled lock (expiry is not told: observers read at the
    /// holder's expiry). Unlabelled locks are not told, so an observer of
    /// one reads every poll interval. Never a waiter-line entry, and a
    /// waiter's single wake-up goes to its own client's channel, never
    /// here.
    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let channel = self.keys(key).observers_channel();
        let watch = with_timeout(
            connect_budget(self.config.client()),
            "subscribing to holder changes",
            self.listener.watch(channel),
        )
        .await?;
        Ok(Some(watch))
    }

    async fn inspect_permits(
        &self,
        key: &LockKey,
    ) -> Result<Vec<distlock_core::PermitState>, LockError> {
        self.list_permits(key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future `f` returns for borrowed arguments.
    fn future_size<'a, A: 'a, B, C, D, F, Fut>(_: F) -> usize
    where
        F: Fn(&'a A, B, C, D) -> Fut,
    {
        std::mem::size_of::<Fut>()
    }

    /// Every request's future is built, moved and boxed at each call: it
    /// must not carry the Sentinel primary lookup inline (that made it
    /// 11.9 KB in release builds, memcpy'd at every layer of every call).
    #[test]
    fn a_request_future_stays_small() {
        let size = future_size(RedisLock::execute);
        assert!(size < 4096, "RedisLock::execute's future is {size} bytes");
    }
}
