//! Runs the real `distlock` binary: in-process checks against memory://, and
//! cross-process scenarios against real Redis, etcd and PostgreSQL servers
//! started by the conformance harness on 127.0.0.1 (a server that cannot be
//! started fails the test).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use distlock_conformance::server::{Etcd, Postgres, Redis, ServerHandle, ServerKind};

/// Generous bound on how long anything may take before the test is declared
/// hung (a hang guard, not a timing assertion).
const HANG: Duration = Duration::from_secs(90);

fn distlock() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env_remove("DISTLOCK_URL");
    command
}

fn unique(prefix: &str) -> String {
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
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(unique("distlock-cli-test"));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn wait_for_file(path: &Path) {
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

/// Waits for `child` to exit (hang guard only) and collects its output.
fn finish(mut child: Child) -> Output {
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

fn code(output: &Output) -> i32 {
    output.status.code().unwrap_or_else(|| {
        panic!(
            "distlock itself died of a signal: {:?}; stderr: {}",
            output.status,
            stderr(output)
        )
    })
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn signal(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits");
    // SAFETY: plain kill(2) on a process this test started.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(rc, 0, "kill({pid}, {signal}) failed");
}

/// `distlock run --url URL --key KEY EXTRA... -- sh -c SCRIPT`, with `$DIR`
/// set for the script.
fn run_sh(url: &str, key: &str, extra: &[&str], dir: &Path, script: &str) -> Command {
    let mut command = distlock();
    command
        .args(["run", "--url", url, "--key", key])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .env("DIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn read_token(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path).expect("token file");
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("DISTLOCK_FENCING_TOKEN was {text:?}"))
}

// ---------------------------------------------------------------------------
// Without a server.
// ---------------------------------------------------------------------------

#[test]
fn help_has_examples() {
    let output = distlock().arg("--help").output().expect("run");
    assert_eq!(code(&output), 0);
    let text = stdout(&output);
    assert!(text.contains("Examples:"), "{text}");
    assert!(text.contains("distlock run --url"), "{text}");
    let output = distlock().args(["run", "--help"]).output().expect("run");
    assert_eq!(code(&output), 0);
    assert!(stdout(&output).contains("--conflict-exit-code"));
}

#[test]
fn usage_errors_exit_64() {
    // No URL and no DISTLOCK_URL.
    let output = distlock()
        .args(["run", "--key", "k", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    // No command.
    let output = distlock()
        .args(["run", "--url", "memory://", "--key", "k"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    // Bad duration.
    let output = distlock()
        .args([
            "run",
            "--url",
            "memory://",
            "--key",
            "k",
            "--ttl",
            "5x",
            "--",
            "true",
        ])
        .output()
        .expect("run");
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("unknown unit"),
        "{}",
        stderr(&output)
    );
    // Empty key.
    let output = distlock()
        .args(["run", "--url", "memory://", "--key", "", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 64, "{}", stderr(&output));
}

#[test]
fn bad_url_is_a_config_error() {
    let output = distlock()
        .args([
            "run",
            "--url",
            "zookeeper://127.0.0.1:1",
            "--key",
            "k",
            "--",
            "true",
        ])
        .output()
        .expect("run");
    assert_eq!(code(&output), 78, "{}", stderr(&output));
    let err = stderr(&output);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("zookeeper"), "{err}");
}

#[test]
fn unreachable_server_is_unavailable() {
    let port = distlock_conformance::server::free_port().expect("port");
    let url = format!("redis://127.0.0.1:{port}/?connect_timeout_ms=500&operation_timeout_ms=500");
    let output = distlock()
        .args(["run", "--url", &url, "--key", "k", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 69, "{}", stderr(&output));
}

#[test]
fn url_from_environment_and_exit_codes_pass_through() {
    let output = distlock()
        .env("DISTLOCK_URL", "memory://")
        .args(["run", "--key", "k", "--", "sh", "-c", "exit 7"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 7, "{}", stderr(&output));
    let output = distlock()
        .args([
            "run",
            "--url",
            "memory://",
            "--key",
            "k",
            "--",
            "sh",
            "-c",
            "kill -9 $$",
        ])
        .output()
        .expect("run");
    assert_eq!(code(&output), 128 + 9);
    let output = distlock()
        .args([
            "run",
            "--url",
            "memory://",
            "--key",
            "k",
            "--",
            "/nonexistent/command",
        ])
        .output()
        .expect("run");
    assert_eq!(code(&output), 127, "{}", stderr(&output));
}

#[test]
fn fencing_token_is_exported() {
    let output = distlock()
        .args(["run", "--url", "memory://", "--key", "k", "--", "sh", "-c"])
        .arg("echo \"$DISTLOCK_FENCING_TOKEN $DISTLOCK_KEY\"")
        .output()
        .expect("run");
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stdout(&output);
    let mut parts = text.split_whitespace();
    let token: u64 = parts.next().and_then(|t| t.parse().ok()).expect("token");
    assert!(token > 0);
    assert_eq!(parts.next(), Some("k"));
}

#[test]
fn release_needs_force() {
    let output = distlock()
        .args(["release", "--url", "memory://", "k"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    assert!(stderr(&output).contains("--force"));
    // memory:// is per process, so the key is free here.
    let output = distlock()
        .args(["release", "--url", "memory://", "--force", "k"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(stdout(&output).contains("free"));
}

#[test]
fn sigterm_is_forwarded_and_the_lock_released() {
    let dir = TempDir::new();
    let child = run_sh(
        "memory://",
        "k",
        &[],
        dir.path(),
        r#"trap 'echo got > "$DIR/term"; exit 9' TERM; touch "$DIR/started"; while :; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn");
    wait_for_file(&dir.file("started"));
    signal(child.id(), libc::SIGTERM);
    let output = finish(child);
    assert_eq!(code(&output), 9, "{}", stderr(&output));
    assert!(dir.file("term").exists());
}

#[test]
fn lost_lock_stops_the_command_memory() {
    let dir = TempDir::new();
    // max-hold stops renewal, so the lease runs out while the command runs;
    // the command ignores SIGTERM, so it takes the SIGKILL after the grace.
    let output = finish(
        run_sh(
            "memory://",
            "k",
            &[
                "--ttl",
                "300ms",
                "--max-hold",
                "300ms",
                "--kill-grace",
                "50ms",
            ],
            dir.path(),
            r#"trap '' TERM; touch "$DIR/started"; while :; do sleep 0.05; done"#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    let err = stderr(&output);
    assert!(err.contains("lost lock"), "{err}");
    assert!(err.contains("SIGKILL"), "{err}");
    assert!(dir.file("started").exists());
}

/// Whether process `pid` is gone or a zombie (it runs no more code).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
        Err(_) => true,
    }
}

/// The background job of [`GRANDCHILD`] (its pid is in `$DIR/bg`) is gone,
/// and never created `$DIR/X`. Waits for whichever comes first (hang guard
/// only): its death, or the file it writes 2 s after it started.
fn assert_grandchild_stopped(dir: &TempDir) {
    let Ok(pid) = std::fs::read_to_string(dir.file("bg")) else {
        // Stopped before it forked its background job: nothing can write X.
        assert!(!dir.file("X").exists());
        return;
    };
    let pid: u32 = pid.trim().parse().expect("pid in $DIR/bg");
    let deadline = Instant::now() + HANG;
    while !process_gone(pid) && !dir.file("X").exists() {
        assert!(
            Instant::now() < deadline,
            "background job {pid} still running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !dir.file("X").exists(),
        "the command's background job outlived it and wrote X"
    );
    assert!(process_gone(pid), "background job {pid} still running");
}

/// A command that leaves a grandchild (a background subshell) which writes
/// `$DIR/X` 2 s later unless it is stopped; `$DIR/started` once it exists.
const GRANDCHILD: &str =
    r#"(sleep 2; touch "$DIR/X") & echo $! > "$DIR/bg"; touch "$DIR/started"; wait"#;

#[test]
fn lost_lock_stops_the_whole_process_group() {
    let dir = TempDir::new();
    let output = finish(
        run_sh(
            "memory://",
            "k",
            &["--ttl", "1s", "--max-hold", "1s"],
            dir.path(),
            GRANDCHILD,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    assert!(stderr(&output).contains("lost lock"), "{}", stderr(&output));
    assert_grandchild_stopped(&dir);
}

#[test]
fn forwarded_sigterm_stops_the_whole_process_group() {
    let dir = TempDir::new();
    let child = run_sh("memory://", "k", &[], dir.path(), GRANDCHILD)
        .spawn()
        .expect("spawn");
    wait_for_file(&dir.file("started"));
    signal(child.id(), libc::SIGTERM);
    let output = finish(child);
    assert_eq!(code(&output), 128 + libc::SIGTERM, "{}", stderr(&output));
    assert_grandchild_stopped(&dir);
}

#[test]
fn killed_distlock_takes_its_command_along() {
    let dir = TempDir::new();
    let mut child = run_sh("memory://", "k", &[], dir.path(), GRANDCHILD)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    wait_for_file(&dir.file("started"));
    child.kill().expect("SIGKILL distlock");
    child.wait().expect("reap distlock");
    assert_grandchild_stopped(&dir);
}

#[test]
fn leftovers_are_stopped_before_the_lock_is_released() {
    let dir = TempDir::new();
    let output = finish(
        run_sh(
            "memory://",
            "k",
            &[],
            dir.path(),
            r#"(sleep 2; touch "$DIR/X") & echo $! > "$DIR/bg""#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert_grandchild_stopped(&dir);
}

#[test]
fn status_and_release_help_describe_the_commands() {
    let output = distlock().args(["status", "--help"]).output().expect("run");
    assert_eq!(code(&output), 0);
    let text = stdout(&output);
    assert!(!text.contains("no read-only probe"), "{text}");
    assert!(!text.contains("cannot be shown"), "{text}");
    assert!(text.contains("without taking it"), "{text}");
    assert!(text.contains("fencing token"), "{text}");
    let output = distlock()
        .args(["release", "--help"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 0);
    let text = stdout(&output);
    assert!(!text.contains("Not supported"), "{text}");
    assert!(text.contains("whoever holds it"), "{text}");
    assert!(text.contains("next renewal"), "{text}");
}

/// `distlock run --url memory:// --key k OPTIONS... -- true`.
fn run_true(options: &[&str]) -> Output {
    distlock()
        .args(["run", "--url", "memory://", "--key", "k"])
        .args(options)
        .args(["--", "true"])
        .output()
        .expect("run")
}

#[test]
fn huge_durations_are_usage_errors_or_mean_no_limit() {
    let huge = "10000000000000000000";
    // No limit: runs (was a panic, exit 101).
    let output = run_true(&["--max-hold", huge]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    for option in ["--hold-at-least", "--ttl", "--kill-grace", "--stop-margin"] {
        let output = run_true(&[option, huge]);
        assert_eq!(code(&output), 64, "{option} {huge}: {}", stderr(&output));
        assert_eq!(stderr(&output).lines().count(), 1, "{}", stderr(&output));
    }
}

#[test]
fn kill_grace_must_fit_in_the_stop_margin() {
    let output = run_true(&["--ttl", "30s", "--kill-grace", "20s"]);
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    let err = stderr(&output);
    assert!(err.contains("stop margin"), "{err}");
    // A longer margin makes room for it.
    let output = run_true(&[
        "--ttl",
        "30s",
        "--kill-grace",
        "20s",
        "--stop-margin",
        "25s",
    ]);
    assert_eq!(
        code(&output),
        64,
        "renewal every 10s comes after the stop moment: {}",
        stderr(&output)
    );
    let output = run_true(&[
        "--ttl",
        "60s",
        "--kill-grace",
        "10s",
        "--stop-margin",
        "15s",
    ]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
}

// ---------------------------------------------------------------------------
// Against real servers, across processes.
// ---------------------------------------------------------------------------

fn start(kind: impl ServerKind) -> ServerHandle {
    let name = kind.name();
    ServerHandle::from_env_or_start(Arc::new(kind))
        .unwrap_or_else(|e| panic!("cannot start the {name} server: {e}"))
}

fn against(kind: impl ServerKind) {
    let server = start(kind);
    let url = server.url();
    two_concurrent_runs_exactly_one_runs(&url);
    fencing_tokens_increase_across_processes(&url);
    status_reports_held_and_free(&url);
    sigkill_of_holder_frees_key_after_ttl(&url);
    lost_lock_kills_the_command(&url);
    paused_holder_is_taken_over_and_its_command_stopped(&url);
    drop(server);
}

#[test]
fn redis() {
    against(Redis::default());
}

#[test]
fn etcd() {
    against(Etcd);
}

#[test]
fn postgres() {
    against(Postgres);
}

fn two_concurrent_runs_exactly_one_runs(url: &str) {
    let dir = TempDir::new();
    let key = unique("concurrent");
    let script = r#"touch "$DIR/ran.$$"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#;
    let mut a = Some(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn a"),
    );
    let mut b = Some(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn b"),
    );
    // The loser exits on its own; the winner waits for `go`.
    let deadline = Instant::now() + HANG;
    let (loser, winner) = loop {
        assert!(Instant::now() < deadline, "neither run exited");
        if a.as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
            .is_some()
        {
            break (a.take(), b.take());
        }
        if b.as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
            .is_some()
        {
            break (b.take(), a.take());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let loser = finish(loser.expect("loser"));
    assert_eq!(code(&loser), 75, "{}", stderr(&loser));
    let err = stderr(&loser);
    assert!(err.contains("is held"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    std::fs::write(dir.file("go"), "").expect("go");
    let winner = finish(winner.expect("winner"));
    assert_eq!(code(&winner), 0, "{}", stderr(&winner));
    let ran = std::fs::read_dir(dir.path())
        .expect("read dir")
        .filter(|e| {
            e.as_ref()
                .map(|e| e.file_name().to_string_lossy().starts_with("ran."))
                .unwrap_or(false)
        })
        .count();
    assert_eq!(ran, 1, "exactly one command ran");

    // A custom conflict code.
    let holder = run_sh(
        url,
        &key,
        &[],
        dir.path(),
        r#"touch "$DIR/held"; while [ ! -e "$DIR/go2" ]; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn holder");
    wait_for_file(&dir.file("held"));
    let other = finish(
        run_sh(
            url,
            &key,
            &["--conflict-exit-code", "0"],
            dir.path(),
            "exit 3",
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&other), 0, "{}", stderr(&other));
    std::fs::write(dir.file("go2"), "").expect("go2");
    assert_eq!(code(&finish(holder)), 0);
}

fn fencing_tokens_increase_across_processes(url: &str) {
    let dir = TempDir::new();
    let key = unique("fencing");
    let script = r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/token"; exit 5"#;
    let first = finish(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&first), 5, "{}", stderr(&first));
    let t1 = read_token(&dir.file("token"));
    let second = finish(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&second), 5, "{}", stderr(&second));
    let t2 = read_token(&dir.file("token"));
    assert!(t2 > t1, "fencing token went from {t1} to {t2}");
    let died = finish(
        run_sh(url, &key, &[], dir.path(), "kill -TERM $$")
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&died), 128 + libc::SIGTERM, "{}", stderr(&died));
}

fn status_reports_held_and_free(url: &str) {
    let dir = TempDir::new();
    let key = unique("status");
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(stdout(&output).contains("free"), "{}", stdout(&output));

    let holder = run_sh(
        url,
        &key,
        &["--ttl", "2s"],
        dir.path(),
        r#"touch "$DIR/held"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn");
    wait_for_file(&dir.file("held"));
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    assert!(stdout(&output).contains("held"), "{}", stdout(&output));
    assert!(
        stdout(&output).contains("fencing token"),
        "{}",
        stdout(&output)
    );
    let output = distlock()
        .args(["release", "--url", url, "--force", &key])
        .output()
        .expect("run");
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(stdout(&output).contains("released"), "{}", stdout(&output));
    // The holder learns at its next renewal: it stops its command and says so.
    let held = finish(holder);
    assert_eq!(
        code(&held),
        70,
        "holder after a force release: {}",
        stderr(&held)
    );
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(
        code(&output),
        0,
        "released after the command: {}",
        stdout(&output)
    );
}

fn sigkill_of_holder_frees_key_after_ttl(url: &str) {
    let dir = TempDir::new();
    let key = unique("sigkill");
    let mut holder = run_sh(
        url,
        &key,
        &["--ttl", "1s"],
        dir.path(),
        r#"echo $$ > "$DIR/pid"; touch "$DIR/started"; exec sleep 60"#,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("spawn");
    wait_for_file(&dir.file("started"));
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(
        code(&output),
        75,
        "held before the kill: {}",
        stdout(&output)
    );
    holder.kill().expect("SIGKILL the holder");
    holder.wait().expect("reap");
    // Its watchdog kills the orphaned command; nobody renews the lease.
    let pid: u32 = std::fs::read_to_string(dir.file("pid"))
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    let deadline = Instant::now() + HANG;
    while !process_gone(pid) {
        assert!(
            Instant::now() < deadline,
            "the command outlived its killed distlock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let next = finish(
        run_sh(
            url,
            &key,
            &["--wait", "60s"],
            dir.path(),
            r#"touch "$DIR/next""#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    assert!(dir.file("next").exists());
}

fn lost_lock_kills_the_command(url: &str) {
    let dir = TempDir::new();
    let key = unique("lost");
    let output = finish(
        run_sh(
            url,
            &key,
            &["--ttl", "1s", "--max-hold", "1s", "--kill-grace", "200ms"],
            dir.path(),
            r#"trap '' TERM; touch "$DIR/started"; while :; do sleep 0.05; done"#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    let err = stderr(&output);
    assert!(err.contains("lost lock"), "{err}");
    assert!(err.contains("SIGKILL"), "{err}");
    assert!(dir.file("started").exists());
}

fn paused_holder_is_taken_over_and_its_command_stopped(url: &str) {
    let dir = TempDir::new();
    let key = unique("takeover");
    let holder = run_sh(
        url,
        &key,
        &["--ttl", "1s"],
        dir.path(),
        r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/t1"; trap 'touch "$DIR/terminated"; exit 1' TERM; while :; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn");
    wait_for_file(&dir.file("t1"));
    // A stopped distlock cannot renew: its lease runs out and another
    // process takes the key.
    signal(holder.id(), libc::SIGSTOP);
    let next = finish(
        run_sh(
            url,
            &key,
            &["--wait", "60s"],
            dir.path(),
            r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/t2""#,
        )
        .spawn()
        .expect("spawn"),
    );
    signal(holder.id(), libc::SIGCONT);
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    assert!(read_token(&dir.file("t2")) > read_token(&dir.file("t1")));
    // Resumed, the old holder finds its lease gone and stops its command.
    let output = finish(holder);
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    assert!(stderr(&output).contains("lost lock"), "{}", stderr(&output));
    wait_for_file(&dir.file("terminated"));
}
