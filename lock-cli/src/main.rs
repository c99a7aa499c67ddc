//! `distlock`: run a command under a distributed lock (Redis, etcd,
//! PostgreSQL), so the same cron line on every host runs the job once.
//!
//! Exit codes follow sysexits(3): 64 usage, 69 unavailable, 70 internal or
//! lock lost, 75 lock held (conflict, configurable), 78 configuration;
//! `run` otherwise passes the command's exit code through (128+N when it
//! died of signal N, 126/127 when it could not be started).

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use distlock::{
    AcquireAttempt, DistributedLock, ErrorKind, LockError, LockKey, LockOptions, LockState, Locker,
};
use tokio::signal::unix::{signal, SignalKind};

mod duration;

use duration::{format_duration, parse_duration};

/// sysexits(3) codes.
mod code {
    pub const OK: u8 = 0;
    pub const USAGE: u8 = 64;
    pub const UNAVAILABLE: u8 = 69;
    pub const SOFTWARE: u8 = 70;
    pub const TEMPFAIL: u8 = 75;
    pub const CONFIG: u8 = 78;
    pub const CANNOT_EXECUTE: u8 = 126;
    pub const NOT_FOUND: u8 = 127;
}

const EXAMPLES: &str = "\
Examples:
  # The same crontab line on every host; the report runs on one of them.
  */5 * * * * distlock run --url redis://redis.internal:6379 --key nightly-report -- /usr/local/bin/report

  # Wait up to 2 minutes for the previous run instead of skipping.
  distlock run --url etcd://127.0.0.1:2379 --key backup --wait 2m -- ./backup.sh

  # The URL can come from the environment.
  export DISTLOCK_URL=postgres://locks@db/locks
  distlock run --key migrate --ttl 1m -- ./migrate --apply
  distlock status migrate

Exit codes: 0 or the command's own code (128+N if it died of signal N;
126/127 if it could not be executed), 75 lock held elsewhere (see
--conflict-exit-code), 70 lock lost while running (the command was stopped),
69 lock server unavailable, 64 usage error, 78 configuration error.

URL schemes: redis://, rediss://, etcd://, postgres://, memory:// (one process only).";

/// Run a command under a distributed lock, so a cron line on many hosts runs
/// the job on only one of them at a time.
#[derive(Debug, Parser)]
#[command(name = "distlock", version, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run CMD while holding the lock KEY (renewed while CMD runs).
    ///
    /// If the lock is held elsewhere, prints one line and exits with the
    /// conflict code (75) without running CMD. CMD gets the fencing token of
    /// this acquisition in DISTLOCK_FENCING_TOKEN. If the lock is lost while
    /// CMD runs, CMD gets SIGTERM, then SIGKILL after --kill-grace, and
    /// distlock exits 70. SIGINT/SIGTERM sent to distlock are forwarded to
    /// CMD; the lock is released when CMD exits.
    #[command(after_help = EXAMPLES)]
    Run(RunArgs),
    /// Say whether KEY is held and for how much longer (exit 0 free, 75 held).
    ///
    /// The contract has no read-only probe: a free key is found free by
    /// taking it for the shortest TTL and releasing it at once. That consumes
    /// one fencing token value; the holder's own fencing token cannot be
    /// shown.
    Status(StatusArgs),
    /// Clear a stuck lock (needs --force). Not supported by the lock
    /// contract yet: only the owner can release; a crashed owner's lock
    /// expires after its TTL.
    Release(ReleaseArgs),
}

#[derive(Debug, Args)]
struct UrlArg {
    /// The lock server, e.g. redis://127.0.0.1:6379, etcd://127.0.0.1:2379,
    /// postgres://user:pass@127.0.0.1/db.
    #[arg(long, env = "DISTLOCK_URL", value_name = "URL")]
    url: String,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    url: UrlArg,
    /// The lock name, shared by every host running the same job.
    #[arg(long, value_name = "KEY")]
    key: String,
    /// Lease time to live; renewed every third of it while CMD runs. A
    /// crashed distlock frees the key after at most this long.
    #[arg(long, default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    ttl: Duration,
    /// How long to wait for a held lock before giving up (0s: skip at once).
    #[arg(long, default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    wait: Duration,
    /// Keep the lock this long after acquiring even if CMD finishes sooner,
    /// so hosts whose cron fires a little late skip the same run.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    hold_at_least: Option<Duration>,
    /// Stop renewing after this long: a hung CMD loses the lock (and is
    /// stopped) instead of holding it forever.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    max_hold: Option<Duration>,
    /// After the lock is lost, how long CMD has to exit after SIGTERM before
    /// it gets SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    kill_grace: Duration,
    /// Exit code when the lock is held elsewhere.
    #[arg(long, default_value_t = code::TEMPFAIL, value_name = "N")]
    conflict_exit_code: u8,
    /// The command and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    url: UrlArg,
    /// The lock name.
    #[arg(value_name = "KEY")]
    key: String,
}

