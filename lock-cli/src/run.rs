//! `run`: take the lock (waiting if asked), run the command under it with
//! the watchdog, forward signals, and release. The command's supervision
//! ([`supervise`]) is also `elect`'s, under a leadership.

use std::ffi::OsString;
use std::time::{Duration, Instant};

use distlock::{
    Leadership, LockClient, LockError, LockGuard, LockKey, LockOptions, LockState, Locker,
};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::admin::{describe_holder, millis};
use crate::app::{code, connect, holder_id, lock_key, Failure};
use crate::args::{CommandArgs, LeaseArgs, RunArgs};
use crate::duration::format_duration;
use crate::log::{failure, note, warning};
use crate::watchdog::{signal_group, Watchdog};

/// How long a signal that ended the wait waits, at most, for the give-back
/// of what an attempt in flight took (one settling attempt and a release;
/// also bounded by the kill grace).
const GIVE_BACK_WAIT: Duration = Duration::from_secs(10);

pub(crate) fn display_command(command: &[OsString]) -> String {
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

/// The lease part of the lock options (TTL, stop margin, max hold) and
/// the kill grace, checked before connecting: the stop margin defaults to
/// a third of the lease (the TTL, or a shorter max hold time), the kill
/// grace to half the stop margin, and the grace must fit inside the
/// margin. Also returns the margin, for [`checked`].
pub(crate) fn lease_options(
    lease: &LeaseArgs,
) -> Result<(LockOptions, Duration, Duration), Failure> {
    let held_for = lease.max_hold.map_or(lease.ttl, |max| lease.ttl.min(max));
    let margin = lease.stop_margin.unwrap_or(held_for / 3);
    let kill_grace = lease.kill_grace.unwrap_or(margin / 2);
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
    let mut options = LockOptions::new(lease.ttl).with_stop_margin(margin);
    if let Some(max) = lease.max_hold {
        options = options.with_max_hold(max);
    }
    Ok((options, margin, kill_grace))
}

/// `options` once they are complete, validated; a usage failure names the
/// flags that do not fit.
pub(crate) fn checked(
    options: LockOptions,
    lease: &LeaseArgs,
    margin: Duration,
) -> Result<LockOptions, Failure> {
    options.validate().map_err(|e| {
        Failure::new(
            code::USAGE,
            format!(
                "{} do not fit together: {e}",
                given_durations(lease, margin)
            ),
        )
    })?;
    Ok(options)
}

/// The lock options of `run` and the kill grace (see [`lease_options`]).
fn run_options(args: &RunArgs) -> Result<(LockOptions, Duration), Failure> {
    let (mut options, margin, kill_grace) = lease_options(&args.lease)?;
    options = options
        .with_wait(args.wait)
        .with_holder(holder_id(&args.id)?);
    if let Some(min) = args.hold_at_least {
        options = options.with_hold_at_least(min);
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
    Ok((checked(options, &args.lease, margin)?, kill_grace))
}

/// `--ttl 30s, --max-hold 5s and --stop-margin 10s`: the flags that make
/// up the lease and its stop moment, as given or defaulted.
fn given_durations(lease: &LeaseArgs, margin: Duration) -> String {
    let mut flags = vec![format!("--ttl {}", format_duration(lease.ttl))];
    if let Some(max) = lease.max_hold {
        flags.push(format!("--max-hold {}", format_duration(max)));
    }
    match lease.stop_margin {
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
pub(crate) struct Signals {
    interrupt: Signal,
    terminate: Signal,
    suspend: Signal,
}

impl Signals {
    pub(crate) fn install() -> Result<Self, Failure> {
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
    pub(crate) async fn next(&mut self) -> libc::c_int {
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
pub(crate) fn signal_code(signal: libc::c_int) -> u8 {
    u8::try_from(128 + signal).unwrap_or(code::SOFTWARE)
}

/// How often `run` passes the guard's stop moment on to the watchdog: a
/// small part of the time to the first stop moment, so a renewal reaches
/// the watchdog long before the stop moment it replaces.
fn forward_period(stop_moment: Instant) -> Duration {
    (stop_moment.saturating_duration_since(Instant::now()) / 20)
        .clamp(Duration::from_millis(5), Duration::from_millis(100))
}

pub(crate) async fn run(args: RunArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let what = display_command(&args.command.command);
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
            () = announce_wait(&backend, &key, "lock", Some(args.wait)) => {}
            signal = signals.next() => return Ok(signal_code(signal)),
        }
        // --wait bounds the whole wait, the look included.
        options = options.with_wait(args.wait.saturating_sub(started.elapsed()));
    }
    let locker = Locker::new(backend);

    // A signal ends the wait at once, even with an attempt in flight: the
    // client then settles that attempt beside it (one more attempt with its
    // owner token, released at once), so a lock it took is given back
    // without waiting for its reply.
    let mut stopped_by = None;
    let acquired = locker
        .acquire_unless(&key, &options, async {
            stopped_by = Some(signals.next().await);
        })
        .await;
    if let Some(signal) = stopped_by {
        give_back(&locker, &key, kill_grace, options.ttl()).await;
        return Ok(signal_code(signal));
    }
    let guard = match acquired {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            let waited = waited(args.wait);
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
        Err(e) => return Err(Failure::lock("cannot acquire the lock", &e).not_running(&what)),
    };
    supervise(
        Holding::Lock(guard),
        &args.command,
        &args.url.url,
        kill_grace,
        &mut signals,
    )
    .await
}

/// ` after waiting 1.5s` (nothing for no wait): for the line of a skip.
pub(crate) fn waited(wait: Duration) -> String {
    if wait.is_zero() {
        String::new()
    } else {
        format!(" after waiting {}", format_duration(wait))
    }
}

/// After a signal ended a wait: waits a little for the client to give back
/// what an attempt in flight took (the runtime is shut down right after);
/// the attempt itself may stay unanswered far longer (a Redis WAIT for a
/// missing replica), which gets a warning.
pub(crate) async fn give_back(locker: &Locker, key: &LockKey, kill_grace: Duration, ttl: Duration) {
    let give_back = kill_grace.min(GIVE_BACK_WAIT);
    if tokio::time::timeout(give_back, locker.client().idle())
        .await
        .is_err()
    {
        warning!(
            key = key.as_str(),
            "an acquire attempt for {key:?} was still unanswered {} after the signal; a lock it still takes is held by nobody until its TTL ({}) runs out",
            format_duration(give_back),
            format_duration(ttl),
        );
    }
}

/// What CMD runs under: `run`'s lock (or permit), or `elect`'s leadership.
pub(crate) enum Holding {
    Lock(LockGuard),
    Leadership(Leadership),
}

impl Holding {
    fn guard(&self) -> &LockGuard {
        match self {
            Self::Lock(guard) => guard,
            Self::Leadership(leadership) => leadership.guard(),
        }
    }

    /// `lock "k" (fencing token 7)`, `leadership of "k" (term 7)`: for
    /// the lines about it.
    fn describe(&self) -> String {
        let guard = self.guard();
        let key = guard.key();
        match self {
            Self::Lock(_) => format!("lock {key:?} (fencing token {})", guard.fencing_token()),
            Self::Leadership(_) => {
                format!("leadership of {key:?} (term {})", guard.fencing_token())
            }
        }
    }

    /// Releases the lock (honouring --hold-at-least), or resigns.
    async fn release(self) -> Result<(), LockError> {
        match self {
            Self::Lock(guard) => guard.release().await,
            Self::Leadership(leadership) => leadership.resign().await,
        }
    }
}

/// Runs CMD under `holding` with the watchdog, forwards `signals` to its
/// group, stops the group if `holding` is lost (SIGTERM, SIGKILL
/// `kill_grace` later), and releases `holding` once nothing of CMD runs.
/// CMD's exit code, 70 if it was stopped for a loss.
pub(crate) async fn supervise(
    holding: Holding,
    args: &CommandArgs,
    url: &str,
    kill_grace: Duration,
    signals: &mut Signals,
) -> Result<u8, Failure> {
    let guard = holding.guard();
    let key = guard.key();
    let fencing = guard.fencing_token();
    let what = display_command(&args.command);

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
            let _ = holding.release().await;
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
        let _ = holding.release().await;
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
        command.env("DISTLOCK_URL", url);
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
            let _ = holding.release().await;
            return Err(Failure::new(code, format!("cannot run `{what}`: {e}")));
        }
    };
    let lost = guard.lost();
    tokio::pin!(lost);
    let mut forward = tokio::time::interval(forward_period(guard.stop_moment()));
    forward.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    let held = holding.describe();
    let lost_while_running = |reason: &dyn std::fmt::Display| {
        format!("lost {held} while `{what}` was running: {reason}")
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
            let _ = holding.release().await;
            // The line above said why.
            return Ok(code::SOFTWARE);
        }
    };
    // Nothing of CMD runs on once the lock is released.
    watchdog.stop_group().await;
    let status = status
        .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot wait for `{what}`: {e}")))?;
    if let Err(e) = holding.release().await {
        warning!(
            key = key.as_str(),
            fencing = %fencing,
            "releasing {held} after `{what}` finished failed ({e}); it expires after its TTL",
        );
    }
    Ok(exit_code_of(status))
}

/// Before `run` waits for a lock (or `elect` campaigns): if it is held
/// now, one line saying so (`lock "k" is held (...)`, `leadership of "k"
/// is held (...)`, as `what` says) and how long distlock will wait (`None`:
/// as long as it takes). A read (the backend's inspect call), nothing is
/// taken; on a backend without it, or if the read fails (the attempts
/// will report that), no line.
pub(crate) async fn announce_wait(
    backend: &LockClient,
    key: &LockKey,
    what: &str,
    wait: Option<Duration>,
) {
    if backend.admin().is_none() {
        return;
    }
    let how_long = match wait {
        Some(wait) => format!("waiting up to {} for it", format_duration(wait)),
        None => "waiting for it as long as it takes".to_owned(),
    };
    match backend.inspect(key).await {
        Ok(LockState::Held {
            expires_in,
            fencing_token,
            holder,
        }) => note!(
            key = key.as_str(),
            holder_fencing = %fencing_token,
            holder = holder.as_ref().map(|id| id.as_str()),
            expires_in_ms = expires_in.map(millis),
            wait_ms = wait.map(millis),
            "{what} {key:?} is held {}; {how_long}",
            describe_holder(Some(fencing_token), holder.as_ref(), expires_in),
        ),
        Ok(_) => {}
        Err(e) => tracing::debug!(
            target: crate::log::TARGET,
            key = key.as_str(),
            error = %e,
            "cannot read {what} {key:?} before waiting for it"
        ),
    }
}
