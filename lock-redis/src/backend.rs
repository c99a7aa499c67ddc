//! `RedisLock`: the [`DistributedLock`] implementation.

use std::fmt;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lock_core::{
    with_timeout, AcquireAttempt, Capabilities, DistributedLock, ErrorKind, FencingToken, Lease,
    LeaseIssuer, LockError, LockKey, LockState, OwnerToken, ReleaseWatch,
};
use redis::aio::MultiplexedConnection;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Client, Value};

use crate::config::{redact, RedisConfig};
use crate::errors;
use crate::keys::RedisKeys;
use crate::scripts::{
    self, LuaScript, ACQUIRE_SCRIPT, EXTEND_SCRIPT, FORCE_RELEASE_SCRIPT, INSPECT_SCRIPT,
    PROBE_SCRIPT, RELEASE_SCRIPT,
};
use crate::waiters::Waiters;

/// A distributed lock on a Redis server.
///
/// One `RedisLock` is one client: a multiplexed, self-reconnecting command
/// connection ([`ConnectionManager`]) shared by every lock operation, plus
/// one pub/sub connection (opened on the first wait) shared by every waiter.
/// Clone-free: share it as `Arc<RedisLock>` or `Arc<dyn DistributedLock>`.
///
/// ```no_run
/// use std::time::Duration;
/// use lock_core::{DistributedLock, LockKey};
/// use lock_redis::RedisLock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let lock = RedisLock::connect("redis://127.0.0.1:6379/?namespace=jobs").await?;
/// let key = LockKey::new("nightly-report")?;
/// if let Some(lease) = lock.try_acquire(&key, Duration::from_secs(30)).await?.lease() {
///     // ... run the job, passing lease.fencing_token() to what it writes ...
///     lock.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
pub struct RedisLock {
    conn: ConnectionManager,
    config: RedisConfig,
    issuer: LeaseIssuer,
    waiters: Waiters,
    server: String,
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("server", &self.server)
            .field("namespace", &self.config.options().namespace)
            .finish_non_exhaustive()
    }
}

impl RedisLock {
    /// Connects to the server at `url` (see [`RedisConfig::from_url`] for
    /// the URL forms and distlock's query parameters).
    ///
    /// Fails with [`ErrorKind::Config`](lock_core::ErrorKind) for a bad URL
    /// or wrong credentials, [`ErrorKind::Unavailable`](lock_core::ErrorKind)
    /// or [`ErrorKind::Timeout`](lock_core::ErrorKind) if the server cannot
    /// be reached within the connect timeout.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(RedisConfig::from_url(url)?).await
    }

    /// Connects with explicit settings.
    pub async fn with_config(config: RedisConfig) -> Result<Self, LockError> {
        config.validate()?;
        let Some(url) = config.driver_url() else {
            return Err(LockError::config(
                "RedisConfig has no URL; build it with RedisConfig::from_url, or use RedisLock::from_connection_manager",
            ));
        };
        let server = redact(url);
        #[cfg(feature = "tls")]
        {
            // rustls needs a process-wide crypto provider; keep one the
            // application installed, else install ring.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let client = Client::open(url).map_err(|e| {
            LockError::config(format!("invalid redis URL {server}: {e}")).with_source(e)
        })?;
        let options = config.options().clone();

        // One direct connection first: wrong credentials or an unreachable
        // server are reported at once with a precise error (the manager
        // would retry them), and the scripts are loaded.
        let probe_config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.operation_timeout));
        let what = format!("connecting to redis at {server}");
        // A refused or reset connection is retried until the connect timeout
        // (a server that is just starting or restarting); a wrong password
        // or bad URL is reported at once.
        let give_up = Instant::now() + options.connect_timeout;
        let mut probe = loop {
            let attempt = with_timeout(
                options.connect_timeout + options.operation_timeout,
                &what,
                async {
                    client
                        .get_multiplexed_async_connection_with_config(&probe_config)
                        .await
                        .map_err(|e| errors::map(e, &what))
                },
            )
            .await;
            match attempt {
                Err(e) if e.kind() == ErrorKind::Unavailable && Instant::now() < give_up => {
                    tracing::debug!(server = %server, error = %e, "redis not reachable yet; retrying");
                    tokio::time::sleep(CONNECT_RETRY_PAUSE).await;
                }
                other => break other?,
            }
        };
        preload(&mut probe, &options).await?;
        check_permissions(&mut probe, &options, &what).await?;
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
        Ok(Self {
            conn,
            waiters: Waiters::new(client, options),
            issuer: LeaseIssuer::random(),
            config,
            server,
        })
    }

    /// Uses a connection the application already has (its [`ConnectionManager`]
    /// is cloned, not reconnected), and `pubsub` to open the one pub/sub
    /// connection waiters share (a `ConnectionManager` cannot carry pub/sub
    /// messages on RESP2). The URL in `config`, if any, is ignored; its
    /// namespace, timeouts and retention apply.
    ///
    /// ```no_run
    /// use lock_redis::{RedisConfig, RedisLock};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let manager = redis::aio::ConnectionManager::new(client.clone()).await?;
    /// let lock = RedisLock::from_connection_manager(manager, client, RedisConfig::new().namespace("jobs"))?;
    /// # let _ = lock; Ok(()) }
    /// ```
    pub fn from_connection_manager(
        manager: ConnectionManager,
        pubsub: Client,
        config: RedisConfig,
    ) -> Result<Self, LockError> {
        config.validate()?;
        let options = config.options().clone();
        Ok(Self {
            conn: manager,
            waiters: Waiters::new(pubsub, options),
            issuer: LeaseIssuer::random(),
            config,
            server: "(application connection)".to_owned(),
        })
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
        RedisKeys::new(&self.config.options().namespace, key)
    }

    /// How long the fencing counter is kept after an acquisition for `ttl`.
    fn retention_ms(&self, ttl: Duration) -> u64 {
        millis(
            self.config
                .fence_retention_value()
                .max(ttl.saturating_mul(2)),
        )
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
            .options()
            .timed(what, async {
                script
                    .invoke(&mut conn, redis_keys, args)
                    .await
                    .map_err(|e| errors::map_script(e, what, key, keys))
            })
            .await
    }
}

