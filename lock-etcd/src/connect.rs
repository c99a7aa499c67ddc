//! Connecting an [`EtcdLock`]: the client's connect options (require-leader,
//! timeouts, keep-alive pings, credentials, TLS), the member health checks
//! of a cluster, and the first read that fails fast on an unreachable
//! cluster, a refused certificate or a user without permission.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{read_storage_format, Listener, LockError, STORAGE_FORMAT};
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, Txn, TxnOp, TxnOpResponse};

use crate::backend::{EtcdLock, Inner};
use crate::config::EtcdConfig;
use crate::connection::Etcd;
use crate::errors;
use crate::health::Health;
use crate::keys::KeyLayout;
use crate::listener::EtcdWatches;
use crate::permit_names::PermitNames;
use crate::queue::Queues;
use crate::requests::{self, Repeat, Requests};
use crate::session::Sessions;

/// HTTP/2 keep-alive ping interval, so a watch stream to a vanished server
/// is noticed. etcd's enforcement policy rejects pings more often than every
/// 5 s, and pings on a connection without open streams at all (so they are
/// only sent while a stream is open).
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// How often the watch listener pings a quiet watch stream, and cancels
/// watches whose waiters left that it could not cancel when they left.
const WATCH_SWEEP: Duration = Duration::from_secs(1);