#[derive(Debug, Args)]
struct ReleaseArgs {
    #[command(flatten)]
    url: UrlArg,
    /// Confirm that you mean to clear a lock someone else may hold.
    #[arg(long)]
    force: bool,
    /// The lock name.
    #[arg(value_name = "KEY")]
    key: String,
}

/// A failure that ends distlock: one line on stderr and an exit code.
#[derive(Debug)]
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    fn lock(context: &str, error: &LockError) -> Self {
        let code = match error.kind() {
            ErrorKind::InvalidInput => code::USAGE,
            ErrorKind::Unavailable | ErrorKind::Timeout => code::UNAVAILABLE,
            ErrorKind::Config => code::CONFIG,
            _ => code::SOFTWARE,
        };
        Self::new(code, format!("{context}: {error}"))
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() {
                code::USAGE
            } else {
                code::OK
            });
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("distlock: cannot start the async runtime: {e}");
            return ExitCode::from(code::SOFTWARE);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
            Command::Status(args) => status(args).await,
            Command::Release(args) => release(args).await,
        }
    });
    // Do not wait for background tasks (a renewal in flight) on the way out.
    runtime.shutdown_background();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            eprintln!("distlock: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

async fn connect(url: &str) -> Result<std::sync::Arc<dyn DistributedLock>, Failure> {
    distlock::connect(url)
        .await
        .map_err(|e| Failure::lock("cannot connect to the lock server", &e))
}

fn lock_key(key: &str) -> Result<LockKey, Failure> {
    LockKey::new(key).map_err(|e| Failure::new(code::USAGE, format!("bad --key {key:?}: {e}")))
}

fn display_command(command: &[OsString]) -> String {
    command
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sends `signal` to process `pid` (ignoring a process that already exited).
fn send_signal(pid: Option<u32>, signal: libc::c_int) {
    if let Some(pid) = pid.and_then(|p| libc::pid_t::try_from(p).ok()) {
        // SAFETY: kill(2) with a pid we spawned and have not reaped yet
        // (tokio reaps only in `wait`, which we have not completed).
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

fn exit_code_of(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        // Exit codes are 0..=255 on Unix.
        u8::try_from(code & 0xff).unwrap_or(code::SOFTWARE)
    } else if let Some(signal) = status.signal() {
        u8::try_from(128 + (signal & 0x7f)).unwrap_or(code::SOFTWARE)
    } else {
        code::SOFTWARE
    }
}

async fn run(args: RunArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let what = display_command(&args.command);
    let mut interrupt = signal(SignalKind::interrupt())
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot handle SIGINT: {e}")))?;
    let mut terminate = signal(SignalKind::terminate())
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot handle SIGTERM: {e}")))?;

    let backend = connect(&args.url.url).await?;
    let locker = Locker::new(backend);
    let mut options = LockOptions::new(args.ttl).wait(args.wait);
    if let Some(min) = args.hold_at_least {
        options = options.hold_at_least(min);
    }
    if let Some(max) = args.max_hold {
        options = options.max_hold(max);
    }

    // Waiting can be interrupted; Locker::acquire is cancel-safe.
    let acquired = tokio::select! {
        acquired = locker.acquire(&key, &options) => acquired,
        _ = interrupt.recv() => return Ok(128 + libc::SIGINT as u8),
        _ = terminate.recv() => return Ok(128 + libc::SIGTERM as u8),
    };
    let guard = match acquired {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            let waited = if args.wait.is_zero() {
                String::new()
            } else {
                format!(" after waiting {}", format_duration(args.wait))
            };
            eprintln!(
                "distlock: lock {key:?} is held by another process{waited}; not running `{what}`"
            );
            return Ok(args.conflict_exit_code);
        }
        Err(e) => return Err(Failure::lock(&format!("cannot acquire lock {key:?}"), &e)),
    };
    let fencing = guard.fencing_token();

    let (program, program_args) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::new(code::USAGE, "no command given after `--`"))?;
    let mut child = match tokio::process::Command::new(program)
        .args(program_args)
        .env("DISTLOCK_FENCING_TOKEN", fencing.to_string())
        .env("DISTLOCK_KEY", key.as_str())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                code::NOT_FOUND
            } else {
                code::CANNOT_EXECUTE
            };
            let _ = guard.release().await;
            return Err(Failure::new(code, format!("cannot run `{what}`: {e}")));
        }
    };
    let pid = child.id();
    let lost = guard.lost();
    tokio::pin!(lost);

    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            _ = interrupt.recv() => send_signal(pid, libc::SIGINT),
            _ = terminate.recv() => send_signal(pid, libc::SIGTERM),
            reason = &mut lost => {
                eprintln!(
                    "distlock: lost lock {key:?} (fencing token {fencing}) while `{what}` was running: {reason}; stopping it with SIGTERM"
                );
                send_signal(pid, libc::SIGTERM);
                let waited = tokio::select! {
                    status = child.wait() => Some(status),
                    _ = tokio::time::sleep(args.kill_grace) => None,
                };
                if waited.is_none() {
                    eprintln!(
                        "distlock: `{what}` did not exit within {} of SIGTERM; sending SIGKILL",
                        format_duration(args.kill_grace)
                    );
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
                drop(guard);
                return Err(Failure::new(
                    code::SOFTWARE,
                    format!("`{what}` was stopped because lock {key:?} was lost"),
                ));
            }
        }
    };
    let status = status
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot wait for `{what}`: {e}")))?;
    if let Err(e) = guard.release().await {
        eprintln!("distlock: warning: releasing lock {key:?} after `{what}` finished: {e}");
    }
    Ok(exit_code_of(status))
}