/// Loads the scripts so the first acquire is one EVALSHA; this also proves
/// the credentials work.
async fn preload(
    conn: &mut MultiplexedConnection,
    options: &lock_core::ClientOptions,
) -> Result<(), LockError> {
    for script in scripts::all() {
        let result = options
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
        if !result {
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
    options: &lock_core::ClientOptions,
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

/// Pause between attempts of the first connection.
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(50);

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn unexpected(what: &str, key: &LockKey, reply: &Value) -> LockError {
    LockError::corrupted(format!(
        "{what} on lock {key:?}: unexpected reply from the redis server: {reply:?}"
    ))
}

/// Reads a release or force-release reply: whether a lock was deleted.
/// Logs a deletion whose notification the server refused (`{1, error}`):
/// the lock is free, but waiters of other clients are not woken and find
/// out at the holder's expiry, when their timers fire.
fn deleted(key: &LockKey, reply: &Value) -> Option<bool> {
    match reply {
        Value::Array(items) => match items.as_slice() {
            [flag, error] if as_int(flag) == Some(1) => {
                let error = redis::from_redis_value_ref::<String>(error).unwrap_or_default();
                tracing::warn!(
                    key = %key,
                    error = %error,
                    "redis lock released, but the server refused the release notification \
                     (ACL channel permission?); other clients' waiters wake at the holder's expiry"
                );
                Some(true)
            }
            _ => None,
        },
        other => match as_int(other) {
            Some(1) => Some(true),
            Some(0) => Some(false),
            _ => None,
        },
    }
}

fn as_int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

#[async_trait]
impl DistributedLock for RedisLock {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            min_ttl: Duration::from_millis(1),
            ttl_granularity: Duration::from_millis(1),
            native_wait: true,
            durable: false,
            admin: true,
            ..Capabilities::default()
        }
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError> {
        let ttl = self.capabilities().effective_ttl(ttl)?;
        let keys = self.keys(key);
        let owner = OwnerToken::random();
        let args = [
            owner.to_hex(),
            millis(ttl).to_string(),
            self.retention_ms(ttl).to_string(),
        ];
        let sent_at = Instant::now();
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
        let Value::Array(items) = &reply else {
            return Err(unexpected("acquire", key, &reply));
        };
        match (items.first().and_then(as_int), items.get(1)) {
            (Some(1), Some(token)) => {
                let token = as_int(token)
                    .and_then(|t| u64::try_from(t).ok())
                    .ok_or_else(|| unexpected("acquire", key, &reply))?;
                tracing::debug!(key = %key, fencing = token, ttl_ms = millis(ttl), "redis lock acquired");
                Ok(AcquireAttempt::Acquired(Lease::new(
                    key.clone(),
                    owner,
                    FencingToken::new(token),
                    sent_at,
                    ttl,
                    self.issuer,
                )))
            }
            (Some(0), Some(pttl)) => {
                let pttl = as_int(pttl).ok_or_else(|| unexpected("acquire", key, &reply))?;
                let expires_in = u64::try_from(pttl).ok().map(Duration::from_millis);
                tracing::trace!(key = %key, ?expires_in, "redis lock held by another owner");
                Ok(AcquireAttempt::Held { expires_in })
            }
            _ => Err(unexpected("acquire", key, &reply)),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        lease.check_issuer(self.issuer)?;
        let ttl = self.capabilities().effective_ttl(ttl)?;
        let key = lease.key();
        let keys = self.keys(key);
        let args = [
            scripts::lock_value(&lease.owner().to_hex(), lease.fencing_token().get()),
            millis(ttl).to_string(),
            self.retention_ms(ttl).to_string(),
        ];
        let sent_at = Instant::now();
        let reply = self
            .run(
                "redis extend",
                key,
                &keys,
                &EXTEND_SCRIPT,
                &[&keys.lock, &keys.fence],
                &args,
            )
            .await?;
        match as_int(&reply) {
            Some(1) => {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), ttl_ms = millis(ttl), "redis lock extended");
                Ok(lease.renewed(sent_at, ttl))
            }
            Some(0) => {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), "redis lock not held on extend");
                Err(LockError::not_held(format!(
                    "lock {:?} is no longer held by this lease (released, expired or taken over); it was not extended",
                    key.as_str()
                )))
            }
            _ => Err(unexpected("extend", key, &reply)),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        lease.check_issuer(self.issuer)?;
        let key = lease.key();
        let keys = self.keys(key);
        let args = [
            scripts::lock_value(&lease.owner().to_hex(), lease.fencing_token().get()),
            keys.channel.clone(),
        ];
        let reply = self
            .run(
                "redis release",
                key,
                &keys,
                &RELEASE_SCRIPT,
                &[&keys.lock],
                &args,
            )
            .await?;
        match deleted(key, &reply) {
            Some(true) => {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), "redis lock released");
                Ok(())
            }
            Some(false) => {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), "redis lock not held on release");
                Err(LockError::not_held(format!(
                    "lock {:?} is no longer held by this lease (released already, expired or taken over)",
                    key.as_str()
                )))
            }
            _ => Err(unexpected("release", key, &reply)),
        }
    }

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
        let Value::Array(items) = &reply else {
            return Err(unexpected("inspect", key, &reply));
        };
        match items.as_slice() {
            [state] if as_int(state) == Some(0) => Ok(LockState::Free),
            [state, pttl, token] if as_int(state) == Some(1) => {
                let pttl = as_int(pttl).ok_or_else(|| unexpected("inspect", key, &reply))?;
                let token = as_int(token)
                    .and_then(|t| u64::try_from(t).ok())
                    .ok_or_else(|| unexpected("inspect", key, &reply))?;
                Ok(LockState::Held {
                    expires_in: u64::try_from(pttl).ok().map(Duration::from_millis),
                    fencing_token: FencingToken::new(token),
                })
            }
            _ => Err(unexpected("inspect", key, &reply)),
        }
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
        match deleted(key, &reply) {
            Some(was_held) => {
                tracing::info!(key = %key, was_held, "redis lock force-released");
                Ok(was_held)
            }
            _ => Err(unexpected("force release", key, &reply)),
        }
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let keys = self.keys(key);
        let watch = self.waiters.watch(&keys.channel).await?;
        Ok(Some(watch))
    }
}
