//! The commands: argument parsing, `run`, `status`/`inspect`, `release`.

use std::ffi::{OsStr, OsString};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use distlock::{
    AcquireAttempt, ErrorKind, FencingToken, LockClient, LockError, LockKey, LockOptions,
    LockState, Locker,
};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::duration::{format_duration, parse_duration};
use crate::help;
use crate::log::{failure, note, warning, LogArgs};
use crate::watchdog::{self, signal_group, Watchdog, WATCHDOG_ARG};

/// How long a signal that ended the wait waits, at most, for the give-back
/// of what an attempt in flight took (one settling attempt and a release;
/// also bounded by the kill grace).
const GIVE_BACK_WAIT: Duration = Duration::from_secs(10);

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

/// Run a command under a distributed lock, so a cron line on many hosts runs
/// the job on only one of them at a time.
#[derive(Debug, Parser)]
#[command(name = "distlock", version)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
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
    /// DISTLOCK_FENCING_TOKEN (and the key in DISTLOCK_KEY); it does not get
    /// DISTLOCK_URL, which may hold a password, unless --pass-url.
    /// SIGINT/SIGTERM sent to distlock are forwarded to the whole group
    /// (before CMD starts, they end the wait, giving back anything granted);
    /// SIGTSTP (Ctrl-Z) is ignored, with a note, because a stopped distlock
    /// cannot renew. When CMD exits, whatever it left running in its group
    /// is killed (SIGKILL) before the lock is released.
    ///
    /// Stop before expiry: if the lock is lost, or a renewal has not
    /// succeeded by the stop moment (--stop-margin before the earliest moment
    /// the server may expire the lease), the whole group gets SIGTERM, then
    /// SIGKILL --kill-grace later, and distlock exits 70. --kill-grace must
    /// be shorter than --stop-margin, so CMD is gone before another host can
    /// get the lock. A watchdog process enforces this even when distlock
    /// cannot (stopped with SIGSTOP, frozen or starved): it stops the group
    /// at the stop moment unless distlock has told it of a renewal first,
    /// and kills the group at once if distlock dies. (CMD is not the
    /// terminal's foreground group: it cannot read from the terminal.)
    ///
    /// On stderr: a line when a wait starts (the key, the holder's fencing
    /// token, how long distlock will wait), failed renewals as warnings, the
    /// lost line with its reason; nothing for a run that simply succeeds.
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
    ///
    /// With --json, one JSON object on stdout: {"key": "nightly-report",
    /// "held": true, "fencing_token": 42, "expires_in_ms": 27000,
    /// "backend": "redis"} (fencing_token and expires_in_ms are null when
    /// free or unknown). These field names are stable; new ones may be
    /// added.
    Status(StatusArgs),
    /// Same as `status --json`: KEY's state as one JSON object on stdout
    /// (exit 0 free, 75 held).
    Inspect(InspectArgs),
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
    /// postgres://user:pass@127.0.0.1/db. Give a URL with a password in
    /// DISTLOCK_URL rather than --url: other local users can read command
    /// lines.
    // Never shown in --help: the value may hold a password.
    #[arg(long, env = "DISTLOCK_URL", hide_env_values = true, value_name = "URL")]
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
    /// unrenewed lease CMD is stopped (SIGTERM). Default: a third of the
    /// lease, which is --ttl or a shorter --max-hold (10s of the default
    /// 30s).
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
    /// Pass the lock server's URL, password included, to CMD in
    /// DISTLOCK_URL (without it CMD does not get DISTLOCK_URL at all).
    #[arg(long)]
    pass_url: bool,
    /// The command and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    url: UrlArg,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
    /// The lock name.
    #[arg(value_name = "KEY")]
    key: String,
}

#[derive(Debug, Args)]
struct InspectArgs {
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
            // Retrying cannot help; an operator must change the URL (an
            // operation this backend lacks) or the data at the key (foreign
            // data in distlock's namespace). 70 stays "lock lost".
            ErrorKind::Config | ErrorKind::Unsupported | ErrorKind::Corrupted => code::CONFIG,
            _ => code::SOFTWARE,
        };
        Self::new(code, format!("{context}: {error}"))
    }

    /// The same failure, saying that `run` did not start CMD (for failures
    /// before it starts).
    fn not_running(mut self, what: &str) -> Self {
        self.message.push_str(&format!("; not running `{what}`"));
        self
    }
}