impl EtcdLock {
    /// Connects to the cluster named by an `etcd://` URL (see
    /// [`EtcdConfig::from_url`]).
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(EtcdConfig::from_url(url)?).await
    }

    /// Connects with `config`: authenticates if it has a user, and checks
    /// the cluster answers, within the connect timeout. A wrong password is an
    /// [`ErrorKind::Config`](distlock_core::ErrorKind) error.
    pub async fn with_config(config: EtcdConfig) -> Result<Self, LockError> {
        config.validate()?;
        let options = config.client();
        // Require-leader: a member without a leader refuses requests at
        // once (and ends its watch streams) instead of stalling them, so
        // the client goes to a member that has one.
        let mut connect = ConnectOptions::new()
            .with_require_leader(true)
            .with_connect_timeout(options.connect_timeout())
            .with_timeout(options.operation_timeout())
            .with_keep_alive(KEEP_ALIVE_INTERVAL, options.operation_timeout())
            .with_keep_alive_while_idle(false)
            .with_auto_token_refresh(true);
        if let Some((name, password)) = config.credentials() {
            connect = connect.with_user(name.clone(), password.clone());
        }
        #[cfg(feature = "tls")]
        if config.uses_tls() {
            connect = connect
                .with_tls(crate::tls::options(options.tls(), options.connect_timeout()).await?);
        }
        let endpoints = config.endpoints().to_vec();
        let what = format!("connecting to etcd at {}", endpoints.join(","));
        let client = distlock_core::with_timeout(options.connect_timeout(), &what, async {
            Client::connect(&endpoints, Some(connect.clone()))
                .await
                .map_err(|e| errors::map(e, &what))
        })
        .await
        .map_err(unreachable_on_timeout)?;
        let health = (endpoints.len() > 1).then(|| {
            Health::new(
                client.clone(),
                endpoints.clone(),
                connect,
                KeyLayout::new(options.namespace())
                    .prefix()
                    .as_bytes()
                    .to_vec(),
                (options.operation_timeout() / requests::ATTEMPTS).max(requests::MIN_ATTEMPT),
            )
        });
        let lock = Self::build(client, config, health)?;
        lock.probe(&what).await?;
        lock.check_format(&what).await?;
        tracing::debug!(endpoints = ?lock.config().endpoints(), namespace = %lock.config().client().namespace(), "connected to etcd");
        Ok(lock)
    }

    /// Uses an existing client (its endpoints, credentials and TLS), with
    /// `config.client` for namespace and timeouts. Its endpoints and
    /// credentials are not used to connect; if it lists several endpoints,
    /// a request that reaches no server is sent again (the client's channel
    /// picks another endpoint), so list the client's. Does not contact the
    /// server, so the namespace's format marker is not checked.
    pub fn from_client(client: Client, config: EtcdConfig) -> Result<Self, LockError> {
        Self::build(client, config, None)
    }

    fn build(
        client: Client,
        config: EtcdConfig,
        health: Option<Arc<Health>>,
    ) -> Result<Self, LockError> {
        config.client().validate()?;
        let layout = KeyLayout::new(config.client().namespace());
        let watches = EtcdWatches::new(client.watch_client(), layout.prefix().as_bytes().to_vec());
        let listener = Listener::new(watches, config.client())
            .health_check_after(WATCH_SWEEP)
            .unsubscribe_on_leave();
        let requests = Requests::new(config.client().clone(), config.endpoints().len(), health);
        let etcd = Etcd {
            kv: client.kv_client(),
            leases: client.lease_client(),
            layout,
            requests,
        };
        let sessions = Arc::new(Sessions::new(etcd.clone()));
        let queues = Arc::new(Queues::new(
            etcd.clone(),
            Arc::new(Sessions::for_queue_entries(etcd.clone())),
            listener,
        ));
        Ok(Self {
            inner: Arc::new(Inner {
                etcd,
                config,
                sessions,
                queues,
                permit_names: PermitNames::default(),
                txn_ops: AtomicUsize::new(crate::txn::MAX_TXN_OPS),
            }),
        })
    }

    /// Stores the namespace's format marker if it has none (one
    /// transaction: of two clients connecting at once, one stores it and
    /// the other reads it), and refuses a marker naming another format
    /// (see [`distlock_core::read_storage_format`]).
    async fn check_format(&self, what: &str) -> Result<(), LockError> {
        let marker = self.etcd().layout.format();
        let location = format!("at etcd key {marker:?}");
        let kv = self.etcd().kv.clone();
        // Safe to send again: a second one finds the marker the first stored.
        let reply = self
            .etcd()
            .requests
            .send(what, Repeat::Safe, || {
                let mut kv = kv.clone();
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        marker.as_str(),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then([TxnOp::put(
                        marker.as_str(),
                        STORAGE_FORMAT.to_string(),
                        None,
                    )])
                    .or_else([TxnOp::get(marker.as_str(), None)]);
                async move { kv.txn(txn).await }
            })
            .await?;
        if reply.succeeded() {
            return Ok(());
        }
        let stored = reply.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let Some(stored) = stored else {
            // The comparison found the key, so the read of the same
            // transaction finds it too; an empty reply is a broken server.
            return Err(LockError::corrupted(format!(
                "{what}: etcd answered the format check {location} with no value"
            )));
        };
        read_storage_format(what, &location, &stored)
    }

    /// One read inside the namespace, to fail fast on an unreachable cluster,
    /// a refused certificate or a user without permission; sent again
    /// (within the connect timeout) while that may help.
    async fn probe(&self, what: &str) -> Result<(), LockError> {
        let deadline = Instant::now() + self.inner.config.client().connect_timeout();
        let tls = self.inner.config.uses_tls();
        let mut diagnosed = false;
        loop {
            let kv = self.etcd().kv.clone();
            let key = self.etcd().layout.prefix().as_bytes().to_vec();
            let left = deadline.saturating_duration_since(Instant::now());
            let probed = self
                .etcd()
                .requests
                .send_within(
                    left,
                    what,
                    Repeat::Safe,
                    || {
                        let mut kv = kv.clone();
                        let key = key.clone();
                        async move { kv.get(key, None).await.map(|_| ()) }
                    },
                    // A TLS connection the server closed: find out why
                    // (once) before trying again.
                    |e| tls && !diagnosed && errors::closed_by_peer(e),
                )
                .await;
            let error = match probed {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if !closed_by_peer(&error) {
                return Err(unreachable_on_timeout(error));
            }
            if tls && !diagnosed {
                diagnosed = true;
                let left = deadline.saturating_duration_since(Instant::now());
                if let Some(refused) = self.client_certificate_refused(what, left).await {
                    return Err(refused.with_source(error));
                }
                // Not that: a member going away, say. Try again.
                continue;
            }
            let hint = if tls {
                "the server closed the connection right after the TLS handshake each time, as an etcd with --client-cert-auth does to clients whose certificate it does not accept (tls_cert_file, tls_key_file)"
            } else {
                "the server closed the connection each time: if it serves TLS on this port, use etcds://"
            };
            let message = format!("{}; {hint}", error.message());
            return Err(LockError::unavailable(message).with_source(error));
        }
    }

    /// Whether the server refuses this client's certificate after the
    /// handshake (tonic sees only a closed connection): one diagnostic
    /// handshake per endpoint, within `left`, reads the server's alert.
    async fn client_certificate_refused(&self, what: &str, left: Duration) -> Option<LockError> {
        #[cfg(feature = "tls")]
        {
            let config = &self.inner.config;
            let diagnose = async {
                for endpoint in config.endpoints() {
                    if let Some(refusal) =
                        crate::tls::refusal(endpoint, config.client().tls(), left).await
                    {
                        return Some(refusal);
                    }
                }
                None
            };
            if let Ok(Some(refusal)) = tokio::time::timeout(left, diagnose).await {
                return Some(crate::tls::error(what, &refusal));
            }
        }
        let _ = (what, left);
        None
    }
}

/// Whether `error` came from a connection the server closed.
fn closed_by_peer(error: &LockError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<etcd_client::Error>())
        .is_some_and(errors::closed_by_peer)
}

/// A timeout while connecting means the cluster is unreachable.
fn unreachable_on_timeout(error: LockError) -> LockError {
    if error.kind() == distlock_core::ErrorKind::Timeout {
        LockError::unavailable(error.message().to_owned()).with_source(error)
    } else {
        error
    }
}
