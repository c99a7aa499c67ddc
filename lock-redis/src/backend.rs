//! [`RedisLock`]: the [`LockBackend`] and [`LockAdmin`] implementation.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    async_trait, with_timeout, AcquireReply, AcquireRequest, Capabilities, ClientOptions,
    ErrorKind, ExtendReply, HeldLock, Listener, LockAdmin, LockBackend, LockError, LockKey,
    LockState, OwnerToken, ReleaseReply, ReleaseWatch, SemaphoreBackend,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Client, Value};

use crate::config::{RedisConfig, Server};
use crate::connection::{
    cluster_client, connect_budget, pending_cluster, Commands, Conn, Replaceable,
};
use crate::errors;
use crate::eviction;
use crate::keys::RedisKeys;
use crate::listener::{ClusterPubSub, PubSub};
use crate::scripts::{
    self, LuaScript, ACQUIRE_SCRIPT, EXTEND_SCRIPT, FORCE_RELEASE_SCRIPT, INSPECT_SCRIPT,
    PROBE_SCRIPT, RELEASE_SCRIPT,
};
use crate::sentinel::SentinelPrimary;
use crate::tls;

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
    commands: Commands,
    config: RedisConfig,
    channels: Channels,
    listener: Listener<PubSub>,
}

/// The pub/sub commands: sharded (`SPUBLISH`, `SSUBSCRIBE`) in a cluster,
/// so a release reaches only the nodes of its slot.
#[derive(Debug, Clone, Copy)]
struct Channels {
    publish: &'static str,
    subscribe: &'static str,
    unsubscribe: &'static str,
}

impl Channels {
    const CLASSIC: Channels = Channels {
        publish: "PUBLISH",
        subscribe: "SUBSCRIBE",
        unsubscribe: "UNSUBSCRIBE",
    };
    const SHARDED: Channels = Channels {
        publish: "SPUBLISH",
        subscribe: "SSUBSCRIBE",
        unsubscribe: "SUNSUBSCRIBE",
    };
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("server", &self.config.to_string())
            .field("namespace", &self.config.client.namespace)
            .finish_non_exhaustive()
    }
}