/// Probes `key` with the shortest TTL the backend allows; a lease it gets is
/// released at once.
async fn probe(backend: &dyn DistributedLock, key: &LockKey) -> Result<AcquireAttempt, Failure> {
    let ttl = backend.capabilities().min_ttl.max(Duration::from_millis(1));
    let attempt = backend
        .try_acquire(key, ttl)
        .await
        .map_err(|e| Failure::lock(&format!("cannot check lock {key:?}"), &e))?;
    if let AcquireAttempt::Acquired(lease) = &attempt {
        // Ignore NotHeld: the probe's short lease may already have run out.
        match backend.release(lease).await {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotHeld => {}
            Err(e) => {
                return Err(Failure::lock(
                    &format!("cannot release probe of {key:?}"),
                    &e,
                ))
            }
        }
    }
    Ok(attempt)
}

fn describe_held(key: &LockKey, expires_in: Option<Duration>) -> String {
    match expires_in {
        Some(left) => format!(
            "{key}: held (lease expires in {} unless its holder renews it)",
            format_duration(left)
        ),
        None => format!("{key}: held (the server did not say for how long)"),
    }
}

async fn status(args: StatusArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let backend = connect(&args.url.url).await?;
    let state = if backend.capabilities().admin {
        backend
            .inspect(&key)
            .await
            .map_err(|e| Failure::lock(&format!("cannot inspect lock {key:?}"), &e))?
    } else {
        // A backend without the operator calls: an attempt tells held or
        // free (and uses up one fencing token value if free).
        match probe(&*backend, &key).await? {
            AcquireAttempt::Acquired(_) => LockState::Free,
            AcquireAttempt::Held { expires_in } => {
                println!("{}", describe_held(&key, expires_in));
                return Ok(code::TEMPFAIL);
            }
        }
    };
    match state {
        LockState::Held {
            expires_in,
            fencing_token,
        } => {
            println!(
                "{}, fencing token {fencing_token}",
                describe_held(&key, expires_in)
            );
            Ok(code::TEMPFAIL)
        }
        _ => {
            println!("{key}: free");
            Ok(code::OK)
        }
    }
}

async fn release(args: ReleaseArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    if !args.force {
        return Err(Failure::new(
            code::USAGE,
            format!(
                "refusing to release lock {key:?} without --force: a running holder would lose it mid-job"
            ),
        ));
    }
    let backend = connect(&args.url.url).await?;
    let was_held = backend
        .force_release(&key)
        .await
        .map_err(|e| Failure::lock(&format!("cannot force-release lock {key:?}"), &e))?;
    if was_held {
        println!("{key}: released; its holder loses the lock at its next renewal");
    } else {
        println!("{key}: free; nothing to release");
    }
    Ok(code::OK)
}
