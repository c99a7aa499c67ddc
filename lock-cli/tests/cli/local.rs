//! The binary without a server: usage, exit codes, signals and process
//! groups, against memory:// (one process only).

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use crate::support::{
    code, distlock, finish, process_gone, run_sh, signal, stderr, stdout, wait_for_file, TempDir,
    HANG,
};

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

/// `distlock run --url URL --key k -- true` must fail with one line and
/// exit 78 (configuration); that line.
fn config_error_for(url: &str) -> String {
    let output = distlock()
        .args(["run", "--url", url, "--key", "k", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 78, "{}", stderr(&output));
    let err = stderr(&output);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    err
}

#[test]
fn bad_url_is_a_config_error() {
    let err = config_error_for("zookeeper://127.0.0.1:1");
    assert!(err.contains("zookeeper"), "{err}");
}

/// A build without etcd (what installs without protoc) says which schemes
/// it opens and how to get the one it left out, not the library's advice
/// for a Cargo.toml.
#[cfg(not(feature = "etcd"))]
#[test]
fn a_backend_left_out_of_the_build_is_named() {
    let err = config_error_for("etcd://127.0.0.1:2379");
    assert!(
        err.contains("etcd:// is not a URL scheme this build of distlock opens"),
        "{err}"
    );
    assert!(err.contains("cargo install distlock-cli"), "{err}");
    assert!(!err.contains("Cargo.toml"), "{err}");
    let output = distlock().arg("--help").output().expect("run");
    assert!(
        stdout(&output).contains("Not in this build: etcd"),
        "{}",
        stdout(&output)
    );
}

/// An unreachable server: exit 69 at once, so the message must not promise
/// a retry, and it says the command did not run.
#[cfg(feature = "redis")]
#[test]
fn unreachable_server_is_unavailable() {
    let port = distlock_conformance::server::free_port().expect("port");
    let url = format!("redis://127.0.0.1:{port}/?connect_timeout_ms=500&operation_timeout_ms=500");
    let output = distlock()
        .args(["run", "--url", &url, "--key", "k", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 69, "{}", stderr(&output));
    let err = stderr(&output);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(!err.contains("retried"), "nothing is retried: {err}");
    assert!(err.contains("not running `true`"), "{err}");
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
    let dir = TempDir::new("distlock-cli-test");
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
    let dir = TempDir::new("distlock-cli-test");
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
    let dir = TempDir::new("distlock-cli-test");
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
    let dir = TempDir::new("distlock-cli-test");
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
    let dir = TempDir::new("distlock-cli-test");
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

#[test]
fn the_default_stop_margin_follows_a_max_hold_shorter_than_the_ttl() {
    // The lease is 5 s (max hold) of the default 30 s TTL: the default stop
    // margin is a third of the lease, not of --ttl.
    let output = run_true(&["--max-hold", "5s"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let output = run_true(&["--max-hold", "5s", "--kill-grace", "1s"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    // A margin the user set that does not fit names the flags to change.
    let output = run_true(&["--max-hold", "5s", "--stop-margin", "10s"]);
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    let err = stderr(&output);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("--stop-margin 10"), "{err}");
    assert!(err.contains("--max-hold 5"), "{err}");
}

#[test]
fn renewals_rearm_the_watchdog() {
    // The first stop moment is about 1.3 s in; the command runs 5 s, across
    // several renewals. Had the watchdog not been told of them, it would
    // have stopped the command at the first stop moment.
    let dir = TempDir::new("distlock-cli-test");
    let output = finish(
        run_sh(
            "memory://",
            "k",
            &["--ttl", "2s"],
            dir.path(),
            r#"sleep 5; touch "$DIR/done""#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(dir.file("done").exists(), "the command ran to its end");
}
