//! `distlock`: run a command under a distributed lock (Redis, etcd,
//! PostgreSQL), so the same cron line on every host runs the job once.
//!
//! Exit codes follow sysexits(3) (the table is in `--help` and the README):
//! 64 usage, 69 unavailable, 70 internal or lock lost, 75 lock held
//! (conflict, configurable), 78 configuration (also an operation the
//! backend does not have, such as `--permits` without semaphores, and data
//! distlock did not write at the lock key); `run` otherwise passes the
//! command's exit code through (128+N when it died of signal N, or when
//! distlock got SIGINT/SIGTERM before it started; 126/127 when it could not
//! be started).
//!
//! Unix only: the command runs in a process group of its own, which
//! distlock and its watchdog signal (SIGTERM, SIGKILL) to stop it in time.

#[cfg(not(unix))]
compile_error!(
    "the distlock command runs Unix only: it starts the command in a process group of its own \
     and stops it with Unix signals (SIGTERM, then SIGKILL) before the lock can expire, which \
     Windows has no equivalent for; on Windows use the distlock library, or the command under WSL"
);

#[cfg(unix)]
mod admin;
#[cfg(unix)]
mod app;
#[cfg(unix)]
mod args;
#[cfg(unix)]
mod duration;
#[cfg(unix)]
mod elect;
#[cfg(unix)]
mod help;
#[cfg(unix)]
mod log;
#[cfg(unix)]
mod run;
#[cfg(unix)]
mod watchdog;

#[cfg(unix)]
fn main() -> std::process::ExitCode {
    app::main()
}

#[cfg(not(unix))]
fn main() {}