/// Parses the arguments, with the help texts that are built at run time
/// (the URL schemes of this build).
fn parse() -> Result<Cli, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};
    let after_help = help::after_help();
    let command = Cli::command()
        .after_help(after_help.clone())
        .mut_subcommand("run", |run| run.after_help(after_help));
    Cli::from_arg_matches(&command.try_get_matches()?)
}

pub fn main() -> ExitCode {
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new(WATCHDOG_ARG)) {
        return watchdog::run();
    }
    let cli = match parse() {
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
    crate::log::install(&cli.log);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            failure!("cannot start the async runtime: {e}");
            return ExitCode::from(code::SOFTWARE);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
            Command::Status(args) => status(args.url, &args.key, args.json).await,
            Command::Inspect(args) => status(args.url, &args.key, true).await,
            Command::Release(args) => release(args).await,
        }
    });
    // Do not wait for background tasks (a renewal in flight) on the way out.
    runtime.shutdown_background();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            failure!(exit_code = e.code, "{}", e.message);
            ExitCode::from(e.code)
        }
    }
}

async fn connect(url: &str) -> Result<LockClient, Failure> {
    if let Some(message) = help::not_in_this_build(url) {
        return Err(Failure::new(code::CONFIG, message));
    }
    distlock::connect(url).await.map_err(|e| {
        let mut failure = Failure::lock("cannot connect to the lock server", &e);
        if e.kind() == ErrorKind::Config {
            if let Some(hint) = help::tls_hint(&failure.message) {
                failure.message.push_str(hint);
            }
        }
        failure
    })
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
/// the stop margin defaults to a third of the lease (the TTL, or a shorter
/// max hold time), the kill grace to half the stop margin, and the grace
/// must fit inside the margin.
fn run_options(args: &RunArgs) -> Result<(LockOptions, Duration), Failure> {
    let lease = args.max_hold.map_or(args.ttl, |max| args.ttl.min(max));
    let margin = args.stop_margin.unwrap_or(lease / 3);
    let kill_grace = args.kill_grace.unwrap_or(margin / 2);
    if kill_grace >= margin {
        return Err(Failure::new(
            code::USAGE,
            format!(
                "--kill-grace {} does not fit in the stop margin {}: CMD could outlive the lock; use a shorter --kill-grace, or a longer --stop-margin (which must stay below the lease: --ttl, or a shorter --max-hold)",
                format_duration(kill_grace),
                format_duration(margin)
            ),
        ));
    }
    let mut options = LockOptions::new(args.ttl)
        .with_wait(args.wait)
        .with_stop_margin(margin);
    if let Some(min) = args.hold_at_least {
        options = options.with_hold_at_least(min);
    }
    if let Some(max) = args.max_hold {
        options = options.with_max_hold(max);
    }
    match args.permits {
        0 => {
            return Err(Failure::new(
                code::USAGE,
                "--permits 0 can never run anything; use at least 1",
            ))
        }
        1 => {}
        n => options = options.with_permits(n),
    }
    options.validate().map_err(|e| {
        Failure::new(
            code::USAGE,
            format!("{} do not fit together: {e}", given_durations(args, margin)),
        )
    })?;
    Ok((options, kill_grace))
}

/// `--ttl 30s, --max-hold 5s and --stop-margin 10s`: the flags that make
/// up the lease and its stop moment, as given or defaulted.
fn given_durations(args: &RunArgs, margin: Duration) -> String {
    let mut flags = vec![format!("--ttl {}", format_duration(args.ttl))];
    if let Some(max) = args.max_hold {
        flags.push(format!("--max-hold {}", format_duration(max)));
    }
    match args.stop_margin {
        Some(margin) => flags.push(format!("--stop-margin {}", format_duration(margin))),
        None => flags.push(format!(
            "the default --stop-margin {}",
            format_duration(margin)
        )),
    }
    let last = flags.pop().unwrap_or_default();
    format!("{} and {last}", flags.join(", "))
}

/// The signals `run` handles itself: SIGINT and SIGTERM end the wait, and
/// are forwarded to CMD's group once it runs; SIGTSTP (Ctrl-Z) is refused,
/// since a stopped distlock renews nothing (CMD would be stopped at the
/// stop moment by the watchdog). Installed before anything is sent, so no
/// signal between connecting and running is lost or acted on by default.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
    suspend: Signal,
}

