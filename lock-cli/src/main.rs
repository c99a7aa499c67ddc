//! `distlock`: run a command under a distributed lock (Redis, etcd,
//! PostgreSQL), so the same cron line on every host runs the job once.
//!
//! Exit codes follow sysexits(3): 64 usage, 69 unavailable, 70 internal or
//! lock lost, 75 lock held (conflict, configurable), 78 configuration;
//! `run` otherwise passes the command's exit code through (128+N when it
//! died of signal N, 126/127 when it could not be started).

use std::ffi::{OsStr, OsString};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use distlock::{
    AcquireAttempt, ErrorKind, LockClient, LockError, LockKey, LockOptions, LockState, Locker,
};
use tokio::signal::unix::{signal, SignalKind};

mod duration;
mod watchdog;

use duration::{format_duration, parse_duration};
use watchdog::{signal_group, Watchdog, WATCHDOG_ARG};

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
    /// conflict code (75) without running CMD. CMD runs in a process group
    /// of its own and gets the fencing token of this acquisition in
    /// DISTLOCK_FENCING_TOKEN. SIGINT/SIGTERM sent to distlock are forwarded
    /// to the whole group. When CMD exits, whatever it left running in its
    /// group is killed (SIGKILL) before the lock is released.
    ///
    /// Stop before expiry: if the lock is lost, or a renewal has not
    /// succeeded by the stop moment (--stop-margin before the earliest moment
    /// the server may expire the lease), the whole group gets SIGTERM, then
    /// SIGKILL --kill-grace later, and distlock exits 70. --kill-grace must
    /// be shorter than --stop-margin, so CMD is gone before another host can
    /// get the lock. If distlock itself is killed, a watchdog process kills
    /// the group at once. (CMD is not the terminal's foreground group: it
    /// cannot read from the terminal.)
    #[command(after_help = EXAMPLES)]
    Run(RunArgs),
    /// Say whether KEY is held, by which fencing token and for how much
    /// longer (exit 0 free, 75 held).
    ///
    /// Reads the lock without taking it (the backend's inspect call):
    /// nothing changes and no fencing token value is used up. The answer is
    /// stale as soon as it is printed, so never decide on it whether to run a
    /// job: `distlock run` decides atomically. (A backend without operator
    /// calls is probed instead: the key is taken for the shortest TTL and
    /// released at once, which uses up one fencing token value and cannot
    /// show the holder's.)
    Status(StatusArgs),
    /// Clear a stuck lock whoever holds it (needs --force).
    ///
    /// Deletes the lock at KEY and wakes the processes waiting for it;
    /// fencing tokens keep growing. The holder is not told at once: its
    /// distlock finds out at its next renewal (within a third of its TTL)
    /// that the lock is gone and stops its command, which may overlap the
    /// next holder until then. Meant for a lock whose holder is known to be
    /// gone; otherwise wait for its TTL.
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
    /// stopped, --stop-margin before the lock ends) instead of holding it
    /// forever.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    max_hold: Option<Duration>,
    /// How long before the earliest moment the server may expire an
    /// unrenewed lease CMD is stopped (SIGTERM). Default: a third of --ttl
    /// (10s of the default 30s).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    stop_margin: Option<Duration>,
    /// How long CMD has to exit after SIGTERM before its group gets SIGKILL
    /// when the lock is lost. Must be shorter than --stop-margin. Default:
    /// half the stop margin (5s with the default TTL).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    kill_grace: Option<Duration>,
    /// Run under one of N permits of the key's semaphore instead of the
    /// lock: at most N commands run at once across all hosts (1: the
    /// lock). A semaphore's name space is its own: `--permits 3 --key x`
    /// and `--key x` do not exclude each other.
    #[arg(long, default_value_t = 1, value_name = "N")]
    permits: u32,
    /// Exit code when the lock (or every permit) is held elsewhere.
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
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new(WATCHDOG_ARG)) {
        return watchdog::run();
    }
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

