//! Turns every case into its own named test (libtest-mimic), or runs the
//! cases directly and reports each outcome.

use std::collections::VecDeque;
use std::future::Future;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::{LockClient, LockError};
use libtest_mimic::{Arguments, Completion, Failed, Trial};
use tokio::sync::watch;

use crate::cases::{self, Case};
use crate::context::{connect_fn, ConnectFn, TestContext};
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
/// use distlock_conformance::Suite;
/// use distlock_core::{LockClient, MemoryLock};
///
/// fn main() -> std::process::ExitCode {
///     let server = MemoryLock::new();
///     Suite::new("memory", move |_url: String| {
///         let client = server.client();
///         async move { Ok(client) }
///     })
///     .run()
/// }
/// ```
///
/// A backend's own cases run beside the shared ones with
/// [`case`](Self::case), with the same [`TestContext`] and helpers
/// ([`cases::support`](crate::cases::support), [`check!`](crate::check)):
///
/// ```no_run
/// use std::sync::Arc;
/// use distlock_conformance::cases::{Case, Needs};
/// use distlock_conformance::{check, CaseResult, Suite, TestContext};
/// use distlock_core::{LockClient, MemoryLock};
///
/// async fn keys_are_namespaced(ctx: TestContext) -> CaseResult {
///     let client = ctx.client().await?;
///     check!(client.admin().is_some(), "this backend has admin calls");
///     Ok(())
/// }
///
/// fn main() -> std::process::ExitCode {
///     let server = MemoryLock::new();
///     Suite::new("memory", move |_url: String| {
///         let client = server.client();
///         async move { Ok(client) }
///     })
///     .case(Case::new("mine", "keys_are_namespaced", Needs::Nothing, |ctx| {
///         Box::pin(keys_are_namespaced(ctx))
///     }))
///     .run()
/// }
/// ```
pub struct Suite {
    name: String,
    connect: ConnectFn,
    server: Option<Arc<dyn ServerKind>>,
    external_url: Option<String>,
    simulated_network: bool,
    extra: Vec<Case>,
    variant: Option<String>,
    namespaces: bool,
}

/// How one case ended when run by [`Suite::run_cases`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaseOutcome {
    /// It passed.
    Passed,
    /// It failed, with the message.
    Failed(String),
    /// The backend lacks what it needs, with the reason.
    Ignored(String),
    /// It was not started, or stopped unfinished, because an earlier case
    /// failed (see [`CaseRun::stop_at_first_failure`]).
    NotRun,
}

/// One case's name (`group::case`) and outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaseReport {
    /// `group::case`.
    pub name: String,
    /// How it ended.
    pub outcome: CaseOutcome,
}

/// How [`Suite::run_cases`] runs the cases.
#[derive(Debug, Clone)]
pub struct CaseRun {
    /// Cases run at once (each on its own small runtime).
    pub threads: usize,
    /// Names (`group::case`) to start first, in this order; the rest follow
    /// in the suite's order.
    pub first: Vec<String>,
    /// Start no case after one failed, and stop those running.
    pub stop_at_first_failure: bool,
    /// Run only the cases whose name contains one of these (all if empty).
    pub only: Vec<String>,
    /// Leave out the cases whose name contains one of these.
    pub skip: Vec<String>,
}

impl Default for CaseRun {
    fn default() -> Self {
        Self {
            threads: DEFAULT_TEST_THREADS,
            first: Vec::new(),
            stop_at_first_failure: false,
            only: Vec::new(),
            skip: Vec::new(),
        }
    }
}

/// What every case of one run shares.
struct Shared {
    backend: String,
    connect: ConnectFn,
    server: Result<Option<Arc<ServerHandle>>, String>,
    kind: Option<Arc<dyn ServerKind>>,
    simulated_network: bool,
    namespaces: bool,
}

impl Suite {
    /// A suite for the backend `name`; `connect` opens a new, independent
    /// client (its own connections) for a server URL each time it is called.
    pub fn new<F, Fut>(name: impl Into<String>, connect: F) -> Self
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<LockClient, LockError>> + Send + 'static,
    {
        Self {
            name: name.into(),
            connect: connect_fn(connect),
            server: None,
            external_url: None,
            simulated_network: false,
            extra: Vec::new(),
            variant: None,
            namespaces: false,
        }
    }

    /// Names this run of the suite a variant of the backend's (over TLS,
    /// against a cluster): its tests are called `variant::group::case`,
    /// so several variants run side by side in one test binary
    /// ([`run_with`](Self::run_with)) and `cargo test -- tls::` picks one.
    pub fn variant(mut self, name: impl Into<String>) -> Self {
        self.variant = Some(name.into());
        self
    }

