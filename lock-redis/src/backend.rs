//! [`RedisLock`]: the [`LockBackend`] and [`LockAdmin`] implementation.

use std::fmt;
use std::time::{Duration, Instant};

use lock_core::{
    async_trait, with_timeout, AcquireReply, AcquireRequest, Capabilities, ClientOptions,
    ErrorKind, ExtendReply, HeldLock, Listener, LockAdmin, LockBackend, LockError, LockKey,
    LockState, ReleaseReply, ReleaseWatch,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, Value};

use crate::config::RedisConfig;
use crate::errors;
use crate::keys::RedisKeys;
use crate::listener::PubSub;
use crate::scripts::{
    self, LuaScript, ACQUIRE_SCRIPT, EXTEND_SCRIPT, FORCE_RELEASE_SCRIPT, INSPECT_SCRIPT,
    PROBE_SCRIPT, RELEASE_SCRIPT,
};

/// A lock server on Redis.
///
/// One `RedisLock` is one client: a multiplexed, self-reconnecting command
/// connection ([`ConnectionManager`]) shared by every lock operation, plus
/// one pub/sub connection (opened on the first wait) shared by every waiter.
/// Job code uses it through [`LockClient`](lock_core::LockClient) or
/// [`Locker`](lock_core::Locker).
///
/// ```no_run
/// use std::time::Duration;
/// use lock_core::{LockClient, LockKey};
/// use lock_redis::RedisLock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let client = LockClient::new(RedisLock::connect("redis://127.0.0.1:6379/?namespace=jobs").await?);
/// let key = LockKey::new("nightly-report")?;
/// if let Some(lease) = client.try_acquire(&key, Duration::from_secs(30)).await?.lease() {
///     // ... run the job, passing lease.fencing_token() to what it writes ...
///     client.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
pub struct RedisLock {
    conn: ConnectionManager,
    config: RedisConfig,
    listener: Listener<PubSub>,
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
    /// Fails with [`ErrorKind::Config`] for a bad URL, wrong credentials or
    /// an ACL user missing a permission distlock needs (named),
    /// [`ErrorKind::Unavailable`] or [`ErrorKind::Timeout`] if the server
    /// cannot be reached within the connect timeout.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(RedisConfig::from_url(url)?).await
    }

    /// Connects with explicit settings.
    pub async fn with_config(config: RedisConfig) -> Result<Self, LockError> {
        config.validate()?;
        let Some(info) = config.connection_info().cloned() else {
            return Err(LockError::config(
                "RedisConfig names no server; build it with RedisConfig::from_url or RedisConfig::server, or use RedisLock::from_connection_manager",
            ));
        };
        let server = config.to_string();
        #[cfg(feature = "tls")]
        {
            // rustls needs a process-wide crypto provider; keep one the
            // application installed, else install ring.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let client = Client::open(info).map_err(|e| {
            LockError::config(format!("invalid redis settings for {server}: {e}")).with_source(e)
        })?;
        let options = &config.client;
        let what = format!("connecting to redis at {server}");

        // One direct connection first: wrong credentials or an unreachable
        // server are reported at once with a precise error (the manager
        // would retry them), and the scripts are loaded.
        let mut probe = first_connection(&client, options, &what).await?;
        preload(&mut probe, options).await?;
        check_permissions(&mut probe, options, &what).await?;
        drop(probe);

        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.operation_timeout))
            .set_number_of_retries(5)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), manager_config)
            .map_err(|e| errors::map(e, &what))?;
        tracing::debug!(server = %server, namespace = %options.namespace, "redis lock client ready");
        Ok(Self::new(conn, client, config))
    }

    /// Uses a connection the application already has (its [`ConnectionManager`]
    /// is cloned, not reconnected), and `pubsub` to open the one pub/sub
    /// connection waiters share (a `ConnectionManager` cannot carry pub/sub
    /// messages on RESP2). The server in `config`, if any, is ignored; its
    /// namespace, timeouts and retention apply. Permissions are not checked
    /// up front: a missing one shows at first use
    /// ([`ErrorKind::Config`], with the server's reason).
    ///
    /// ```no_run
    /// use lock_redis::{RedisConfig, RedisLock};
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
        Ok(Self::new(manager, pubsub, config))
    }

    fn new(conn: ConnectionManager, pubsub: Client, config: RedisConfig) -> Self {
        Self {
            conn,
            listener: Listener::new(PubSub::new(pubsub), &config.client),
            config,
        }
    }

    /// The settings of this client.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// A clone of the command connection, for the application's own use.
    pub fn connection_manager(&self) -> ConnectionManager {
        self.conn.clone()
    }

    fn keys(&self, key: &LockKey) -> RedisKeys {
        RedisKeys::new(&self.config.client.namespace, key)
    }

    /// How long the fencing counter is kept after an acquisition for `ttl`.
    fn retention_ms(&self, ttl: Duration) -> u64 {
        millis(self.config.fence_retention.max(ttl.saturating_mul(2)))
    }

    /// Runs one script invocation under the operation timeout.
    async fn run(
        &self,
        what: &str,
        key: &LockKey,
        keys: &RedisKeys,
        script: &LuaScript,
        redis_keys: &[&str],
        args: &[String],
    ) -> Result<Value, LockError> {
        let mut conn = self.conn.clone();
        self.config
            .client
            .timed(what, async {
                script
                    .invoke(&mut conn, redis_keys, args)
                    .await
                    .map_err(|e| errors::map_script(e, what, key, keys))
            })
            .await
    }
}

