//! Turns every case into its own named test (libtest-mimic).

use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use lock_core::{DistributedLock, LockError};

use crate::cases::{self, Case};
use crate::context::{ConnectFn, TestContext};
use crate::server::{ServerHandle, ServerKind};

/// The longest a single case may run before it fails as hung.
const CASE_TIMEOUT: Duration = Duration::from_secs(180);

/// Parallel cases when the command line does not say (cases mostly wait on
/// TTLs, so more than the core count keeps the suite fast).
const DEFAULT_TEST_THREADS: usize = 8;

/// The conformance suite for one backend.
///
/// ```no_run
/// use std::sync::Arc;
/// use conformance_tests::Suite;
/// use lock_core::{DistributedLock, MemoryLock};
///
/// fn main() -> std::process::ExitCode {
///     let server = MemoryLock::new();
///     Suite::new("memory", move |_url: String| {
///         let client = server.client();
///         async move { Ok(client as Arc<dyn DistributedLock>) }
///     })
///     .run()
/// }
/// ```
pub struct Suite {
    name: String,
    connect: ConnectFn,
    server: Option<Arc<dyn ServerKind>>,
}

impl Suite {
    /// A suite for the backend `name`; `connect` opens a new, independent
    /// client (its own connections) for a server URL each time it is called.
    pub fn new<F, Fut>(name: impl Into<String>, connect: F) -> Self
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Arc<dyn DistributedLock>, LockError>> + Send + 'static,
    {
        Self {
            name: name.into(),
            connect: Arc::new(move |url| Box::pin(connect(url))),
            server: None,
        }
    }

    /// The server the backend talks to: the harness starts it (or uses the
    /// URL in its environment variable). Without one, the factory gets an
    /// empty URL (in-process backends).
    pub fn server(mut self, kind: impl ServerKind) -> Self {
        self.server = Some(Arc::new(kind));
        self
    }

    /// Parses the test command line, runs the cases and returns the exit code.
    ///
    /// If the binary was re-executed as a fault case's lock holder (see
    /// [`fault::holder`](crate::fault::holder)), runs that instead.
    pub fn run(self) -> ExitCode {
        if let Some(code) = crate::fault::holder::run_if_requested(&self.connect) {
            return code;
        }
        let mut args = Arguments::from_args();
        if args.test_threads.is_none() {
            args.test_threads = Some(DEFAULT_TEST_THREADS);
        }
        libtest_mimic::run(&args, self.trials()).exit_code()
    }

    /// One trial per case, named `group::case`.
    pub fn trials(self) -> Vec<Trial> {
        // Started once for the whole binary; a failure to start fails every
        // case with the reason, never a silent pass.
        let server = self
            .server
            .as_ref()
            .map(|kind| ServerHandle::from_env_or_start(kind.clone()).map(Arc::new));
        let server = match server {
            Some(Ok(handle)) => Ok(Some(handle)),
            Some(Err(e)) => Err(e.to_string()),
            None => Ok(None),
        };
        cases::all()
            .into_iter()
            .map(|case| {
                let name = format!("{}::{}", case.group, case.name);
                let backend = self.name.clone();
                let connect = self.connect.clone();
                let server = server.clone();
                let kind = self.server.clone();
                Trial::ignorable_test(name, move || run_case(case, backend, connect, server, kind))
            })
            .collect()
    }
}

fn run_case(
    case: Case,
    backend: String,
    connect: ConnectFn,
    server: Result<Option<Arc<ServerHandle>>, String>,
    kind: Option<Arc<dyn ServerKind>>,
) -> Result<Completion, Failed> {
    let server =
        server.map_err(|e| Failed::from(format!("the {backend} server is not available: {e}")))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failed::from(format!("cannot build a tokio runtime: {e}")))?;
    let result = runtime.block_on(async move {
        let url = server.as_ref().map(|s| s.url()).unwrap_or_default();
        let probe = connect(url.clone())
            .await
            .map_err(|e| format!("cannot open a {backend} client for {url:?}: {e}"))?;
        let context = TestContext {
            backend,
            connect,
            url,
            server,
            kind,
            capabilities: probe.capabilities(),
        };
        drop(probe);
        if let Some(reason) = case.needs.missing(&context) {
            return Ok(Completion::ignored_with(reason));
        }
        match tokio::time::timeout(CASE_TIMEOUT, (case.run)(context)).await {
            Ok(Ok(())) => Ok(Completion::Completed),
            Ok(Err(e)) => Err(e.0),
            Err(_) => Err(format!("case did not finish within {CASE_TIMEOUT:?}")),
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    result.map_err(Failed::from)
}