impl Signals {
    fn install() -> Result<Self, Failure> {
        let install = |kind: SignalKind, name: &str| {
            signal(kind)
                .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot handle {name}: {e}")))
        };
        Ok(Self {
            interrupt: install(SignalKind::interrupt(), "SIGINT")?,
            terminate: install(SignalKind::terminate(), "SIGTERM")?,
            suspend: install(SignalKind::from_raw(libc::SIGTSTP), "SIGTSTP")?,
        })
    }

    /// The next SIGINT or SIGTERM; a SIGTSTP meanwhile gets a note on
    /// stderr and nothing else. Cancel-safe.
    async fn next(&mut self) -> libc::c_int {
        loop {
            tokio::select! {
                _ = self.interrupt.recv() => return libc::SIGINT,
                _ = self.terminate.recv() => return libc::SIGTERM,
                _ = self.suspend.recv() => warning!(
                    "ignoring SIGTSTP (Ctrl-Z): a stopped distlock could not renew its lock; end it with SIGINT (Ctrl-C) or SIGTERM instead"
                ),
            }
        }
    }
}

/// The exit code for death by `signal` (128+N).
fn signal_code(signal: libc::c_int) -> u8 {
    u8::try_from(128 + signal).unwrap_or(code::SOFTWARE)
}

/// How often `run` passes the guard's stop moment on to the watchdog: a
/// small part of the time to the first stop moment, so a renewal reaches
/// the watchdog long before the stop moment it replaces.
fn forward_period(stop_moment: Instant) -> Duration {
    (stop_moment.saturating_duration_since(Instant::now()) / 20)
        .clamp(Duration::from_millis(5), Duration::from_millis(100))
}

