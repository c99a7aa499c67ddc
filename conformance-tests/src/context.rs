//! What a case gets: independent clients, fresh keys, the backend's
//! capabilities, and (for fault cases) control of the server.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::{Capabilities, LockClient, LockError, LockKey, Locker};

use crate::fault::{with_timeouts, FaultPath, Link, Proxy};
use crate::server::{ServerHandle, ServerKind, ServerProcess};
use crate::url::with_namespace;

/// The future a client factory returns.
pub type ClientFuture = Pin<Box<dyn Future<Output = Result<LockClient, LockError>> + Send>>;

/// Opens a new, independent client for a server URL.
pub type ConnectFn = Arc<dyn Fn(String) -> ClientFuture + Send + Sync>;

/// A [`ConnectFn`] from an async closure: `connect_fn(|url| async move { ... })`.
pub fn connect_fn<F, Fut>(connect: F) -> ConnectFn
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<LockClient, LockError>> + Send + 'static,
{
    Arc::new(move |url| Box::pin(connect(url)))
}

/// Why a case failed: a message saying what was expected and what happened.
#[derive(Debug)]
pub struct CaseError(pub String);

impl fmt::Display for CaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<LockError> for CaseError {
    fn from(e: LockError) -> Self {
        CaseError(format!("unexpected error: {e} ({:?})", e.kind()))
    }
}

impl From<String> for CaseError {
    fn from(s: String) -> Self {
        CaseError(s)
    }
}

impl From<&str> for CaseError {
    fn from(s: &str) -> Self {
        CaseError(s.to_owned())
    }
}

/// What a case returns.
pub type CaseResult = Result<(), CaseError>;

/// Fails the case with a message unless `cond` holds.
#[macro_export]
macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::CaseError(format!("{} (failed: {})", format!($($msg)+), stringify!($cond))));
        }
    };
}

/// Fails the case unless `left == right`, showing both.
#[macro_export]
macro_rules! check_eq {
    ($left:expr, $right:expr, $($msg:tt)+) => {
        let (l, r) = (&$left, &$right);
        if l != r {
            return Err($crate::CaseError(format!("{}: left {:?} != right {:?}", format!($($msg)+), l, r)));
        }
    };
}

/// The environment of one case.
///
/// [`Suite`](crate::Suite) builds one per case. To run cases under a
/// harness of your own (a `#[tokio::test]`, say), build one with
/// [`TestContext::builder`]:
///
/// ```
/// use std::sync::Arc;
/// use distlock_conformance::{connect_fn, CaseResult, TestContext};
/// use distlock_core::{LockClient, MemoryLock};
///
/// async fn my_case(ctx: TestContext) -> CaseResult {
///     let client = ctx.client().await?;
///     let key = ctx.key("mine");
///     let lease = distlock_conformance::cases::support::acquire(&client, &key, ctx.long_ttl(), "mine").await?;
///     client.release(&lease).await?;
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_conformance::CaseError> {
/// let server = MemoryLock::new();
/// let connect = connect_fn(move |_url| {
///     let client = server.client();
///     async move { Ok(client) }
/// });
/// let ctx = TestContext::builder("memory", connect).build().await?;
/// my_case(ctx).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TestContext {
    pub(crate) backend: String,
    pub(crate) connect: ConnectFn,
    pub(crate) url: String,
    pub(crate) server: Option<Arc<ServerHandle>>,
    pub(crate) kind: Option<Arc<dyn ServerKind>>,
    pub(crate) capabilities: Capabilities,
    pub(crate) admin: bool,
    pub(crate) semaphore: bool,
    pub(crate) simulated_network: bool,
    pub(crate) namespaces: bool,
}

/// Builds a [`TestContext`]; see [`TestContext::builder`].
pub struct ContextBuilder {
    backend: String,
    connect: ConnectFn,
    server: Option<Arc<ServerHandle>>,
    kind: Option<Arc<dyn ServerKind>>,
    simulated_network: bool,
    namespaces: bool,
}

impl fmt::Debug for ContextBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextBuilder")
            .field("backend", &self.backend)
            .field("server", &self.server)
            .field("simulated_network", &self.simulated_network)
            .finish_non_exhaustive()
    }
}