    /// As [`run`](Self::run), with the tests of `others` (usually
    /// [`variant`](Self::variant)s of this suite, each with its own
    /// server) in the same libtest run, so they share its threads. A
    /// re-executed fault-case holder connects with this suite's factory,
    /// so give every suite the same one.
    ///
    /// ```no_run
    /// use distlock_conformance::{server, Suite};
    /// use distlock_core::{LockClient, MemoryLock};
    ///
    /// fn main() -> std::process::ExitCode {
    /// #   let cluster_url = String::new();
    ///     let connect = |url: String| async move {
    ///         # let _ = url; let backend = MemoryLock::new(); // your backend, from url
    ///         Ok(LockClient::new(backend))
    ///     };
    ///     Suite::new("mine", connect)
    ///         .server(server::Redis::default())
    ///         .run_with([Suite::new("mine", connect)
    ///             .variant("cluster")
    ///             .external_server(cluster_url)])
    /// }
    /// ```
    pub fn run_with(self, others: impl IntoIterator<Item = Suite>) -> ExitCode {
        if let Some(code) = crate::fault::holder::run_if_requested(&self.connect) {
            return code;
        }
        let mut args = Arguments::from_args();
        if args.test_threads.is_none() {
            args.test_threads = Some(DEFAULT_TEST_THREADS);
        }
        let mut trials = self.trials();
        for other in others {
            trials.extend(other.trials());
        }
        libtest_mimic::run(&args, trials).exit_code()
    }

    /// The server the backend talks to: the harness starts it (or uses the
    /// URL in its environment variable). Without one, the factory gets an
    /// empty URL (in-process backends).
    pub fn server(mut self, kind: impl ServerKind) -> Self {
        self.server = Some(Arc::new(kind));
        self
    }

    /// Runs against a server you started yourself (your own harness:
    /// containers, a shared test cluster) at `url`, instead of one the
    /// harness starts. Cases that must kill, pause or proxy the server are
    /// then ignored with the reason.
    pub fn external_server(mut self, url: impl Into<String>) -> Self {
        self.external_url = Some(url.into());
        self
    }

    /// Declares that the factory of this in-process backend wraps each
    /// client with [`Link::attach`](crate::fault::Link::attach), so the
    /// suite can hand it `link://` URLs and run the fault cases over a
    /// simulated network (delays, cuts, black holes, a dead server):
    ///
    /// ```no_run
    /// use distlock_conformance::{fault::Link, Suite};
    /// use distlock_core::MemoryLock;
    ///
    /// fn main() -> std::process::ExitCode {
    ///     let server = MemoryLock::new();
    ///     Suite::new("memory", move |url: String| {
    ///         let client = server.client();
    ///         async move { Link::attach(&url, client) }
    ///     })
    ///     .simulated_network()
    ///     .run()
    /// }
    /// ```
    pub fn simulated_network(mut self) -> Self {
        self.simulated_network = true;
        self
    }

    /// Declares that the factory of this in-process backend honours the
    /// `namespace=NAME` parameter of the URL it gets (`?namespace=NAME`:
    /// the usual empty URL plus the parameter; read it with
    /// [`namespace_of`](crate::namespace_of)): clients of two namespaces
    /// share no lock. The cases that open clients in namespaces of their own
    /// ([`Needs::Namespaces`](crate::cases::Needs::Namespaces)) then run;
    /// a backend with a server runs them always (its URL takes
    /// `namespace=`).
    ///
    /// ```no_run
    /// use std::collections::HashMap;
    /// use std::sync::{Arc, Mutex};
    /// use distlock_conformance::{namespace_of, Suite};
    /// use distlock_core::MemoryLock;
    ///
    /// fn main() -> std::process::ExitCode {
    ///     // One in-process server per namespace.
    ///     let servers = Arc::new(Mutex::new(HashMap::<String, MemoryLock>::new()));
    ///     Suite::new("memory", move |url: String| {
    ///         let namespace = namespace_of(&url).unwrap_or_default().to_owned();
    ///         let client = servers.lock().unwrap().entry(namespace).or_default().client();
    ///         async move { Ok(client) }
    ///     })
    ///     .namespaces()
    ///     .run()
    /// }
    /// ```
    pub fn namespaces(mut self) -> Self {
        self.namespaces = true;
        self
    }

    /// Adds a case of your own (see the type's docs); it runs like the
    /// shared ones, named `group::name`.
    pub fn case(mut self, case: Case) -> Self {
        self.extra.push(case);
        self
    }

    /// Adds several cases of your own.
    pub fn cases(mut self, cases: impl IntoIterator<Item = Case>) -> Self {
        self.extra.extend(cases);
        self
    }

    /// Parses the test command line, runs the cases and returns the exit code.
    ///
    /// If the binary was re-executed as a fault case's lock holder (see
    /// [`fault::holder`](crate::fault::holder)), runs that instead.
    pub fn run(self) -> ExitCode {
        self.run_with([])
    }