async fn connect(url: &str) -> Result<LockClient, Failure> {
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

/// The lock options of `run` and the kill grace, checked before connecting:
/// the stop margin defaults to a third of the TTL, the kill grace to half
/// the stop margin, and the grace must fit inside the margin.
fn run_options(args: &RunArgs) -> Result<(LockOptions, Duration), Failure> {
    let margin = args.stop_margin.unwrap_or(args.ttl / 3);
    let kill_grace = args.kill_grace.unwrap_or(margin / 2);
    if kill_grace >= margin {
        return Err(Failure::new(
            code::USAGE,
            format!(
                "--kill-grace {} does not fit in the stop margin {}: CMD could outlive the lock; use a shorter --kill-grace, or a longer --stop-margin (which must stay below --ttl)",
                format_duration(kill_grace),
                format_duration(margin)
            ),
        ));
    }
    let mut options = LockOptions::new(args.ttl)
        .wait(args.wait)
        .stop_margin(margin);
    if let Some(min) = args.hold_at_least {
        options = options.hold_at_least(min);
    }
    if let Some(max) = args.max_hold {
        options = options.max_hold(max);
    }
    match args.permits {
        0 => {
            return Err(Failure::new(
                code::USAGE,
                "--permits 0 can never run anything; use at least 1",
            ))
        }
        1 => {}
        n => options = options.permits(n),
    }
    options
        .validate()
        .map_err(|e| Failure::lock("bad durations", &e))?;
    Ok((options, kill_grace))
}

async fn run(args: RunArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let what = display_command(&args.command);
    let (options, kill_grace) = run_options(&args)?;
    let mut interrupt = signal(SignalKind::interrupt())
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot handle SIGINT: {e}")))?;
    let mut terminate = signal(SignalKind::terminate())
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot handle SIGTERM: {e}")))?;

    let backend = connect(&args.url.url).await?;
    let locker = Locker::new(backend);

    // A signal ends the wait; a lock granted at that moment is released
    // before this returns (the runtime is shut down right after).
    let mut stopped_by = None;
    let acquired = locker
        .acquire_unless(&key, &options, async {
            stopped_by = Some(tokio::select! {
                _ = interrupt.recv() => libc::SIGINT,
                _ = terminate.recv() => libc::SIGTERM,
            });
        })
        .await;
    if let Some(signal) = stopped_by {
        return Ok(128 + signal as u8);
    }
    let guard = match acquired {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            let waited = if args.wait.is_zero() {
                String::new()
            } else {
                format!(" after waiting {}", format_duration(args.wait))
            };
            if args.permits > 1 {
                eprintln!(
                    "distlock: all {} permits of {key:?} are held by other processes{waited}; not running `{what}`",
                    args.permits
                );
            } else {
                eprintln!(
                    "distlock: lock {key:?} is held by another process{waited}; not running `{what}`"
                );
            }
            return Ok(args.conflict_exit_code);
        }
        Err(e) => return Err(Failure::lock(&format!("cannot acquire lock {key:?}"), &e)),
    };
    let fencing = guard.fencing_token();

    let (program, program_args) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::new(code::USAGE, "no command given after `--`"))?;
    // The group CMD joins; it outlives distlock only until the watchdog
    // notices distlock is gone.
    let mut watchdog = match Watchdog::spawn() {
        Ok(watchdog) => watchdog,
        Err(e) => {
            let _ = guard.release().await;
            return Err(Failure::new(
                code::SOFTWARE,
                format!(
                    "cannot start the watchdog process that stops `{what}` if distlock dies: {e}"
                ),
            ));
        }
    };
    let group = watchdog.group();
    let mut child = match tokio::process::Command::new(program)
        .args(program_args)
        .env("DISTLOCK_FENCING_TOKEN", fencing.to_string())
        .env("DISTLOCK_KEY", key.as_str())
        .process_group(group)
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                code::NOT_FOUND
            } else {
                code::CANNOT_EXECUTE
            };
            watchdog.stop_group().await;
            let _ = guard.release().await;
            return Err(Failure::new(code, format!("cannot run `{what}`: {e}")));
        }
    };
    let lost = guard.lost();
    tokio::pin!(lost);

    let status = loop {
        tokio::select! {
            biased;
            reason = &mut lost => {
                eprintln!(
                    "distlock: lost lock {key:?} (fencing token {fencing}) while `{what}` was running: {reason}; stopping its process group with SIGTERM"
                );
                signal_group(group, libc::SIGTERM);
                let exited = tokio::time::timeout(kill_grace, child.wait()).await.is_ok();
                if !exited {
                    eprintln!(
                        "distlock: `{what}` did not exit within {} of SIGTERM; sending SIGKILL",
                        format_duration(kill_grace)
                    );
                }
                // Also whatever the command left behind in its group.
                watchdog.stop_group().await;
                let _ = child.wait().await;
                // Frees the key before its TTL if the server still had it.
                let _ = guard.release().await;
                return Err(Failure::new(
                    code::SOFTWARE,
                    format!("`{what}` was stopped because lock {key:?} was lost"),
                ));
            }
            status = child.wait() => break status,
            _ = interrupt.recv() => signal_group(group, libc::SIGINT),
            _ = terminate.recv() => signal_group(group, libc::SIGTERM),
        }
    };
    // Nothing of CMD runs on once the lock is released.
    watchdog.stop_group().await;
    let status = status
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot wait for `{what}`: {e}")))?;
    if let Err(e) = guard.release().await {
        eprintln!("distlock: warning: releasing lock {key:?} after `{what}` finished: {e}");
    }
    Ok(exit_code_of(status))
}

/// Probes `key` with the shortest TTL the backend allows; a lease it gets is
/// released at once.
async fn probe(backend: &LockClient, key: &LockKey) -> Result<AcquireAttempt, Failure> {
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
    let state = if backend.admin().is_some() {
        backend
            .inspect(&key)
            .await
            .map_err(|e| Failure::lock(&format!("cannot inspect lock {key:?}"), &e))?
    } else {
        // A backend without the operator calls: an attempt tells held or
        // free (and uses up one fencing token value if free).
        match probe(&backend, &key).await? {
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
