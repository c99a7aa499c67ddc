//! Connecting a [`RedisLock`]: one server, a Sentinel primary or a
//! cluster, with retries within the connect timeout, the connect-time
//! checks (ACL permissions, the format marker, `maxmemory-policy`) and the
//! scripts preloaded.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    foreign_storage_format, read_storage_format, with_timeout, ClientOptions, ErrorKind, LockError,
    STORAGE_FORMAT,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Client};

use crate::backend::{Channels, RedisLock};
use crate::config::{RedisConfig, Server};
use crate::connection::{
    cluster_client, connect_budget, pending_cluster, Commands, Conn, Replaceable,
};
use crate::errors;
use crate::eviction;
use crate::keys::RedisKeys;
use crate::listener::{ClusterPubSub, PubSub};
use crate::scripts::{self, FORMAT_SCRIPT, PROBE_SCRIPT};
use crate::sentinel::SentinelPrimary;
use crate::tls;

impl RedisLock {
    /// The command connection, the pub/sub source and the channel commands
    /// for `server`.
    pub(crate) async fn open(
        server: Server,
        config: &RedisConfig,
        certificates: tls::Certificates,
        what: &str,
    ) -> Result<(Commands, PubSub, Channels), LockError> {
        let options = config.client();
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
                    .set_connection_timeout(Some(options.connect_timeout()))
                    .set_response_timeout(Some(options.operation_timeout()));
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
}

/// The driver's manager settings for one server under `options`.
pub(crate) fn manager_config(options: &ClientOptions) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(options.connect_timeout()))
        .set_response_timeout(Some(options.operation_timeout()))
        .set_number_of_retries(5)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1))
}

/// `first`, replaced after a failure or timeout by a new manager of
/// `client` (which connects at its first request).
pub(crate) fn replaceable_manager(
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
pub(crate) async fn retry_connect<T, F, Fut>(
    options: &ClientOptions,
    what: &str,
    mut attempt: F,
) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, LockError>>,
{
    // None: a timeout too long to date (it never runs out).
    let give_up = Instant::now().checked_add(options.connect_timeout());
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

/// Loads the scripts, checks the ACL user's permissions, the namespace's
/// format marker and the server's eviction policy, on the first connection.
pub(crate) async fn prepare(
    conn: &mut Conn,
    config: &RedisConfig,
    channels: Channels,
    what: &str,
) -> Result<(), LockError> {
    let options = config.client();
    preload(conn, options).await?;
    check_permissions(conn, options, channels, what).await?;
    check_format(conn, options, what).await?;
    eviction::check(conn, config, what).await
}

/// Stores the namespace's format marker if it has none, and refuses a
/// server whose marker names another format (see
/// [`distlock_core::read_storage_format`]). One script: two clients
/// connecting at once never both find the marker missing.
pub(crate) async fn check_format(
    conn: &mut impl ConnectionLike,
    options: &ClientOptions,
    what: &str,
) -> Result<(), LockError> {
    let marker = RedisKeys::format(options.namespace());
    let location = format!("at redis key {marker:?}");
    let stored = options
        .timed(what, async {
            match FORMAT_SCRIPT
                .invoke(conn, &[&marker], &[STORAGE_FORMAT.to_string()])
                .await
            {
                Ok(reply) => redis::from_redis_value::<Vec<u8>>(reply).map_err(|e| {
                    LockError::corrupted(format!(
                        "{what}: unexpected reply to the format check {location}: {e}"
                    ))
                }),
                Err(e) if e.code() == Some(errors::CORRUPT_CODE) => {
                    let detail = e.detail().unwrap_or("");
                    let found = detail.strip_prefix("format ").unwrap_or(detail);
                    Err(foreign_storage_format(what, &location, found))
                }
                Err(e) => Err(errors::map(e, what)),
            }
        })
        .await?;
    read_storage_format(what, &location, &stored)
}

/// Loads the scripts so the first acquire is one EVALSHA; this also proves
/// the credentials work.
pub(crate) async fn preload(
    conn: &mut impl ConnectionLike,
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

/// A client id for the ACL probe's channels (any hex id would do).
const PROBE_CLIENT: &str = "00000000000000000000000000000000";

/// Refuses an ACL user that cannot do what distlock needs in its namespace,
/// naming what is missing. Servers before 7.0 cannot be asked (no
/// `redis.acl_check_cmd`); there a missing permission shows at first use.
pub(crate) async fn check_permissions(
    conn: &mut impl ConnectionLike,
    options: &ClientOptions,
    channels: Channels,
    what: &str,
) -> Result<(), LockError> {
    let namespace = options.namespace();
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
                        &probe.waiters,
                        &permits.waiters,
                        &probe.holder,
                        &probe.turn,
                    ],
                    &[
                        // A client's channel: the base and a client id.
                        probe.client_channel(PROBE_CLIENT),
                        channels.publish.to_owned(),
                        channels.subscribe.to_owned(),
                        channels.unsubscribe.to_owned(),
                        permits.client_channel(PROBE_CLIENT),
                        RedisKeys::format(namespace),
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