async fn run(args: RunArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let what = display_command(&args.command);
    let (options, kill_grace) = run_options(&args)?;
    let mut signals = Signals::install()?;

    let backend = tokio::select! {
        backend = connect(&args.url.url) => backend.map_err(|e| e.not_running(&what))?,
        signal = signals.next() => return Ok(signal_code(signal)),
    };
    if args.permits > 1 && backend.semaphore().is_none() {
        return Err(Failure::new(
            code::CONFIG,
            format!(
                "--permits {} needs a backend with semaphores, and the {} backend has none; drop --permits to run under the lock itself",
                args.permits,
                backend.name()
            ),
        ));
    }
    let mut options = options;
    if !args.wait.is_zero() && args.permits == 1 {
        let started = Instant::now();
        tokio::select! {
            () = announce_wait(&backend, &key, args.wait) => {}
            signal = signals.next() => return Ok(signal_code(signal)),
        }
        // --wait bounds the whole wait, the look included.
        options = options.with_wait(args.wait.saturating_sub(started.elapsed()));
    }
    let locker = Locker::new(backend);

    // A signal ends the wait at once, even with an attempt in flight: the
    // client then settles that attempt beside it (one more attempt with its
    // owner token, released at once), so a lock it took is given back
    // without waiting for its reply. Wait a little for that give-back (the
    // runtime is shut down right after); the attempt itself may stay
    // unanswered far longer (a Redis WAIT for a missing replica).
    let mut stopped_by = None;
    let acquired = locker
        .acquire_unless(&key, &options, async {
            stopped_by = Some(signals.next().await);
        })
        .await;
    if let Some(signal) = stopped_by {
        let give_back = kill_grace.min(GIVE_BACK_WAIT);
        if tokio::time::timeout(give_back, locker.client().idle())
            .await
            .is_err()
        {
            warning!(
                key = key.as_str(),
                "an acquire attempt for {key:?} was still unanswered {} after the signal; a lock it still takes is held by nobody until its TTL ({}) runs out",
                format_duration(give_back),
                format_duration(options.ttl()),
            );
        }
        return Ok(signal_code(signal));
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
                note!(
                    key = key.as_str(),
                    permits = args.permits,
                    exit_code = args.conflict_exit_code,
                    "all {} permits of {key:?} are held by other processes{waited}; not running `{what}`",
                    args.permits
                );
            } else {
                note!(
                    key = key.as_str(),
                    exit_code = args.conflict_exit_code,
                    "lock {key:?} is held by another process{waited}; not running `{what}`"
                );
            }
            return Ok(args.conflict_exit_code);
        }
        Err(e) => {
            return Err(
                Failure::lock(&format!("cannot acquire lock {key:?}"), &e).not_running(&what)
            )
        }
    };
    let fencing = guard.fencing_token();

    let (program, program_args) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::new(code::USAGE, "no command given after `--`"))?;
    // The group CMD joins. The watchdog stops it at the stop moment unless
    // told of a renewal first, and at once if distlock dies; it is armed
    // before CMD starts.
    let mut watchdog = match Watchdog::spawn(kill_grace) {
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
    if let Err(e) = watchdog.arm(guard.stop_moment()).await {
        watchdog.stop_group().await;
        let _ = guard.release().await;
        return Err(Failure::new(
            code::SOFTWARE,
            format!("cannot arm the watchdog process that stops `{what}` in time: {e}"),
        ));
    }
    let group = watchdog.group();
    let mut command = tokio::process::Command::new(program);
    command
        .args(program_args)
        .env("DISTLOCK_FENCING_TOKEN", fencing.to_string())
        .env("DISTLOCK_KEY", key.as_str())
        .process_group(group);
    if args.pass_url {
        command.env("DISTLOCK_URL", &args.url.url);
    } else {
        // It may hold the server's password.
        command.env_remove("DISTLOCK_URL");
    }
    let mut child = match command.spawn() {
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
    let mut forward = tokio::time::interval(forward_period(guard.stop_moment()));
    forward.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    let lost_while_running = |reason: &dyn std::fmt::Display| {
        format!("lost lock {key:?} (fencing token {fencing}) while `{what}` was running: {reason}")
    };
    // Ok: CMD exited by itself. Err: why it must be stopped.
    let ended = loop {
        tokio::select! {
            biased;
            reason = &mut lost => break Err(lost_while_running(&reason)),
            status = child.wait() => {
                // Past the stop moment the watchdog has signalled CMD (or is
                // about to): CMD was stopped, whatever it exited with.
                if guard.is_lost() || watchdog.armed_until().is_some_and(|at| Instant::now() >= at) {
                    break Err(lost_while_running(
                        &"no renewal was confirmed by the stop moment, so the watchdog stopped it",
                    ));
                }
                break Ok(status);
            }
            _ = forward.tick() => {
                // After each confirmed renewal the guard's stop moment moves
                // on: re-arm the watchdog's timer with it.
                if let Err(e) = watchdog.arm(guard.stop_moment()).await {
                    break Err(format!(
                        "the watchdog process of `{what}` is gone ({e}): nothing would stop it in time if distlock could not"
                    ));
                }
            }
            signal = signals.next() => signal_group(group, signal),
        }
    };
    let status = match ended {
        Ok(status) => status,
        Err(why) => {
            failure!(
                key = key.as_str(),
                fencing = %fencing,
                command = what.as_str(),
                exit_code = code::SOFTWARE,
                "{why}; stopping its process group with SIGTERM ({} before SIGKILL)",
                format_duration(kill_grace)
            );
            signal_group(group, libc::SIGTERM);
            // Killed by the watchdog, which keeps the same grace, or by us.
            let killed = match tokio::time::timeout(kill_grace, child.wait()).await {
                Ok(Ok(status)) => {
                    std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGKILL)
                }
                Ok(Err(_)) => false,
                Err(_) => true,
            };
            if killed {
                warning!(
                    key = key.as_str(),
                    command = what.as_str(),
                    "`{what}` did not exit within {} of SIGTERM; its group gets SIGKILL",
                    format_duration(kill_grace)
                );
            }
            // Also whatever the command left behind in its group.
            watchdog.stop_group().await;
            let _ = child.wait().await;
            // Frees the key before its TTL if the server still had it.
            let _ = guard.release().await;
            // The line above said why.
            return Ok(code::SOFTWARE);
        }
    };
    // Nothing of CMD runs on once the lock is released.
    watchdog.stop_group().await;
    let status = status
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot wait for `{what}`: {e}")))?;
    if let Err(e) = guard.release().await {
        warning!(
            key = key.as_str(),
            fencing = %fencing,
            "releasing lock {key:?} after `{what}` finished failed ({}); it expires after its TTL",
            e
        );
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

/// What `status` found at a key.
struct Seen {
    held: bool,
    /// The holder's, when the backend says (not through a probe).
    fencing_token: Option<FencingToken>,
    /// Time left on the holder's lease by the server's clock, if known.
    expires_in: Option<Duration>,
}

/// Reads `key`: the backend's inspect call, or, on a backend without
/// operator calls, a probe.
async fn look(backend: &LockClient, key: &LockKey) -> Result<Seen, Failure> {
    if backend.admin().is_none() {
        // An attempt tells held or free (and uses up one fencing token
        // value if free).
        return Ok(match probe(backend, key).await? {
            AcquireAttempt::Acquired(_) => Seen {
                held: false,
                fencing_token: None,
                expires_in: None,
            },
            AcquireAttempt::Held { expires_in } => Seen {
                held: true,
                fencing_token: None,
                expires_in,
            },
        });
    }
    let state = backend
        .inspect(key)
        .await
        .map_err(|e| Failure::lock(&format!("cannot inspect lock {key:?}"), &e))?;
    Ok(match state {
        LockState::Held {
            expires_in,
            fencing_token,
        } => Seen {
            held: true,
            fencing_token: Some(fencing_token),
            expires_in,
        },
        _ => Seen {
            held: false,
            fencing_token: None,
            expires_in: None,
        },
    })
}

/// `(fencing token 7, lease ends in 4.2s unless renewed)`: what is known
/// of a holder.
fn describe_holder(fencing_token: Option<FencingToken>, expires_in: Option<Duration>) -> String {
    let mut parts = Vec::new();
    if let Some(token) = fencing_token {
        parts.push(format!("fencing token {token}"));
    }
    match expires_in {
        Some(left) => parts.push(format!(
            "lease expires in {} unless its holder renews it",
            format_duration(left)
        )),
        None => parts.push("the server did not say for how long".to_owned()),
    }
    format!("({})", parts.join(", "))
}

/// Before `run` waits for a lock: if it is held now, one line saying so
/// and how long distlock will wait. A read (the backend's inspect call),
/// nothing is taken; on a backend without it, or if the read fails (the
/// attempts will report that), no line.
async fn announce_wait(backend: &LockClient, key: &LockKey, wait: Duration) {
    if backend.admin().is_none() {
        return;
    }
    match backend.inspect(key).await {
        Ok(LockState::Held {
            expires_in,
            fencing_token,
        }) => note!(
            key = key.as_str(),
            holder_fencing = %fencing_token,
            expires_in_ms = expires_in.map(millis),
            wait_ms = millis(wait),
            "lock {key:?} is held {}; waiting up to {} for it",
            describe_holder(Some(fencing_token), expires_in),
            format_duration(wait)
        ),
        Ok(_) => {}
        Err(e) => tracing::debug!(
            target: crate::log::TARGET,
            key = key.as_str(),
            error = %e,
            "cannot read lock {key:?} before waiting for it"
        ),
    }
}

/// Milliseconds for JSON (saturating; a lease is never that long).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

async fn status(url: UrlArg, key: &str, json: bool) -> Result<u8, Failure> {
    let key = lock_key(key)?;
    let backend = connect(&url.url).await?;
    let seen = look(&backend, &key).await?;
    if json {
        // The field names are documented (status --help, README) and stable.
        let object = serde_json::json!({
            "key": key.as_str(),
            "held": seen.held,
            "fencing_token": seen.fencing_token.map(|token| token.get()),
            "expires_in_ms": seen.expires_in.map(millis),
            "backend": backend.name(),
        });
        println!("{object}");
    } else if seen.held {
        println!(
            "{key}: held {}",
            describe_holder(seen.fencing_token, seen.expires_in)
        );
    } else {
        println!("{key}: free");
    }
    Ok(if seen.held { code::TEMPFAIL } else { code::OK })
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
