//! The process group CMD runs in, and the watchdog that stops it at the
//! stop moment even when distlock cannot.
//!
//! `distlock run` starts a small watchdog process (itself, re-executed with
//! [`WATCHDOG_ARG`]) in a new process group and starts CMD in that group.
//! The watchdog holds the read end of a pipe whose write end only distlock
//! holds, and enforces two things by itself:
//!
//! - **distlock is gone**: when distlock exits or is killed (even with
//!   SIGKILL), the watchdog reads end-of-file and kills its whole group at
//!   once, CMD's descendants included.
//! - **the stop moment**: a dead man's timer. Before CMD starts, and after
//!   each renewal distlock has confirmed, distlock writes the current stop
//!   moment down the pipe; if the timer runs out before the next one comes,
//!   the watchdog sends SIGTERM to the group, then SIGKILL the kill grace
//!   later. So CMD is stopped before the lease may expire even when
//!   distlock is frozen (SIGSTOP), stopped or starved and renews nothing.
//!
//! The stop moment travels as an absolute `CLOCK_MONOTONIC` time (one clock
//! for every process of the machine), so a message that sits in the pipe
//! while either process is stopped is still right when it is read: it is
//! never a duration that starts counting late.
//!
//! Because the watchdog leads the group, the group id cannot be reused
//! while distlock signals it. It ignores SIGINT, SIGTERM, SIGHUP, SIGQUIT
//! and the job-control stops SIGTSTP, SIGTTIN, SIGTTOU, so signals sent to
//! CMD's group neither end nor stop it; distlock ends it with SIGKILL to
//! the group once CMD is done.

use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;

/// The hidden first argument that turns `distlock` into the watchdog; the
/// second is the kill grace in nanoseconds.
pub const WATCHDOG_ARG: &str = "__distlock-watchdog";

/// One message down the pipe: a stop moment, `CLOCK_MONOTONIC`
/// nanoseconds, little-endian.
const MESSAGE: usize = 8;

/// Signals the watchdog ignores, set between fork and exec so that a
/// signal sent to the group cannot end or stop it before it runs.
const IGNORED: [libc::c_int; 7] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGTSTP,
    libc::SIGTTIN,
    libc::SIGTTOU,
];

/// Now on `CLOCK_MONOTONIC`, in nanoseconds.
fn monotonic_now() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes the timespec we own; CLOCK_MONOTONIC
    // always exists.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now);
    }
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// `at` on `CLOCK_MONOTONIC`, never later than `at`: the clock is read
/// before `Instant::now()`, so a pause between the two readings can only
/// move the result earlier.
fn monotonic_at(at: Instant) -> u64 {
    let base = monotonic_now();
    let left = at.saturating_duration_since(Instant::now());
    base.saturating_add(u64::try_from(left.as_nanos()).unwrap_or(u64::MAX))
}

/// What the watchdog saw on its pipe.
enum Pipe {
    /// A new stop moment (the last one of what was read).
    Deadline(u64),
    /// Nothing complete yet, or interrupted: look again.
    Nothing,
    /// End-of-file or an error: distlock is gone.
    Gone,
}

/// Reads what is ready on stdin (poll said so), keeping a partial message
/// in `pending`.
fn read_pipe(pending: &mut Vec<u8>) -> Pipe {
    let mut buffer = [0u8; 64];
    // SAFETY: read(2) into a buffer we own, at most its length.
    let n = unsafe { libc::read(0, buffer.as_mut_ptr().cast(), buffer.len()) };
    if n == 0 {
        return Pipe::Gone;
    }
    let Ok(n) = usize::try_from(n) else {
        let error = std::io::Error::last_os_error();
        return match error.kind() {
            std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock => Pipe::Nothing,
            _ => Pipe::Gone,
        };
    };
    pending.extend_from_slice(&buffer[..n]);
    let mut last = None;
    while pending.len() >= MESSAGE {
        let mut message = [0u8; MESSAGE];
        message.copy_from_slice(&pending[..MESSAGE]);
        pending.drain(..MESSAGE);
        last = Some(u64::from_le_bytes(message));
    }
    last.map_or(Pipe::Nothing, Pipe::Deadline)
}