impl ContextBuilder {
    /// The server the clients connect to: one the harness runs
    /// ([`ServerHandle::Owned`], so fault cases may kill, pause and proxy
    /// it) or an existing one ([`ServerHandle::External`]). Without one,
    /// the factory gets an empty URL (an in-process backend).
    pub fn server(mut self, server: Arc<ServerHandle>) -> Self {
        self.server = Some(server);
        self
    }

    /// The kind of server, so cases can start dedicated servers of it and
    /// build URLs for fault proxies.
    pub fn kind(mut self, kind: Arc<dyn ServerKind>) -> Self {
        self.kind = Some(kind);
        self
    }

    /// The factory wraps its clients with
    /// [`Link::attach`](crate::fault::Link::attach), so fault cases can
    /// run against an in-process backend (see
    /// [`Suite::simulated_network`](crate::Suite::simulated_network)).
    pub fn simulated_network(mut self, on: bool) -> Self {
        self.simulated_network = on;
        self
    }

    /// The factory of this in-process backend honours `namespace=NAME` in
    /// the URL it gets (see [`Suite::namespaces`](crate::Suite::namespaces));
    /// a backend with a server always must.
    pub fn namespaces(mut self, on: bool) -> Self {
        self.namespaces = on;
        self
    }

    /// Opens one client to read the backend's capabilities.
    pub async fn build(self) -> Result<TestContext, CaseError> {
        let url = self.server.as_ref().map(|s| s.url()).unwrap_or_default();
        let probe = (self.connect)(url.clone()).await.map_err(|e| {
            CaseError(format!(
                "cannot open a {} client for {url:?}: {e}",
                self.backend
            ))
        })?;
        let capabilities = probe.capabilities().clone();
        let admin = probe.admin().is_some();
        let semaphore = probe.semaphore().is_some();
        drop(probe);
        Ok(TestContext {
            backend: self.backend,
            connect: self.connect,
            url,
            server: self.server,
            kind: self.kind,
            capabilities,
            admin,
            semaphore,
            simulated_network: self.simulated_network,
            namespaces: self.namespaces,
        })
    }
}

/// The connect timeout of clients in fault cases: 2 s, as a TLS handshake
/// to a server that forks a process per connection (PostgreSQL) took over
/// 500 ms on a loaded 2-core machine. Requests stay bounded by
/// [`FAULT_OPERATION_TIMEOUT`].
pub const FAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(2000);
/// The operation timeout of clients in fault cases.
pub const FAULT_OPERATION_TIMEOUT: Duration = Duration::from_millis(1000);