/// Pause between attempts of the first connection.
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The first connection. A refused or reset connection is retried until the
/// connect timeout (a server that is just starting or restarting); a wrong
/// password or bad settings are reported at once.
async fn first_connection(
    client: &Client,
    options: &ClientOptions,
    what: &str,
) -> Result<MultiplexedConnection, LockError> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(options.connect_timeout))
        .set_response_timeout(Some(options.operation_timeout));
    let give_up = Instant::now() + options.connect_timeout;
    loop {
        let attempt = with_timeout(
            options.connect_timeout + options.operation_timeout,
            what,
            async {
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map_err(|e| errors::map(e, what))
            },
        )
        .await;
        match attempt {
            Err(e) if e.kind() == ErrorKind::Unavailable && Instant::now() < give_up => {
                tracing::debug!(error = %e, "redis not reachable yet; retrying");
                tokio::time::sleep(CONNECT_RETRY_PAUSE).await;
            }
            other => return other,
        }
    }
}

/// Loads the scripts so the first acquire is one EVALSHA; this also proves
/// the credentials work.
async fn preload(
    conn: &mut MultiplexedConnection,
    options: &ClientOptions,
) -> Result<(), LockError> {
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
    conn: &mut MultiplexedConnection,
    options: &ClientOptions,
    what: &str,
) -> Result<(), LockError> {
    let namespace = &options.namespace;
    let probe = RedisKeys::probe(namespace);
    let denied = options
        .timed(what, async {
            match PROBE_SCRIPT
                .invoke(
                    conn,
                    &[&probe.lock, &probe.fence],
                    std::slice::from_ref(&probe.channel),
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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
        let args = [
            request.owner.to_hex(),
            millis(request.ttl).to_string(),
            self.retention_ms(request.ttl).to_string(),
        ];
        let reply = self
            .run(
                "redis acquire",
                key,
                &keys,
                &ACQUIRE_SCRIPT,
                &[&keys.lock, &keys.fence],
                &args,
            )
            .await?;
        scripts::acquire_reply(key, request.ttl, &reply)
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let keys = self.keys(lock.key);
        let args = [
            scripts::lock_value(&lock.owner.to_hex(), lock.fencing.get()),
            millis(ttl).to_string(),
            self.retention_ms(ttl).to_string(),
        ];
        let reply = self
            .run(
                "redis extend",
                lock.key,
                &keys,
                &EXTEND_SCRIPT,
                &[&keys.lock, &keys.fence],
                &args,
            )
            .await?;
        scripts::extend_reply(lock.key, lock.fencing, ttl, &reply)
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let keys = self.keys(lock.key);
        let args = [
            scripts::lock_value(&lock.owner.to_hex(), lock.fencing.get()),
            keys.channel.clone(),
        ];
        let reply = self
            .run(
                "redis release",
                lock.key,
                &keys,
                &RELEASE_SCRIPT,
                &[&keys.lock],
                &args,
            )
            .await?;
        scripts::release_reply(lock.key, &reply)
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let channel = self.keys(key).channel;
        Ok(Some(self.listener.watch(channel).await?))
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        Some(self)
    }
}

#[async_trait]
impl LockAdmin for RedisLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let keys = self.keys(key);
        let reply = self
            .run(
                "redis inspect",
                key,
                &keys,
                &INSPECT_SCRIPT,
                &[&keys.lock],
                &[],
            )
            .await?;
        scripts::inspect_reply(key, &reply)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let keys = self.keys(key);
        let reply = self
            .run(
                "redis force release",
                key,
                &keys,
                &FORCE_RELEASE_SCRIPT,
                &[&keys.lock],
                std::slice::from_ref(&keys.channel),
            )
            .await?;
        scripts::force_release_reply(key, &reply)
    }
}
