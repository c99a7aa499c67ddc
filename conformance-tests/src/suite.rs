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

/// The conformance suite for one backend: every case against the backend's
/// server, and again against each [`Variant`] (over TLS, through a pooler,
/// against a cluster), all in one libtest run that shares its threads.
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
    variants: Vec<Variant>,
    namespaces: bool,
    test_threads: usize,
}

/// One more way to run the whole suite in the same test binary: a name and
/// the server(s) it runs against. Its tests are called
/// `variant::group::case` (`tls::basic::acquire_then_release`), so
/// `cargo test --test conformance -- tls::` runs one variant. Added with
/// [`Suite::variant`].
///
/// Nothing is started when the variant is made: [`Suite::run`] starts the
/// servers of every variant at once, each on a thread of its own, and not
/// at all when the binary only lists its tests (`--list`) or runs as a
/// fault case's lock holder. A variant whose start fails (a missing
/// binary, a port taken, certificates that cannot be written) fails each of
/// its tests with the reason — never a panic, never a skip.
pub struct Variant {
    name: String,
    start: Box<dyn FnOnce() -> Result<Target, String> + Send>,
}

/// What a variant's start produced.
enum Target {
    /// A kind of server the harness runs (and fault cases kill, pause or
    /// proxy).
    Kind(Arc<dyn ServerKind>),
    /// Servers started by the variant, reached by URL, kept running by the
    /// handle.
    Group {
        url: String,
        keep: Box<dyn std::any::Any + Send>,
    },
}

impl std::fmt::Debug for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Variant")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Variant {
    /// A variant against a server the harness starts, like
    /// [`Suite::server`] (fault cases kill, pause and proxy it, or start
    /// their own of the kind); `kind` makes the kind when the run starts,
    /// so a kind that needs preparation (certificates) fails this
    /// variant's tests, not the binary. The kind's environment variable
    /// names an existing server instead, as for [`Suite::server`].
    pub fn server<K, E>(
        name: impl Into<String>,
        kind: impl FnOnce() -> Result<K, E> + Send + 'static,
    ) -> Self
    where
        K: ServerKind,
        E: std::fmt::Display,
    {
        Self {
            name: name.into(),
            start: Box::new(move || {
                kind()
                    .map(|kind| Target::Kind(Arc::new(kind)))
                    .map_err(|e| e.to_string())
            }),
        }
    }

    /// A variant against servers that `start` starts (a Sentinel group, a
    /// cluster, an existing deployment): it returns the URL the clients
    /// get and a handle that keeps the servers running until the
    /// variant's tests have ended (dropping it stops them). The harness
    /// does not control these servers, so the cases that must kill, pause
    /// or proxy one show as ignored with the reason, as for
    /// [`Suite::external_server`].
    pub fn group<H, E>(
        name: impl Into<String>,
        start: impl FnOnce() -> Result<(String, H), E> + Send + 'static,
    ) -> Self
    where
        H: Send + 'static,
        E: std::fmt::Display,
    {
        Self {
            name: name.into(),
            start: Box::new(move || match start() {
                Ok((url, keep)) => Ok(Target::Group {
                    url,
                    keep: Box::new(keep),
                }),
                Err(e) => Err(e.to_string()),
            }),
        }
    }

    /// Its name, the first part of its tests' names.
    pub fn name(&self) -> &str {
        &self.name
    }
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

/// One case's name (`group::case`, or `variant::group::case`) and outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaseReport {
    /// `group::case`, or `variant::group::case` for a [`Variant`]'s.
    pub name: String,
    /// How it ended.
    pub outcome: CaseOutcome,
}

