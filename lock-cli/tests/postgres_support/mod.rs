//! What the PostgreSQL CLI tests share: the binary, bounded runs, a
//! temporary directory, servers.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::server::{ServerKind, ServerProcess};

/// Generous bound on one `distlock` run before the test calls it hung (a
/// hang guard, not a timing assertion).
pub const HANG: Duration = Duration::from_secs(90);

/// The `distlock` binary, without `DISTLOCK_URL` from the environment.
pub fn distlock() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command
        .env_remove("DISTLOCK_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Runs `command` to its end, within `limit`.
pub fn finish(mut command: Command, limit: Duration) -> Output {
    let mut child = command.spawn().expect("spawn distlock");
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait().expect("try_wait") {
            Some(_) => return child.wait_with_output().expect("output"),
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                panic!("distlock did not exit within {limit:?}");
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("{prefix}-{}-{:x}", std::process::id(), rand_u64()));
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

pub fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

pub fn start(kind: impl ServerKind) -> ServerProcess {
    let name = kind.name();
    ServerProcess::start(Arc::new(kind))
        .unwrap_or_else(|e| panic!("cannot start the {name} server: {e}"))
}
