//! The command line: the commands and their flags, and the help texts
//! built at run time.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::app::code;
use crate::duration::parse_duration;
use crate::help;
use crate::log::LogArgs;

/// Run a command under a distributed lock, so a cron line on many hosts runs
/// the job on only one of them at a time.
#[derive(Debug, Parser)]
#[command(name = "distlock", version)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) log: LogArgs,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
    /// The holder's label (`run --id`, `elect --id`) is shown when the
    /// backend stores one.
    ///
    /// With --json, one JSON object on stdout: {"key": "nightly-report",
    /// "held": true, "fencing_token": 42, "expires_in_ms": 27000,
    /// "holder": "web-1:4242", "backend": "redis"} (fencing_token,
    /// expires_in_ms and holder are null when free or unknown). These field
    /// names are stable; new ones may be added.
    ///
    /// With --semaphore, KEY names a semaphore (`run --permits N`): each
    /// live permit is shown, oldest first, with its fencing token, its
    /// holder's label (`run --id`) and its time left; exit 0 while a permit
    /// is free, 75 when all are held. With --json: {"key": "exports",
    /// "semaphore": true, "limit": 3, "held": 2, "permits":
    /// [{"fencing_token": 42, "expires_in_ms": 27000, "holder":
    /// "web-1:4242"}, ...], "backend": "redis"} (limit null when no permit
    /// is held, holder null when none was given). Needs a backend that
    /// lists permits (memory, Redis, etcd, PostgreSQL).
    Status(StatusArgs),
    /// Same as `status --json`: KEY's state as one JSON object on stdout
    /// (exit 0 free, 75 held).
    Inspect(InspectArgs),
    /// Campaign for leadership of KEY, then run CMD while leading.
    ///
    /// Candidates of the same KEY (on any host) take turns: one leads and
    /// runs CMD, the others wait until it is gone (resigned, or crashed and
    /// its TTL run out), however long, or up to --wait. A leadership is the
    /// lock KEY labelled with --id, so everything `run --help` says about
    /// CMD holds here too: its own process group, the watchdog, signal
    /// forwarding, and the stop before expiry: if leadership is lost, CMD's
    /// group gets SIGTERM, then SIGKILL --kill-grace later, and distlock
    /// exits 70. When CMD exits, distlock resigns (the next candidate takes
    /// over at once) and exits with CMD's code. CMD gets the term (greater
    /// than every earlier leader's) in DISTLOCK_FENCING_TOKEN, and KEY in
    /// DISTLOCK_KEY. A SIGINT/SIGTERM while campaigning ends the campaign
    /// (exit 128+N).
    Elect(ElectArgs),
    /// Follow who leads KEY: one line on stdout per change, until SIGINT or
    /// SIGTERM (exit 0).
    ///
    /// Lines: `term=<N> leader=<ID>` while a candidate leads (ID is the
    /// rest of the line, its --id label, or `-` if it stored none), and
    /// `vacant` while nobody does. The first line comes at once (the
    /// current state); terms only grow, so a stale read never goes back to
    /// an earlier leader. A quick change between two reads may be skipped
    /// (each line is a state, not every transition). Errors from the server
    /// are reported on stderr and observing goes on (retried with backoff);
    /// a bad URL or KEY, or a backend without operator calls, ends it with
    /// the usual exit code. With --json, one JSON object a line instead.
    Observe(ObserveArgs),
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
pub(crate) struct UrlArg {
    /// The lock server, e.g. redis://127.0.0.1:6379, etcd://127.0.0.1:2379,
    /// postgres://user:pass@127.0.0.1/db. Give a URL with a password in
    /// DISTLOCK_URL rather than --url: other local users can read command
    /// lines.
    // Never shown in --help: the value may hold a password.
    #[arg(long, env = "DISTLOCK_URL", hide_env_values = true, value_name = "URL")]
    pub(crate) url: String,
}

/// `--id`: the holder label stored with the lock, shown by `status`.
#[derive(Debug, Args)]
pub(crate) struct IdArg {
    /// The label stored with the lock (the leadership, for `elect`) so
    /// that `status` and `observe` show who holds it: a host name, pod or
    /// instance name. Not proof of anything: only this process can renew or
    /// release its lock. At most 128 bytes, no control characters. Default:
    /// <host name>:<pid>.
    #[arg(long = "id", value_name = "NAME")]
    pub(crate) id: Option<String>,
}

/// The lease and how CMD is stopped when it ends: shared by `run` and
/// `elect`.
#[derive(Debug, Args)]
pub(crate) struct LeaseArgs {
    /// Lease time to live; renewed every third of it while CMD runs. A
    /// crashed distlock frees the key after at most this long.
    #[arg(long, default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) ttl: Duration,
    /// Stop renewing after this long: a hung CMD loses the lock (and is
    /// stopped, --stop-margin before the lock ends) instead of holding it
    /// forever.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) max_hold: Option<Duration>,
    /// How long before the earliest moment the server may expire an
    /// unrenewed lease CMD is stopped (SIGTERM). Default: a third of the
    /// lease, which is --ttl or a shorter --max-hold (10s of the default
    /// 30s).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) stop_margin: Option<Duration>,
    /// How long CMD has to exit after SIGTERM before its group gets SIGKILL
    /// when the lock is lost. Must be shorter than --stop-margin. Default:
    /// half the stop margin (5s with the default TTL).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) kill_grace: Option<Duration>,
}