    /// One trial per case, named `group::case` (`variant::group::case` for
    /// a [`variant`](Self::variant)).
    pub fn trials(self) -> Vec<Trial> {
        let prefix = self
            .variant
            .as_ref()
            .map(|variant| format!("{variant}::"))
            .unwrap_or_default();
        let (shared, cases) = self.prepare();
        cases
            .into_iter()
            .map(|case| {
                let shared = shared.clone();
                Trial::ignorable_test(format!("{prefix}{}", case_name(&case)), move || {
                    match run_case(case, &shared, None) {
                        CaseOutcome::Passed => Ok(Completion::Completed),
                        CaseOutcome::Ignored(reason) => Ok(Completion::ignored_with(reason)),
                        CaseOutcome::Failed(message) => Err(Failed::from(message)),
                        CaseOutcome::NotRun => Err(Failed::from("not run")),
                    }
                })
            })
            .collect()
    }

    /// Runs the cases without libtest, on `run.threads` threads, and returns
    /// every case's outcome in the suite's order: for harnesses of your own,
    /// and for the suite's mutant corpus (which stops at the first failure).
    pub fn run_cases(self, run: &CaseRun) -> Vec<CaseReport> {
        let (shared, cases) = self.prepare();
        let mut cases: Vec<Case> = cases
            .into_iter()
            .filter(|c| {
                let name = case_name(c);
                (run.only.is_empty() || run.only.iter().any(|o| name.contains(o.as_str())))
                    && !run.skip.iter().any(|s| name.contains(s.as_str()))
            })
            .collect();
        let names: Vec<String> = cases.iter().map(case_name).collect();
        let rank = |c: &Case| {
            let name = case_name(c);
            run.first
                .iter()
                .position(|f| *f == name)
                .unwrap_or(usize::MAX)
        };
        cases.sort_by_key(rank);
        let queue = Mutex::new(cases.into_iter().collect::<VecDeque<_>>());
        let results = Mutex::new(Vec::new());
        let (stop, stopped) = watch::channel(false);
        std::thread::scope(|scope| {
            for _ in 0..run.threads.max(1) {
                scope.spawn(|| loop {
                    if *stopped.borrow() {
                        return;
                    }
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
                    let Some(case) = next else { return };
                    let name = case_name(&case);
                    let outcome = run_case(case, &shared, Some(stopped.clone()));
                    if run.stop_at_first_failure && matches!(outcome, CaseOutcome::Failed(_)) {
                        stop.send_replace(true);
                    }
                    results
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(CaseReport { name, outcome });
                });
            }
        });
        let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
        names
            .into_iter()
            .map(|name| match results.iter().position(|r| r.name == name) {
                Some(i) => results.swap_remove(i),
                None => CaseReport {
                    name,
                    outcome: CaseOutcome::NotRun,
                },
            })
            .collect()
    }

    /// Starts the server (once for every case) and lists the cases.
    fn prepare(self) -> (Arc<Shared>, Vec<Case>) {
        // A failure to start fails every case with the reason, never a
        // silent pass.
        let server = match (&self.external_url, &self.server) {
            (Some(url), _) => Ok(Some(Arc::new(ServerHandle::External(url.clone())))),
            (None, Some(kind)) => ServerHandle::from_env_or_start(kind.clone())
                .map(|handle| Some(Arc::new(handle)))
                .map_err(|e| e.to_string()),
            (None, None) => Ok(None),
        };
        let shared = Arc::new(Shared {
            backend: self.name,
            connect: self.connect,
            server,
            kind: self.server,
            simulated_network: self.simulated_network,
            namespaces: self.namespaces,
        });
        let mut cases = cases::all();
        cases.extend(self.extra);
        (shared, cases)
    }
}

fn case_name(case: &Case) -> String {
    format!("{}::{}", case.group, case.name)
}

fn run_case(case: Case, shared: &Shared, stop: Option<watch::Receiver<bool>>) -> CaseOutcome {
    let backend = shared.backend.clone();
    let server = match &shared.server {
        Ok(server) => server.clone(),
        Err(e) => {
            return CaseOutcome::Failed(format!("the {backend} server is not available: {e}"))
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return CaseOutcome::Failed(format!("cannot build a tokio runtime: {e}")),
    };
    let mut builder = TestContext::builder(backend, shared.connect.clone())
        .simulated_network(shared.simulated_network)
        .namespaces(shared.namespaces);
    if let Some(server) = server {
        builder = builder.server(server);
    }
    if let Some(kind) = &shared.kind {
        builder = builder.kind(kind.clone());
    }
    let outcome = runtime.block_on(async move {
        let context = match builder.build().await {
            Ok(context) => context,
            Err(e) => return CaseOutcome::Failed(e.0),
        };
        if let Some(reason) = case.needs.missing(&context) {
            return CaseOutcome::Ignored(reason);
        }
        let stopped = async move {
            match stop {
                Some(mut stop) => {
                    let _ = stop.wait_for(|stopped| *stopped).await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = tokio::time::timeout(CASE_TIMEOUT, (case.run)(context)) => match result {
                Ok(Ok(())) => CaseOutcome::Passed,
                Ok(Err(e)) => CaseOutcome::Failed(e.0),
                Err(_) => CaseOutcome::Failed(format!("case did not finish within {CASE_TIMEOUT:?}")),
            },
            _ = stopped => CaseOutcome::NotRun,
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    outcome
}