/// How [`Suite::run_cases`] runs the cases.
#[derive(Debug, Clone)]
pub struct CaseRun {
    /// Cases run at once (each on its own small runtime).
    pub threads: usize,
    /// Names (`group::case`, `variant::group::case`) to start first, in
    /// this order; the rest follow in the suite's order.
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

/// What every case of one run (the suite's own, or a variant's) shares.
struct Shared {
    /// `variant::`, or empty for the suite's own run.
    prefix: String,
    backend: String,
    connect: ConnectFn,
    server: Result<Option<Arc<ServerHandle>>, String>,
    kind: Option<Arc<dyn ServerKind>>,
    simulated_network: bool,
    namespaces: bool,
    /// A group variant's servers, stopped when the last of its cases is
    /// done with this.
    _keep: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// How a run reaches its server, before anything is started.
enum Start {
    /// The suite's own run: no server (in-process), a kind the harness
    /// runs, or an external URL.
    Own {
        kind: Option<Arc<dyn ServerKind>>,
        external_url: Option<String>,
    },
    /// A variant's.
    Variant(Box<dyn FnOnce() -> Result<Target, String> + Send>),
}

/// A started run: its server (or why it has none) and its kind.
struct Started {
    server: Result<Option<Arc<ServerHandle>>, String>,
    kind: Option<Arc<dyn ServerKind>>,
    keep: Option<Box<dyn std::any::Any + Send>>,
}

impl Start {
    /// Starts the server(s); `launch = false` (listing the tests) starts
    /// nothing and leaves a reason the cases would fail with.
    fn start(self, launch: bool) -> Started {
        let not_started = || Started {
            server: Err("not started (the tests were only listed)".into()),
            kind: None,
            keep: None,
        };
        match self {
            Start::Own { kind, .. } if !launch && kind.is_some() => not_started(),
            Start::Own { kind, external_url } => {
                // A failure to start fails every case with the reason,
                // never a silent pass.
                let server = match (external_url, &kind) {
                    (Some(url), _) => Ok(Some(Arc::new(ServerHandle::External(url)))),
                    (None, Some(kind)) => ServerHandle::from_env_or_start(kind.clone())
                        .map(|handle| Some(Arc::new(handle)))
                        .map_err(|e| e.to_string()),
                    (None, None) => Ok(None),
                };
                Started {
                    server,
                    kind,
                    keep: None,
                }
            }
            Start::Variant(_) if !launch => not_started(),
            Start::Variant(start) => match start() {
                Ok(Target::Kind(kind)) => Started {
                    server: ServerHandle::from_env_or_start(kind.clone())
                        .map(|handle| Some(Arc::new(handle)))
                        .map_err(|e| e.to_string()),
                    kind: Some(kind),
                    keep: None,
                },
                Ok(Target::Group { url, keep }) => Started {
                    server: Ok(Some(Arc::new(ServerHandle::External(url)))),
                    kind: None,
                    keep: Some(keep),
                },
                Err(e) => Started {
                    server: Err(e),
                    kind: None,
                    keep: None,
                },
            },
        }
    }
}

impl Suite {
    /// A suite for the backend `name`; `connect` opens a new, independent
    /// client (its own connections) for a server URL each time it is
    /// called. The same factory serves every [`Variant`] (its URL says
    /// which server) and a fault case's lock holder.
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
            variants: Vec::new(),
            namespaces: false,
            test_threads: DEFAULT_TEST_THREADS,
        }
    }

    /// Runs the whole suite once more against `variant`'s server(s), in the
    /// same run (see [`Variant`]). A backend's test target declares its
    /// topologies this way:
    ///
    /// ```no_run
    /// use distlock_conformance::server::{self, RedisCluster, RedisTls, TestPki};
    /// use distlock_conformance::{Suite, Variant};
    /// use distlock_core::{LockClient, MemoryLock};
    ///
    /// fn main() -> std::process::ExitCode {
    ///     Suite::new("mine", |url: String| async move {
    ///         # let _ = url; let backend = MemoryLock::new(); // your backend, from url
    ///         Ok(LockClient::new(backend))
    ///     })
    ///     // `basic::…`: one server the harness starts.
    ///     .server(server::Redis::default())
    ///     // `tls::basic::…`: a server kind made at start (certificates).
    ///     .variant(Variant::server("tls", || {
    ///         TestPki::temporary().map(server::RedisTls::new)
    ///     }))
    ///     // `cluster::basic::…`: servers started here, stopped at the end.
    ///     .variant(Variant::group("cluster", || {
    ///         RedisCluster::start().map(|cluster| (cluster.url(), cluster))
    ///     }))
    ///     .test_threads(4)
    ///     .run()
    /// }
    /// ```
    pub fn variant(mut self, variant: Variant) -> Self {
        self.variants.push(variant);
        self
    }