impl RedisLock {
    /// Connects to the server at `url` (see [`RedisConfig`] for the URL
    /// forms and parameters).
    ///
    /// Fails with [`ErrorKind::Config`] for a bad URL, wrong credentials, an
    /// ACL user missing a permission distlock needs (named), a TLS file
    /// that cannot be read or a certificate that is refused (which one and
    /// why), [`ErrorKind::Unavailable`] or [`ErrorKind::Timeout`] if the
    /// server cannot be reached within the connect timeout.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(RedisConfig::from_url(url)?).await
    }

    /// Connects with explicit settings.
    pub async fn with_config(config: RedisConfig) -> Result<Self, LockError> {
        config.validate()?;
        let Some(server) = config.server_settings().cloned() else {
            return Err(LockError::config(
                "RedisConfig names no server; build it with RedisConfig::from_url or RedisConfig::server, or use RedisLock::from_connection_manager",
            ));
        };
        #[cfg(feature = "tls")]
        {
            // rustls needs a process-wide crypto provider; keep one the
            // application installed, else install ring.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let options = &config.client;
        let what = format!("connecting to redis at {config}");
        let tls = tls::is_tls(&server);
        let certificates = tls::certificates(&options.tls, tls).await?;
        let connected = Self::open(server, &config, certificates, &what)
            .await
            .map_err(|e| tls::connect_hint(e, tls))?;
        let (commands, pubsub, channels) = connected;
        tracing::debug!(server = %config, namespace = %options.namespace, "redis lock client ready");
        Ok(Self::new(commands, pubsub, channels, config))
    }

    /// The command connection, the pub/sub source and the channel commands
    /// for `server`.
    async fn open(
        server: Server,
        config: &RedisConfig,
        certificates: tls::Certificates,
        what: &str,
    ) -> Result<(Commands, PubSub, Channels), LockError> {
        let options = &config.client;
        Ok(match server {
            Server::Single(info) => {
                let info = tls::with_certificates(info, &certificates)?;
                let client = Client::open(info).map_err(|e| {
                    LockError::config(format!("invalid redis settings for {config}: {e}"))
                        .with_source(e)
                })?;
                // One direct connection first: wrong credentials or an
                // unreachable server are reported at once with a precise
                // error (the manager would retry them), and the scripts are
                // loaded.
                let connection_config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(options.connect_timeout))
                    .set_response_timeout(Some(options.operation_timeout));
                let mut probe = retry_connect(options, what, || async {
                    client
                        .get_multiplexed_async_connection_with_config(&connection_config)
                        .await
                        .map(Conn::Node)
                        .map_err(|e| errors::map(e, what))
                })
                .await?;
                prepare(&mut probe, config, Channels::CLASSIC, what).await?;
                drop(probe);
                // Connected now, not at the first request: a TLS handshake
                // (the driver loads the platform's roots each time) would
                // otherwise eat into the first lease.
                let conn = with_timeout(connect_budget(options), what, async {
                    ConnectionManager::new_with_config(client.clone(), manager_config(options))
                        .await
                        .map_err(|e| errors::map(e, what))
                })
                .await?;
                (
                    Commands::Single(replaceable_manager(conn, &client, options)),
                    PubSub::Node(client),
                    Channels::CLASSIC,
                )
            }
            Server::Sentinel(sentinel) => {
                let primary = Arc::new(SentinelPrimary::new(
                    sentinel,
                    certificates,
                    options.clone(),
                )?);
                let mut conn = retry_connect(options, what, || async {
                    primary.connection().await.map(|(conn, _)| Conn::Node(conn))
                })
                .await?;
                prepare(&mut conn, config, Channels::CLASSIC, what).await?;
                (
                    Commands::Sentinel(primary.clone()),
                    PubSub::Sentinel(primary),
                    Channels::CLASSIC,
                )
            }
            Server::Cluster(cluster) => {
                let client = cluster_client(&cluster, &certificates, options, None)
                    .map_err(|e| errors::map(e, what))?;
                let conn = retry_connect(options, what, || async {
                    client
                        .get_async_connection()
                        .await
                        .map_err(|e| errors::map(e, what))
                })
                .await?;
                prepare(
                    &mut Conn::Cluster(conn.clone()),
                    config,
                    Channels::SHARDED,
                    what,
                )
                .await?;
                let pubsub = PubSub::Cluster(ClusterPubSub {
                    server: cluster,
                    certificates,
                    options: options.clone(),
                });
                let renew_options = options.clone();
                let commands = Replaceable::new(conn, "redis cluster", move || {
                    Ok(pending_cluster(&client, &renew_options))
                });
                (Commands::Cluster(commands), pubsub, Channels::SHARDED)
            }
        })
    }

    /// Uses a connection the application already has (its [`ConnectionManager`]
    /// is cloned, not reconnected), and `pubsub` to open the one pub/sub
    /// connection waiters share (a `ConnectionManager` cannot carry pub/sub
    /// messages on RESP2). The server in `config`, if any, is ignored; its
    /// namespace, timeouts, retention and `min_replicas` apply. Permissions
    /// and the `maxmemory-policy` are not checked up front: a missing
    /// permission shows at first use ([`ErrorKind::Config`], with the
    /// server's reason).
    ///
    /// If a request on the application's manager fails or times out, this
    /// client goes on with a `ConnectionManager` of its own to `pubsub`'s
    /// server (the driver's manager reconnects only once a connection
    /// closes, not after a timeout on one that stays open).
    ///
    /// ```no_run
    /// use distlock_redis::{RedisConfig, RedisLock};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let manager = redis::aio::ConnectionManager::new(client.clone()).await?;
    /// let mut config = RedisConfig::default();
    /// config.client.namespace = "jobs".into();
    /// let lock = RedisLock::from_connection_manager(manager, client, config)?;
    /// # let _ = lock; Ok(()) }
    /// ```
    pub fn from_connection_manager(
        manager: ConnectionManager,
        pubsub: Client,
        config: RedisConfig,
    ) -> Result<Self, LockError> {
        config.validate()?;
        let commands = replaceable_manager(manager, &pubsub, &config.client);
        Ok(Self::new(
            Commands::Single(commands),
            PubSub::Node(pubsub),
            Channels::CLASSIC,
            config,
        ))
    }

    fn new(commands: Commands, pubsub: PubSub, channels: Channels, config: RedisConfig) -> Self {
        Self {
            commands,
            listener: Listener::new(pubsub, &config.client),
            channels,
            config,
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
        match &self.commands {
            Commands::Single(manager) => Some(manager.current().0),
            _ => None,
        }
    }

    fn keys(&self, key: &LockKey) -> RedisKeys {
        RedisKeys::new(&self.config.client.namespace, key)
    }

    /// The names of `key`'s semaphore.
    pub(crate) fn semaphore_keys(&self, key: &LockKey) -> RedisKeys {
        RedisKeys::semaphore(&self.config.client.namespace, key)
    }

    /// The command a release script publishes with.
    pub(crate) fn publish_command(&self) -> &'static str {
        self.channels.publish
    }

    /// How long the fencing counter is kept after an acquisition for `ttl`.
    pub(crate) fn retention_ms(&self, ttl: Duration) -> String {
        arg_millis(self.config.fence_retention.max(ttl.saturating_mul(2)))
    }

    /// What is left of the operation timeout of a call first sent at `sent`.
    pub(crate) fn time_left(&self, sent: Instant) -> Duration {
        self.config
            .client
            .operation_timeout
            .saturating_sub(sent.elapsed())
    }

    /// Subscribes to `channel`'s notifications (a wait's watch).
    pub(crate) async fn watch_channel(&self, channel: String) -> Result<ReleaseWatch, LockError> {
        // Connecting (the first waiter) and subscribing, however long other
        // waiters' subscriptions hold the connection: one bound in all.
        with_timeout(
            connect_budget(&self.config.client),
            "redis subscribe for release notifications",
            self.listener.watch(channel),
        )
        .await
    }

    /// Runs one script invocation under the operation timeout.
    pub(crate) async fn run(&self, call: Call<'_>) -> Result<Value, LockError> {
        let timeout = self.config.client.operation_timeout;
        Ok(self.execute(call, None, timeout).await?.0)
    }

    /// Runs a writing script, then, with [`min_replicas`](RedisConfig::min_replicas)
    /// set, waits for that many replicas to acknowledge it (`WAIT`, on the
    /// same connection): the reply and whether they did.
    pub(crate) async fn run_replicated(
        &self,
        call: Call<'_>,
    ) -> Result<(Value, Replicated), LockError> {
        let wanted = self.config.min_replicas;
        if wanted == 0 {
            return Ok((self.run(call).await?, Replicated::Enough));
        }
        let wait = self.config.replica_wait();
        let timeout = self.config.client.operation_timeout;
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
        let reply = scripts::extend_reply(held.key, held.fencing, ttl, &reply)?;
        if let ExtendReply::Extended(_) = reply {
            // The primary extended it, but a promoted replica might still
            // expire it at the old time: the lease keeps its old deadline.
            if let Some(shortfall) =
                replicated.shortfall(call.what, held.key, "the lease keeps its previous expiry")
            {
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
        let Call {
            what,
            key,
            keys,
            script,
            redis_keys,
            args,
        } = call;
        let started = Instant::now();
        // Finding the Sentinel primary is part of the budget.
        let mut checkout = with_timeout(timeout, what, self.commands.checkout()).await?;
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
                "{what} got no reply within {timeout:?}; the server may be down or overloaded"
            )));
        };
        checkout.finish(&result);
        result.map_err(|e| errors::map_script(e, what, key, keys))
    }
}

