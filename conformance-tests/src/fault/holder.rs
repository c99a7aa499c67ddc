//! A lock holder in a child process, to be killed with SIGKILL.
//!
//! The conformance test binary re-executes itself with
//! [`HOLDER_ENV`] set; [`Suite::run`](crate::Suite::run) sees the variable
//! before anything else and runs *holder mode* with the suite's own client
//! factory: it acquires the key through a [`Locker`] (a guard that renews
//! itself), prints one line `ACQUIRED <fencing token>` to stdout and holds
//! the lock until it is killed. It exits by itself when its stdin closes
//! (the test process is gone), so a crashed test leaves no holder behind.

use std::io::{self, BufRead, Write};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use distlock_core::{FencingToken, LockKey, LockOptions, Locker};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStderr, Command};

use crate::context::ConnectFn;

/// The environment variable that switches a conformance test binary into
/// holder mode: `<url>|<key>|<ttl_ms>` (neither the URL nor the key may
/// contain `|`).
pub const HOLDER_ENV: &str = "DISTLOCK_CONFORMANCE_HOLDER";

/// How long a holder may take to start and acquire.
const START_BOUND: Duration = Duration::from_secs(60);

/// A child process holding a lock (see the [module docs](self)).
/// Killed with SIGKILL when dropped.
#[derive(Debug)]
pub struct HolderProcess {
    child: Child,
    stderr: Option<ChildStderr>,
    fencing: FencingToken,
}

impl HolderProcess {
    /// Starts the current test binary in holder mode for `key` on the server
    /// at `url`, with leases of `ttl` renewed by the guard, and waits until
    /// it reports that it holds the lock.
    ///
    /// Only works from a binary whose `main` is [`Suite::run`](crate::Suite::run).
    pub async fn spawn(url: &str, key: &LockKey, ttl: Duration) -> io::Result<HolderProcess> {
        if url.contains('|') || key.as_str().contains('|') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the holder's URL and key must not contain '|'",
            ));
        }
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .env(
                HOLDER_ENV,
                format!("{url}|{}|{}", key.as_str(), ttl.as_millis()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("holder has no stdout"))?;
        let mut stderr = child.stderr.take();
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(START_BOUND, lines.next_line()).await;
        let fencing = match line {
            Ok(Ok(Some(line))) => line
                .strip_prefix("ACQUIRED ")
                .and_then(|t| t.trim().parse::<u64>().ok())
                .map(FencingToken::new),
            _ => None,
        };
        match fencing {
            Some(fencing) => Ok(HolderProcess {
                child,
                stderr,
                fencing,
            }),
            None => {
                let _ = child.kill().await;
                let mut text = String::new();
                if let Some(stderr) = stderr.as_mut() {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        stderr.read_to_string(&mut text),
                    )
                    .await;
                }
                Err(io::Error::other(format!(
                    "the holder process did not report ACQUIRED within {START_BOUND:?}; its stderr:\n{text}"
                )))
            }
        }
    }

    /// The fencing token the holder was granted.
    pub fn fencing_token(&self) -> FencingToken {
        self.fencing
    }

    /// Whether the child is still running (it exits by itself only if it
    /// lost its lock or could not keep it).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the child with SIGKILL (no chance to release) and reaps it;
    /// returns the instant the signal was sent.
    pub async fn kill(mut self) -> io::Result<Instant> {
        let at = Instant::now();
        self.child.start_kill()?;
        self.child.wait().await?;
        drop(self.stderr.take());
        Ok(at)
    }
}

/// Holder mode, if [`HOLDER_ENV`] is set: runs it and returns the exit code.
pub(crate) fn run_if_requested(connect: &ConnectFn) -> Option<ExitCode> {
    let spec = std::env::var(HOLDER_ENV).ok()?;
    Some(match holder_main(&spec, connect) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            let _ = writeln!(io::stderr(), "holder: {message}");
            ExitCode::FAILURE
        }
    })
}

fn holder_main(spec: &str, connect: &ConnectFn) -> Result<(), String> {
    let mut parts = spec.splitn(3, '|');
    let (url, key, ttl) = match (parts.next(), parts.next(), parts.next()) {
        (Some(url), Some(key), Some(ttl)) => (url, key, ttl),
        _ => {
            return Err(format!(
                "{HOLDER_ENV} must be <url>|<key>|<ttl_ms>, got {spec:?}"
            ))
        }
    };
    let key = LockKey::new(key).map_err(|e| format!("bad key: {e}"))?;
    let ttl = ttl
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|e| format!("bad TTL {ttl:?}: {e}"))?;
    // Exit when the parent goes away (its end of our stdin closes).
    std::thread::spawn(|| {
        let mut sink = String::new();
        let _ = io::stdin().lock().read_line(&mut sink);
        std::process::exit(0);
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build a runtime: {e}"))?;
    runtime.block_on(async move {
        let client = connect(url.to_owned())
            .await
            .map_err(|e| format!("cannot connect to {url:?}: {e}"))?;
        let locker = Locker::new(client);
        let options = LockOptions::new(ttl).with_wait(START_BOUND);
        let guard = locker
            .acquire(&key, &options)
            .await
            .map_err(|e| format!("acquire failed: {e}"))?
            .ok_or_else(|| format!("{key} still held after {START_BOUND:?}"))?;
        // The protocol line the parent waits for (holder mode is a test
        // child process; stdout is its channel to the parent).
        let mut stdout = io::stdout().lock();
        writeln!(stdout, "ACQUIRED {}", guard.fencing_token())
            .and_then(|()| stdout.flush())
            .map_err(|e| format!("cannot write to stdout: {e}"))?;
        drop(stdout);
        let reason = guard.lost().await;
        Err(format!("lost the lock while holding it: {reason}"))
    })
}
