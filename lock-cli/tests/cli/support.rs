//! What the CLI tests share: the binary, bounded runs, temporary
//! directories, signals, process states and servers.
// A build without some backend leaves some of these unused.
#![cfg_attr(
    not(all(feature = "redis", feature = "etcd", feature = "postgres")),
    allow(dead_code)
)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::server::{ServerHandle, ServerKind, ServerProcess};

/// Generous bound on how long one `distlock` (or anything a test waits for)
/// may take before the test is declared hung: a hang guard, not a timing
/// assertion.
pub const HANG: Duration = Duration::from_secs(120);

/// The `distlock` binary, without `DISTLOCK_URL` or `RUST_LOG` from the
/// environment (a test sets them itself).
pub fn distlock() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env_remove("DISTLOCK_URL").env_remove("RUST_LOG");
    command
}

/// A name no other test (or test run) uses.
pub use distlock_conformance::naming::unique_name;

/// A fresh temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits until `path` exists (hang guard [`HANG`]).
pub fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + HANG;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit (hang guard [`HANG`]) and collects its output.
pub fn finish(child: Child) -> Output {
    finish_within(child, HANG)
}

/// Waits up to `limit` for `child` to exit (else kills it and fails the
/// test) and collects its output.
pub fn finish_within(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait().expect("try_wait") {
            Some(_) => return child.wait_with_output().expect("output"),
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("distlock did not exit within {limit:?}");
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Runs `command` to its end (stdin empty, output collected, hang guard
/// [`HANG`]).
pub fn run_to_end(mut command: Command) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn distlock");
    finish(child)
}

/// The exit code (distlock itself never dies of a signal in these tests).
pub fn code(output: &Output) -> i32 {
    output.status.code().unwrap_or_else(|| {
        panic!(
            "distlock itself died of a signal: {:?}; stderr: {}",
            output.status,
            stderr(output)
        )
    })
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Sends `signal` to process `pid` (one this test started).
pub fn signal(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits");
    // SAFETY: plain kill(2) on a process this test started.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(rc, 0, "kill({pid}, {signal}) failed");
}

/// The state letter of process `pid` (`R`, `S`, `T`, `Z`...), or `None`
/// once it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state is the first field after the parenthesised name.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|state| state.chars().next())
}

/// Whether process `pid` is gone or a zombie (it runs no more code).
pub fn process_gone(pid: u32) -> bool {
    matches!(process_state(pid), None | Some('Z') | Some('X'))
}

/// `distlock run --url URL --key KEY EXTRA... -- sh -c SCRIPT`, with `$DIR`
/// set for the script, stdin empty and output piped.
pub fn run_sh(url: &str, key: &str, extra: &[&str], dir: &Path, script: &str) -> Command {
    sh_under(&["run", "--url", url, "--key", key], extra, dir, script)
}

/// `distlock elect --url URL KEY EXTRA... -- sh -c SCRIPT`, as [`run_sh`].
pub fn elect_sh(url: &str, key: &str, extra: &[&str], dir: &Path, script: &str) -> Command {
    sh_under(&["elect", "--url", url, key], extra, dir, script)
}

/// `distlock HEAD... EXTRA... -- sh -c SCRIPT`, with `$DIR` set for the
/// script, stdin empty and output piped.
fn sh_under(head: &[&str], extra: &[&str], dir: &Path, script: &str) -> Command {
    let mut command = distlock();
    command
        .args(head)
        .args(extra)
        .args(["--", "sh", "-c", script])
        .env("DIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A fencing token a script wrote into `path`.
pub fn read_token(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path).expect("token file");
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("DISTLOCK_FENCING_TOKEN was {text:?}"))
}

/// A server of `kind`: the one its URL variable names, else one started
/// on loopback.
pub fn start(kind: impl ServerKind) -> ServerHandle {
    let name = kind.name();
    ServerHandle::from_env_or_start(Arc::new(kind))
        .unwrap_or_else(|e| panic!("cannot start the {name} server: {e}"))
}

/// A server of `kind` started on loopback for this test alone.
pub fn start_process(kind: impl ServerKind) -> ServerProcess {
    let name = kind.name();
    ServerProcess::start(Arc::new(kind))
        .unwrap_or_else(|e| panic!("cannot start the {name} server: {e}"))
}

/// One Redis command over a plain connection to `addr` (no password), its
/// reply as text: a status, an integer, or a bulk string.
pub fn redis_command(addr: &str, args: &[&str]) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect to the test Redis");
    stream.set_read_timeout(Some(HANG)).expect("read timeout");
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream.write_all(request.as_bytes()).expect("send");
    let mut reply = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).expect("read the reply");
        assert!(n > 0, "Redis closed the connection: {reply:?}");
        reply.extend_from_slice(&chunk[..n]);
        if let Some(text) = complete_reply(&reply) {
            return text;
        }
    }
}

/// The text of a complete RESP reply in `reply`, or `None` if more is due.
fn complete_reply(reply: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(reply);
    let (head, rest) = text.split_once("\r\n")?;
    match head.as_bytes().first() {
        Some(b'+' | b':') => Some(head[1..].to_owned()),
        Some(b'-') => panic!("Redis error: {head}"),
        Some(b'$') => {
            let len: usize = head[1..].parse().expect("bulk length");
            (rest.len() >= len + 2).then(|| rest[..len].to_owned())
        }
        _ => panic!("unexpected Redis reply {text:?}"),
    }
}