impl RedisLock {
    /// Releases the lock at `keys` if it holds `value`, within `timeout`.
    async fn release_value(
        &self,
        key: &LockKey,
        keys: &RedisKeys,
        value: String,
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
        ];
        let call = Call {
            what: "redis release",
            key,
            keys,
            script: &RELEASE_SCRIPT,
            redis_keys: &[&keys.lock, &keys.gone],
            args: &args,
        };
        let (reply, _) = self.execute(call, None, timeout).await?;
        scripts::release_reply(key, &reply)
    }

    /// How long a release's released-by marker is kept (at most the lock's
    /// remaining TTL, the script decides): twice the operation timeout, so
    /// that a resend of the release (the cluster driver resends after a
    /// dropped connection, within the timeout) finds it.
    pub(crate) fn released_marker_ms(&self) -> String {
        arg_millis(self.config.client.operation_timeout.saturating_mul(2))
    }
}

/// One script invocation: what it is for (for errors), the lock, its Redis
/// names, and the script's keys and arguments.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) what: &'a str,
    pub(crate) key: &'a LockKey,
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
    pub(crate) fn shortfall(self, what: &str, key: &LockKey, outcome: &str) -> Option<LockError> {
        match self {
            Replicated::Enough => None,
            Replicated::Only {
                acknowledged,
                wanted,
                wait,
            } => Some(LockError::unavailable(format!(
                "{what} on lock {key:?}: only {acknowledged} of the {wanted} replicas required by min_replicas acknowledged it within {wait:?}, so a failover could lose it; {outcome}"
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

/// The driver's manager settings for one server under `options`.
fn manager_config(options: &ClientOptions) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(options.connect_timeout))
        .set_response_timeout(Some(options.operation_timeout))
        .set_number_of_retries(5)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1))
}

/// `first`, replaced after a failure or timeout by a new manager of
/// `client` (which connects at its first request).
fn replaceable_manager(
    first: ConnectionManager,
    client: &Client,
    options: &ClientOptions,
) -> Replaceable<ConnectionManager> {
    let (client, options) = (client.clone(), options.clone());
    Replaceable::new(first, "redis command", move || {
        ConnectionManager::new_lazy_with_config(client.clone(), manager_config(&options))
    })
}

/// Pause between attempts of the first connection.
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The first connection, made by `attempt`. A refused or reset connection
/// (`Unavailable`) is retried until the connect timeout (a server that is
/// just starting or restarting, a failover under way); a wrong password,
/// a refused certificate or bad settings are reported at once.
async fn retry_connect<T, F, Fut>(
    options: &ClientOptions,
    what: &str,
    mut attempt: F,
) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, LockError>>,
{
    // None: a timeout too long to date (it never runs out).
    let give_up = Instant::now().checked_add(options.connect_timeout);
    loop {
        let result = with_timeout(connect_budget(options), what, attempt()).await;
        match result {
            Err(e)
                if e.kind() == ErrorKind::Unavailable
                    && give_up.is_none_or(|at| Instant::now() < at) =>
            {
                tracing::debug!(error = %e, "redis not reachable yet; retrying");
                tokio::time::sleep(CONNECT_RETRY_PAUSE).await;
            }
            other => return other,
        }
    }
}

/// Loads the scripts, checks the ACL user's permissions and the server's
/// eviction policy, on the first connection.
async fn prepare(
    conn: &mut Conn,
    config: &RedisConfig,
    channels: Channels,
    what: &str,
) -> Result<(), LockError> {
    let options = &config.client;
    preload(conn, options).await?;
    check_permissions(conn, options, channels, what).await?;
    eviction::check(conn, config, what).await
}

/// Loads the scripts so the first acquire is one EVALSHA; this also proves
/// the credentials work.
async fn preload(conn: &mut impl ConnectionLike, options: &ClientOptions) -> Result<(), LockError> {
    for script in scripts::all() {
        let loaded = options
            .timed("redis SCRIPT LOAD", async {
                match script.load(conn).await {
                    Ok(()) => Ok(true),
                    // An ACL user without SCRIPT LOAD still works: scripts
                    // the server lacks are sent with EVAL.
                    Err(e) if errors::is_noperm(&e) => {
                        tracing::debug!(error = %e, "cannot preload scripts; they will be sent with EVAL");
                        Ok(false)
                    }
                    Err(e) => Err(errors::map(e, "redis SCRIPT LOAD")),
                }
            })
            .await?;
        if !loaded {
            break;
        }
    }
    Ok(())
}

/// Refuses an ACL user that cannot do what distlock needs in its namespace,
/// naming what is missing. Servers before 7.0 cannot be asked (no
/// `redis.acl_check_cmd`); there a missing permission shows at first use.
async fn check_permissions(
    conn: &mut impl ConnectionLike,
    options: &ClientOptions,
    channels: Channels,
    what: &str,
) -> Result<(), LockError> {
    let namespace = &options.namespace;
    let probe = RedisKeys::probe(namespace);
    let permits = RedisKeys::semaphore_probe(namespace);
    let denied = options
        .timed(what, async {
            match PROBE_SCRIPT
                .invoke(
                    conn,
                    &[
                        &probe.lock,
                        &probe.fence,
                        &probe.gone,
                        &permits.lock,
                        &permits.fence,
                        &permits.gone,
                    ],
                    &[
                        probe.channel.clone(),
                        channels.publish.to_owned(),
                        channels.subscribe.to_owned(),
                        channels.unsubscribe.to_owned(),
                        permits.channel.clone(),
                    ],
                )
                .await
            {
                Ok(reply) => redis::from_redis_value::<Vec<String>>(reply).map_err(|e| {
                    LockError::corrupted(format!("{what}: unexpected reply to the ACL probe: {e}"))
                }),
                Err(e) if errors::is_noperm(&e) => Err(errors::acl_refused(
                    what,
                    namespace,
                    e.detail().unwrap_or(""),
                )),
                Err(e) => Err(errors::map(e, what)),
            }
        })
        .await?;
    if denied.is_empty() {
        return Ok(());
    }
    let pairs: Vec<(&str, &str)> = denied
        .chunks(2)
        .map(|p| (p[0].as_str(), p.get(1).map_or("", String::as_str)))
        .collect();
    Err(errors::acl_denied(what, namespace, &pairs))
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
            durable: false,
            ..Capabilities::default()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        let key = request.key;
        let keys = self.keys(key);
        let owner = request.owner.to_hex();
        let args = [
            owner.clone(),
            arg_millis(request.ttl),
            self.retention_ms(request.ttl),
        ];
        // The give-back below shares this operation's timeout.
        let sent = Instant::now();
        let call = Call {
            what: "redis acquire",
            key,
            keys: &keys,
            script: &ACQUIRE_SCRIPT,
            redis_keys: &[&keys.lock, &keys.fence],
            args: &args,
        };
        let (reply, replicated) = self.run_acquire(call, request.settling).await?;
        let reply = scripts::acquire_reply(key, request.ttl, &reply)?;
        let AcquireReply::Granted(grant) = &reply else {
            return Ok(reply);
        };
        let value = scripts::lock_value(&owner, grant.fencing.get());
        let Some(shortfall) = replicated.shortfall("redis acquire", key, "it was released again")
        else {
            return Ok(reply);
        };
        // Not replicated enough to survive a failover: give it back rather
        // than hand out a lock a promoted replica would not know. (Its
        // outcome is known: the primary granted it.)
        let left = self.time_left(sent);
        let given_back = self.release_value(key, &keys, value, left).await;
        Err(not_replicated(shortfall, given_back))
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let keys = self.keys(lock.key);
        let args = [
            scripts::lock_value(&lock.owner.to_hex(), lock.fencing.get()),
            arg_millis(ttl),
            self.retention_ms(ttl),
        ];
        let call = Call {
            what: "redis extend",
            key: lock.key,
            keys: &keys,
            script: &EXTEND_SCRIPT,
            redis_keys: &[&keys.lock, &keys.fence],
            args: &args,
        };
        self.run_extend(call, lock, ttl).await
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let keys = self.keys(lock.key);
        let value = scripts::lock_value(&lock.owner.to_hex(), lock.fencing.get());
        let timeout = self.config.client.operation_timeout;
        self.release_value(lock.key, &keys, value, timeout).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        Ok(Some(self.watch_channel(self.keys(key).channel).await?))
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
                what: "redis inspect",
                key,
                keys: &keys,
                script: &INSPECT_SCRIPT,
                redis_keys: &[&keys.lock],
                args: &[],
            })
            .await?;
        scripts::inspect_reply(key, &reply)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let keys = self.keys(key);
        let reply = self
            .run(Call {
                what: "redis force release",
                key,
                keys: &keys,
                script: &FORCE_RELEASE_SCRIPT,
                redis_keys: &[&keys.lock],
                args: &[keys.channel.clone(), self.channels.publish.to_owned()],
            })
            .await?;
        scripts::force_release_reply(key, &reply)
    }
}
