//! What the etcd CLI tests (TLS, cluster) share: running `distlock` and
//! reading how it ended.

// Each test file uses a different subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Generous bound on how long one `distlock` may take before the test is
/// declared hung (a hang guard, not a timing assertion).
pub const HANG: Duration = Duration::from_secs(120);

/// `distlock` with no URL from the environment.
pub fn distlock() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env_remove("DISTLOCK_URL");
    command
}

/// A name no other test (or test run) uses.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A fresh temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `distlock run --url URL --key KEY EXTRA... -- sh -c SCRIPT` with `$DIR`
/// set for the script; its output once it exited.
pub fn run_sh(url: &str, key: &str, extra: &[&str], dir: &Path, script: &str) -> Output {
    let mut command = distlock();
    command
        .args(["run", "--url", url, "--key", key])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .env("DIR", dir);
    finish(command)
}

/// Runs `command` to its end (hang guard [`HANG`]) and collects its output.
pub fn finish(mut command: Command) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn distlock");
    let deadline = Instant::now() + HANG;
    loop {
        match child.try_wait().expect("try_wait") {
            Some(_) => return child.wait_with_output().expect("output"),
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                panic!("distlock did not exit within {HANG:?}");
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The exit code (distlock itself never dies of a signal here).
pub fn code(output: &Output) -> i32 {
    output.status.code().unwrap_or_else(|| {
        panic!(
            "distlock died of a signal: {:?}; stderr: {}",
            output.status,
            stderr(output)
        )
    })
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}
