//! The process group CMD runs in, and the watchdog that kills it if
//! distlock dies.
//!
//! `distlock run` starts a small watchdog process (itself, re-executed with
//! [`WATCHDOG_ARG`]) in a new process group and starts CMD in that group.
//! The watchdog holds the read end of a pipe whose write end only distlock
//! holds: when distlock exits or is killed (even with SIGKILL), the
//! watchdog reads end-of-file and kills its whole group, CMD's descendants
//! included. Because the watchdog leads the group, the group id cannot be
//! reused while distlock signals it. It ignores SIGINT, SIGTERM, SIGHUP and
//! SIGQUIT, so signals forwarded to CMD's group do not end it; distlock
//! ends it with SIGKILL to the group once CMD is done.

use std::io::Read;
use std::process::{ExitCode, Stdio};

/// The hidden first argument that turns `distlock` into the watchdog.
pub const WATCHDOG_ARG: &str = "__distlock-watchdog";

/// Runs as the watchdog: waits for end-of-file on stdin (distlock gone),
/// then kills its own process group, itself included.
pub fn run() -> ExitCode {
    let mut sink = Vec::new();
    // Nothing is ever written; any error also means distlock is gone.
    let _ = std::io::stdin().read_to_end(&mut sink);
    // SAFETY: kill(2) on our own process group, which CMD joined.
    unsafe {
        libc::kill(0, libc::SIGKILL);
    }
    ExitCode::SUCCESS
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
    group: i32,
}

impl Watchdog {
    /// Starts the watchdog in a new process group.
    pub fn spawn() -> std::io::Result<Self> {
        // /proc/self/exe still runs this binary if its file was replaced.
        let exe = if cfg!(target_os = "linux") {
            std::path::PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe()?
        };
        let mut command = tokio::process::Command::new(exe);
        command
            .arg(WATCHDOG_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        // SAFETY: only signal(2), which is async-signal-safe, between fork
        // and exec. Ignored signals stay ignored across exec, so a signal
        // sent to the group cannot end the watchdog before it runs.
        unsafe {
            command.pre_exec(|| {
                for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
                    libc::signal(signal, libc::SIG_IGN);
                }
                Ok(())
            });
        }
        let process = command.spawn()?;
        let group = process
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .ok_or_else(|| std::io::Error::other("the watchdog exited at once"))?;
        Ok(Self { process, group })
    }

    /// The process group id for CMD to join.
    pub fn group(&self) -> i32 {
        self.group
    }

    /// Kills every process left in the group (SIGKILL), the watchdog
    /// included, and reaps the watchdog.
    pub async fn stop_group(&mut self) {
        signal_group(self.group, libc::SIGKILL);
        let _ = self.process.wait().await;
    }
}