/// CMD and what it is given: shared by `run` and `elect`.
#[derive(Debug, Args)]
pub(crate) struct CommandArgs {
    /// Pass the lock server's URL, password included, to CMD in
    /// DISTLOCK_URL (without it CMD does not get DISTLOCK_URL at all).
    #[arg(long)]
    pub(crate) pass_url: bool,
    /// The command and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "CMD")]
    pub(crate) command: Vec<OsString>,
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) url: UrlArg,
    /// The lock name, shared by every host running the same job.
    #[arg(long, value_name = "KEY")]
    pub(crate) key: String,
    #[command(flatten)]
    pub(crate) id: IdArg,
    #[command(flatten)]
    pub(crate) lease: LeaseArgs,
    /// How long to wait for a held lock before giving up (0s: skip at once).
    #[arg(long, default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) wait: Duration,
    /// Keep the lock this long after acquiring even if CMD finishes sooner,
    /// so hosts whose cron fires a little late skip the same run.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) hold_at_least: Option<Duration>,
    /// Run under one of N permits of the key's semaphore instead of the
    /// lock: at most N commands run at once across all hosts (1: the
    /// lock). A semaphore's name space is its own: `--permits 3 --key x`
    /// and `--key x` do not exclude each other.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub(crate) permits: u32,
    /// Exit code when the lock (or every permit) is held elsewhere.
    #[arg(long, default_value_t = code::TEMPFAIL, value_name = "N")]
    pub(crate) conflict_exit_code: u8,
    #[command(flatten)]
    pub(crate) command: CommandArgs,
}

#[derive(Debug, Args)]
pub(crate) struct ElectArgs {
    #[command(flatten)]
    pub(crate) url: UrlArg,
    #[command(flatten)]
    pub(crate) id: IdArg,
    #[command(flatten)]
    pub(crate) lease: LeaseArgs,
    /// Give up campaigning after this long (exit with --conflict-exit-code,
    /// CMD not run). Default: campaign as long as it takes.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) wait: Option<Duration>,
    /// Exit code when another candidate still leads at the end of --wait.
    #[arg(long, default_value_t = code::TEMPFAIL, value_name = "N")]
    pub(crate) conflict_exit_code: u8,
    /// The election's name, shared by every candidate (a lock key: do not
    /// also use it with `run`).
    #[arg(value_name = "KEY")]
    pub(crate) key: String,
    #[command(flatten)]
    pub(crate) command: CommandArgs,
}

#[derive(Debug, Args)]
pub(crate) struct ObserveArgs {
    #[command(flatten)]
    pub(crate) url: UrlArg,
    /// Print one JSON object a line instead: {"term": 7, "leader":
    /// "web-1:4242"}, {"term": 7, "leader": null} (no label), or
    /// {"term": null, "leader": null} (vacant).
    #[arg(long)]
    pub(crate) json: bool,
    /// Read who leads at least this often (on backends that notify changes,
    /// memory and etcd, a safety net; elsewhere the delay of a change
    /// other than an expiry).
    #[arg(long, default_value = "1s", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) poll_interval: Duration,
    /// The election's name.
    #[arg(value_name = "KEY")]
    pub(crate) key: String,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) url: UrlArg,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub(crate) json: bool,
    /// KEY is a semaphore (`run --permits`): show its live permits.
    #[arg(long)]
    pub(crate) semaphore: bool,
    /// The lock name.
    #[arg(value_name = "KEY")]
    pub(crate) key: String,
}

#[derive(Debug, Args)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    pub(crate) url: UrlArg,
    /// KEY is a semaphore (`run --permits`): show its live permits.
    #[arg(long)]
    pub(crate) semaphore: bool,
    /// The lock name.
    #[arg(value_name = "KEY")]
    pub(crate) key: String,
}

#[derive(Debug, Args)]
pub(crate) struct ReleaseArgs {
    #[command(flatten)]
    pub(crate) url: UrlArg,
    /// Confirm that you mean to clear a lock someone else may hold.
    #[arg(long)]
    pub(crate) force: bool,
    /// The lock name.
    #[arg(value_name = "KEY")]
    pub(crate) key: String,
}

/// Parses the arguments, with the help texts that are built at run time
/// (the URL schemes of this build).
pub(crate) fn parse() -> Result<Cli, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};
    let after_help = help::after_help();
    let command = Cli::command()
        .after_help(after_help.clone())
        .mut_subcommand("run", |run| run.after_help(after_help.clone()))
        .mut_subcommand("elect", |elect| elect.after_help(after_help));
    Cli::from_arg_matches(&command.try_get_matches()?)
}