    /// Cases run at once when the command line does not say
    /// (`--test-threads`); 8 unless set. Cases mostly wait on TTLs and
    /// servers, so more than the core count keeps the suite fast, but too
    /// many at once starve the short-TTL guard cases of a loaded machine.
    pub fn test_threads(mut self, threads: usize) -> Self {
        self.test_threads = threads.max(1);
        self
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
    /// shared ones, named `group::name` (and in every variant).
    pub fn case(mut self, case: Case) -> Self {
        self.extra.push(case);
        self
    }

    /// Adds several cases of your own.
    pub fn cases(mut self, cases: impl IntoIterator<Item = Case>) -> Self {
        self.extra.extend(cases);
        self
    }

    /// The test binary's `main`: parses the test command line, starts the
    /// servers (the suite's and every [`variant`](Self::variant)'s, side
    /// by side), runs every case of each as its own test, stops the
    /// servers and returns the exit code.
    ///
    /// If the binary was re-executed as a fault case's lock holder (see
    /// [`fault::holder`](crate::fault::holder)), runs that instead, with
    /// this suite's client factory, and starts no server.
    pub fn run(self) -> ExitCode {
        if let Some(code) = crate::fault::holder::run_if_requested(&self.connect) {
            return code;
        }
        let mut args = Arguments::from_args();
        args.test_threads.get_or_insert(self.test_threads);
        let (runs, cases) = self.prepare(!args.list);
        libtest_mimic::run(&args, trials(&runs, &cases)).exit_code()
    }

    /// One trial per case and run, named `group::case` and
    /// `variant::group::case`, for a libtest-mimic run of your own (the
    /// servers are started here, and stopped once every trial of theirs
    /// is dropped).
    pub fn trials(self) -> Vec<Trial> {
        let (runs, cases) = self.prepare(true);
        trials(&runs, &cases)
    }

    /// Runs the cases (the suite's and every variant's) without libtest,
    /// on `run.threads` threads, and returns every case's outcome in the
    /// suite's order: for harnesses of your own, and for the suite's
    /// mutant corpus (which stops at the first failure).
    pub fn run_cases(self, run: &CaseRun) -> Vec<CaseReport> {
        let (runs, cases) = self.prepare(true);
        let mut work: Vec<(String, Arc<Shared>, Case)> = runs
            .iter()
            .flat_map(|shared| {
                cases
                    .iter()
                    .map(|case| (full_name(shared, case), shared.clone(), *case))
            })
            .filter(|(name, _, _)| {
                (run.only.is_empty() || run.only.iter().any(|o| name.contains(o.as_str())))
                    && !run.skip.iter().any(|s| name.contains(s.as_str()))
            })
            .collect();
        let names: Vec<String> = work.iter().map(|(name, _, _)| name.clone()).collect();
        work.sort_by_key(|(name, _, _)| {
            run.first
                .iter()
                .position(|f| f == name)
                .unwrap_or(usize::MAX)
        });
        let queue = Mutex::new(work.into_iter().collect::<VecDeque<_>>());
        let results = Mutex::new(Vec::new());
        let (stop, stopped) = watch::channel(false);
        std::thread::scope(|scope| {
            for _ in 0..run.threads.max(1) {
                scope.spawn(|| loop {
                    if *stopped.borrow() {
                        return;
                    }
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
                    let Some((name, shared, case)) = next else {
                        return;
                    };
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

    /// Starts every run's server(s) side by side (`launch = false`: none)
    /// and lists the cases.
    fn prepare(self, launch: bool) -> (Vec<Arc<Shared>>, Vec<Case>) {
        let mut starts = vec![(
            String::new(),
            self.name.clone(),
            Start::Own {
                kind: self.server,
                external_url: self.external_url,
            },
        )];
        starts.extend(self.variants.into_iter().map(|variant| {
            (
                format!("{}::", variant.name),
                format!("{}-{}", self.name, variant.name),
                Start::Variant(variant.start),
            )
        }));
        let started: Vec<(String, String, Started)> = std::thread::scope(|scope| {
            let handles: Vec<_> = starts
                .into_iter()
                .map(|(prefix, backend, start)| {
                    (prefix, backend, scope.spawn(move || start.start(launch)))
                })
                .collect();
            handles
                .into_iter()
                .map(|(prefix, backend, handle)| {
                    let started = handle.join().unwrap_or_else(|panic| Started {
                        server: Err(format!("starting it panicked: {}", panic_text(&panic))),
                        kind: None,
                        keep: None,
                    });
                    (prefix, backend, started)
                })
                .collect()
        });
        let runs = started
            .into_iter()
            .map(|(prefix, backend, started)| {
                Arc::new(Shared {
                    prefix,
                    backend,
                    connect: self.connect.clone(),
                    server: started.server,
                    kind: started.kind,
                    simulated_network: self.simulated_network,
                    namespaces: self.namespaces,
                    _keep: Mutex::new(started.keep),
                })
            })
            .collect();
        let mut cases = cases::all();
        cases.extend(self.extra);
        (runs, cases)
    }
}

/// One libtest trial per run and case.
fn trials(runs: &[Arc<Shared>], cases: &[Case]) -> Vec<Trial> {
    runs.iter()
        .flat_map(|shared| {
            cases.iter().map(move |case| {
                let (shared, case) = (shared.clone(), *case);
                Trial::ignorable_test(full_name(&shared, &case), move || {
                    match run_case(case, &shared, None) {
                        CaseOutcome::Passed => Ok(Completion::Completed),
                        CaseOutcome::Ignored(reason) => Ok(Completion::ignored_with(reason)),
                        CaseOutcome::Failed(message) => Err(Failed::from(message)),
                        CaseOutcome::NotRun => Err(Failed::from("not run")),
                    }
                })
            })
        })
        .collect()
}

/// The text of a panic's payload.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// `variant::group::case`, or `group::case` for the suite's own run.
fn full_name(shared: &Shared, case: &Case) -> String {
    format!("{}{}", shared.prefix, case_name(case))
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