impl fmt::Debug for TestContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestContext")
            .field("backend", &self.backend)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl TestContext {
    /// A context for the backend `backend` whose clients `connect` opens
    /// (see [`connect_fn`]); for running cases outside [`Suite`](crate::Suite).
    pub fn builder(backend: impl Into<String>, connect: ConnectFn) -> ContextBuilder {
        ContextBuilder {
            backend: backend.into(),
            connect,
            server: None,
            kind: None,
            simulated_network: false,
            namespaces: false,
        }
    }

    /// The backend's name as given to the suite.
    pub fn backend_name(&self) -> &str {
        &self.backend
    }

    /// Opens a new client with its own connections.
    pub async fn client(&self) -> Result<LockClient, CaseError> {
        self.client_at(&self.url).await
    }

    /// Opens a new client for another URL (e.g. through a fault proxy).
    pub async fn client_at(&self, url: &str) -> Result<LockClient, CaseError> {
        (self.connect)(url.to_owned())
            .await
            .map_err(|e| CaseError(format!("cannot open a client for {url:?}: {e}")))
    }

    /// A [`Locker`] over a new client.
    pub async fn locker(&self) -> Result<Locker, CaseError> {
        Ok(Locker::new(self.client().await?))
    }

    /// A fresh random key, so cases never share state.
    pub fn key(&self, label: &str) -> LockKey {
        crate::naming::unique_key(label)
    }

    /// Whether the backend has the operator calls (`inspect`,
    /// `force_release`).
    pub fn has_admin(&self) -> bool {
        self.admin
    }

    /// Whether the backend has counting semaphores.
    pub fn has_semaphore(&self) -> bool {
        self.semaphore
    }

    /// The backend's declared capabilities.
    pub fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    /// The shortest TTL worth testing expiry with: the backend's minimum, at
    /// least 200 ms.
    pub fn short_ttl(&self) -> Duration {
        self.capabilities
            .effective_ttl(Duration::from_millis(200))
            .unwrap_or(Duration::from_secs(1))
    }

    /// A TTL for a case that needs its guard's renewals to succeed but is
    /// not about expiry: long enough that a loaded 2-core machine renews in
    /// time (at 200 ms, grants came back too late to use and renewals
    /// missed their stop moment under stress-ng), short enough for a few
    /// renewals in a case's time. 2 s, or the backend's minimum above it.
    pub fn steady_ttl(&self) -> Duration {
        self.capabilities
            .effective_ttl(Duration::from_secs(2))
            .unwrap_or(Duration::from_secs(2))
    }

    /// A TTL no case outlives.
    pub fn long_ttl(&self) -> Duration {
        Duration::from_secs(60)
    }

    /// The server URL the suite runs against.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server, if the harness runs one (fault cases use it).
    pub fn server(&self) -> Option<&ServerHandle> {
        self.server.as_deref()
    }

    /// The kind of server the suite runs against, if any (`None` for an
    /// in-process backend).
    pub fn server_kind(&self) -> Option<&Arc<dyn ServerKind>> {
        self.kind.as_ref()
    }

    /// Whether the harness runs the servers itself (a [`ServerKind`] and no
    /// external URL override), so a case may start, kill and restart its own.
    pub fn controls_servers(&self) -> bool {
        self.kind.is_some() && self.server().is_some_and(|s| s.process().is_some())
    }

    /// The address of the shared server the harness started, if it did.
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.server().and_then(|s| s.process()).map(|p| p.addr())
    }

    /// Starts a dedicated server of the suite's kind for this case alone (a
    /// fault case that kills or restarts it must not disturb the shared
    /// server other cases run on). Killed when the last handle is dropped.
    pub async fn start_server(&self) -> Result<Arc<ServerProcess>, CaseError> {
        let kind = self
            .kind
            .clone()
            .filter(|_| self.controls_servers())
            .ok_or("this case needs a server the harness controls")?;
        let name = kind.name();
        tokio::task::spawn_blocking(move || ServerProcess::start(kind))
            .await
            .map_err(|e| format!("server start panicked: {e}"))?
            .map(Arc::new)
            .map_err(|e| CaseError(format!("cannot start a dedicated {name} server: {e}")))
    }

    /// Kills `server` (SIGKILL) and starts it again on the same port with
    /// the same data.
    pub async fn restart_server(&self, server: &Arc<ServerProcess>) -> Result<(), CaseError> {
        let server = server.clone();
        tokio::task::spawn_blocking(move || server.restart())
            .await
            .map_err(|e| format!("server restart panicked: {e}"))?
            .map_err(|e| CaseError(format!("cannot restart the server: {e}")))
    }

    /// Kills `server` with SIGKILL (without blocking the runtime).
    pub async fn kill_server(&self, server: &Arc<ServerProcess>) -> Result<(), CaseError> {
        let server = server.clone();
        tokio::task::spawn_blocking(move || server.kill())
            .await
            .map_err(|e| CaseError(format!("server kill panicked: {e}")))
    }

    /// The client URL for a server (or proxy) listening on `addr`, with the
    /// short fault-case timeouts ([`FAULT_CONNECT_TIMEOUT`],
    /// [`FAULT_OPERATION_TIMEOUT`]) appended.
    pub fn fault_url(&self, addr: SocketAddr) -> Result<String, CaseError> {
        let kind = self
            .kind
            .as_ref()
            .ok_or("this case needs a server kind to build URLs")?;
        Ok(with_timeouts(
            &kind.url(addr),
            FAULT_CONNECT_TIMEOUT,
            FAULT_OPERATION_TIMEOUT,
        ))
    }

    /// A new [`Proxy`] in front of `target` and a client that talks through
    /// it (with the short fault-case timeouts).
    pub async fn client_via_proxy(
        &self,
        target: SocketAddr,
    ) -> Result<(Proxy, LockClient), CaseError> {
        let proxy = self.proxy_to(target).await?;
        let client = self.client_at(&self.fault_url(proxy.addr())?).await?;
        Ok((proxy, client))
    }

    /// Whether a case can put faults between a client and the server: the
    /// harness runs the server (a TCP [`Proxy`] goes in front of it) or
    /// the in-process backend's factory attaches [`Link`]s.
    pub fn can_inject_faults(&self) -> bool {
        self.controls_servers() || (self.server.is_none() && self.simulated_network)
    }

    /// Whether a [`fault_path`](Self::fault_path) carries every connection
    /// of a client opened through it, so cutting it cuts the client off
    /// entirely, as a killed process is (see
    /// [`ServerKind::carries_every_connection`]).
    pub fn cuts_whole_clients(&self) -> bool {
        self.can_inject_faults()
            && self
                .kind
                .as_ref()
                .is_none_or(|k| k.carries_every_connection())
    }

    /// A new [`FaultPath`] to the suite's server: a [`Proxy`] in front of
    /// the shared server, or a [`Link`] for an in-process backend. Open
    /// clients through it with [`client_through`](Self::client_through).
    pub async fn fault_path(&self) -> Result<FaultPath, CaseError> {
        if let Some(addr) = self.server_addr() {
            return Ok(FaultPath::Proxy(self.proxy_to(addr).await?));
        }
        if self.can_inject_faults() {
            return Ok(FaultPath::Link(Link::new()));
        }
        Err("this case needs faults between client and server: a server the harness runs, or Suite::simulated_network for an in-process backend".into())
    }

    /// A new client through `path`, with the short fault-case timeouts
    /// ([`FAULT_CONNECT_TIMEOUT`], [`FAULT_OPERATION_TIMEOUT`]).
    pub async fn client_through(&self, path: &FaultPath) -> Result<LockClient, CaseError> {
        self.client_through_with(path, FAULT_OPERATION_TIMEOUT)
            .await
    }

    /// A new client through `path` whose connect and operation timeouts are
    /// both `timeout` (cases that delay traffic on purpose need more than
    /// the fault-case default).
    pub async fn client_through_with(
        &self,
        path: &FaultPath,
        timeout: Duration,
    ) -> Result<LockClient, CaseError> {
        let base = match path {
            FaultPath::Proxy(proxy) => self
                .kind
                .as_ref()
                .ok_or("this case needs a server kind to build URLs")?
                .url(proxy.addr()),
            FaultPath::Link(link) => link.url(),
        };
        self.client_at(&with_timeouts(&base, timeout, timeout))
            .await
    }

    async fn proxy_to(&self, target: SocketAddr) -> Result<Proxy, CaseError> {
        Proxy::start(target)
            .await
            .map_err(|e| CaseError(format!("cannot start a fault proxy: {e}")))
    }
}

/// Namespaces: clients of one server that must never see each other's locks.
impl TestContext {
    /// Whether a case can open clients in namespaces of their own
    /// ([`client_in_namespace`](Self::client_in_namespace)): every backend
    /// with a server (its URL takes `namespace=NAME`), and an in-process
    /// one whose suite declares [`Suite::namespaces`](crate::Suite::namespaces).
    pub fn has_namespaces(&self) -> bool {
        self.server.is_some() || self.namespaces
    }

    /// The suite's URL with its `namespace=` parameter set to `namespace`
    /// (see [`with_namespace`](crate::with_namespace)); for an in-process backend, whose URL is
    /// empty, `?namespace=NAME`.
    pub fn namespaced_url(&self, namespace: &str) -> String {
        with_namespace(&self.url, namespace)
    }

    /// A new client of the suite's server in `namespace` (1 to 64 ASCII
    /// letters, digits, `_`, `-`, `.`), opened by the factory with
    /// [`namespaced_url`](Self::namespaced_url).
    pub async fn client_in_namespace(&self, namespace: &str) -> Result<LockClient, CaseError> {
        self.client_at(&self.namespaced_url(namespace)).await
    }
}