/// Waits up to `deadline` (`CLOCK_MONOTONIC` nanoseconds; `None`: no
/// limit) for stdin to become readable. True if it is.
fn wait_readable(deadline: Option<u64>) -> bool {
    let timeout = match deadline {
        None => -1,
        Some(at) => {
            let left = at.saturating_sub(monotonic_now());
            if left == 0 {
                return false;
            }
            // Rounded up: waking early would only mean looking again.
            i32::try_from(left.div_ceil(1_000_000)).unwrap_or(i32::MAX)
        }
    };
    let mut fd = libc::pollfd {
        fd: 0,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one pollfd we own.
    let ready = unsafe { libc::poll(&mut fd, 1, timeout) };
    if ready < 0 {
        // Interrupted: check the deadline again. Any other error: let
        // read(2) report it (as distlock gone).
        return std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted;
    }
    ready > 0
}

/// Kills the watchdog's own process group (which CMD joined), itself
/// included.
fn kill_group() -> ExitCode {
    // SAFETY: kill(2) on our own process group.
    unsafe {
        libc::kill(0, libc::SIGKILL);
    }
    ExitCode::SUCCESS
}

/// Runs as the watchdog: enforces the stop moments distlock sends until
/// distlock is gone (end-of-file on stdin) or a stop moment passes; then
/// stops its own process group, itself included.
pub fn run() -> ExitCode {
    let kill_grace = std::env::args()
        .nth(2)
        .and_then(|nanos| nanos.parse::<u64>().ok())
        .unwrap_or(0);
    let mut pending = Vec::with_capacity(MESSAGE);
    // distlock sends the first stop moment before it starts CMD.
    let mut deadline = None;
    loop {
        if deadline.is_some_and(|at| monotonic_now() >= at) {
            break;
        }
        if !wait_readable(deadline) {
            continue;
        }
        match read_pipe(&mut pending) {
            Pipe::Deadline(at) => deadline = Some(at),
            Pipe::Nothing => {}
            Pipe::Gone => return kill_group(),
        }
    }
    // The stop moment passed without a renewal: the lock must be assumed
    // lost. SIGTERM now (the watchdog ignores it), SIGKILL after the grace,
    // or at once if distlock goes away meanwhile. No later message re-arms
    // the timer: a lease past its stop moment is never used again.
    // SAFETY: kill(2) on our own process group.
    unsafe {
        libc::kill(0, libc::SIGTERM);
    }
    let grace_over = monotonic_now().saturating_add(kill_grace);
    while monotonic_now() < grace_over {
        if wait_readable(Some(grace_over)) {
            if let Pipe::Gone = read_pipe(&mut pending) {
                break;
            }
        }
    }
    kill_group()
}

/// Sends `signal` to every process in group `group`.
pub fn signal_group(group: i32, signal: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals a process group; the
    // group is led by our watchdog, so its id is not reused while we run.
    unsafe {
        libc::kill(-group, signal);
    }
}

/// A running watchdog, leader of the group CMD runs in.
pub struct Watchdog {
    process: tokio::process::Child,
    pipe: Option<tokio::process::ChildStdin>,
    group: i32,
    /// The last stop moment sent.
    armed_until: Option<Instant>,
}

impl Watchdog {
    /// Starts the watchdog in a new process group; once a stop moment
    /// passes it gives the group `kill_grace` between SIGTERM and SIGKILL.
    pub fn spawn(kill_grace: Duration) -> std::io::Result<Self> {
        // /proc/self/exe still runs this binary if its file was replaced.
        let exe = if cfg!(target_os = "linux") {
            std::path::PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe()?
        };
        let mut command = tokio::process::Command::new(exe);
        command
            .arg(WATCHDOG_ARG)
            .arg(kill_grace.as_nanos().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        // SAFETY: only signal(2), which is async-signal-safe, between fork
        // and exec. Ignored signals stay ignored across exec.
        unsafe {
            command.pre_exec(|| {
                for signal in IGNORED {
                    libc::signal(signal, libc::SIG_IGN);
                }
                Ok(())
            });
        }
        let mut process = command.spawn()?;
        let pipe = process.stdin.take();
        let group = process
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .ok_or_else(|| std::io::Error::other("the watchdog exited at once"))?;
        Ok(Self {
            process,
            pipe,
            group,
            armed_until: None,
        })
    }

    /// The process group id for CMD to join.
    pub fn group(&self) -> i32 {
        self.group
    }

    /// The last stop moment the watchdog was given.
    pub fn armed_until(&self) -> Option<Instant> {
        self.armed_until
    }

    /// Tells the watchdog to stop the group at `stop_moment` unless told a
    /// later one first (a no-op if that is the moment it already has).
    pub async fn arm(&mut self, stop_moment: Instant) -> std::io::Result<()> {
        if self.armed_until == Some(stop_moment) {
            return Ok(());
        }
        let pipe = self
            .pipe
            .as_mut()
            .ok_or_else(|| std::io::Error::other("the watchdog's pipe is closed"))?;
        // One write of 8 bytes: atomic on a pipe (at most PIPE_BUF), and
        // the pipe is empty but for earlier messages the watchdog reads as
        // they come, so this does not block.
        pipe.write_all(&monotonic_at(stop_moment).to_le_bytes())
            .await?;
        self.armed_until = Some(stop_moment);
        Ok(())
    }

    /// Kills every process left in the group (SIGKILL), the watchdog
    /// included, and reaps the watchdog.
    pub async fn stop_group(&mut self) {
        signal_group(self.group, libc::SIGKILL);
        let _ = self.process.wait().await;
    }
}
