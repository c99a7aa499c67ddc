//! What distlock says: the waiting line, renewal warnings, the lost line
//! with its reason, `-q`, `-v`, `RUST_LOG`, `--log-format json`, and the
//! help's URL schemes and exit codes (`status --json` is checked against
//! every backend in `servers`).

use std::process::Output;

use distlock::LostReason;
use serde_json::Value;

use crate::support::{code, distlock, finish, run_sh, stderr, stdout, TempDir};

/// Every line of `text` as a JSON object (the test fails on one that is not).
fn json_lines(text: &str) -> Vec<serde_json::Map<String, Value>> {
    text.lines()
        .map(|line| match serde_json::from_str(line) {
            Ok(Value::Object(object)) => object,
            other => panic!("not a JSON object line: {line:?} ({other:?})"),
        })
        .collect()
}

/// `s` of a JSON object field, or "".
fn field<'a>(object: &'a serde_json::Map<String, Value>, name: &str) -> &'a str {
    object.get(name).and_then(Value::as_str).unwrap_or("")
}

#[test]
fn help_lists_every_scheme_and_exit_code() {
    let mut schemes = vec!["memory://"];
    if cfg!(feature = "redis") {
        schemes.extend([
            "redis://",
            "rediss://",
            "redis+sentinel://",
            "rediss+sentinel://",
            "redis+cluster://",
            "rediss+cluster://",
        ]);
    }
    if cfg!(feature = "etcd") {
        schemes.extend(["etcd://", "etcds://"]);
    }
    if cfg!(feature = "postgres") {
        schemes.extend(["postgres://", "postgresql://"]);
    }
    for args in [&["--help"][..], &["run", "--help"]] {
        let output = distlock().args(args).output().expect("run");
        assert_eq!(code(&output), 0, "{}", stderr(&output));
        let text = stdout(&output);
        for scheme in &schemes {
            assert!(text.contains(scheme), "{args:?} lacks {scheme}: {text}");
        }
        let (_, codes) = text
            .split_once("Exit codes:")
            .unwrap_or_else(|| panic!("{args:?} has no exit-code table: {text}"));
        for exit in [
            "0", "N", "128+N", "64", "69", "70", "75", "78", "126", "127",
        ] {
            assert!(
                codes
                    .lines()
                    .any(|line| line.split_whitespace().next() == Some(exit)),
                "{args:?}: no line for exit code {exit}: {codes}"
            );
        }
    }
}

/// `distlock run --url memory:// --key k FLAGS... -- true`, with `env`.
fn run_true(flags: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = distlock();
    command
        .args(["run", "--url", "memory://", "--key", "k"])
        .args(flags)
        .args(["--", "true"]);
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run")
}

/// A run that simply succeeds says nothing (cron mails any output); -v
/// and RUST_LOG say more; -q beats RUST_LOG.
#[test]
fn a_successful_run_is_silent_unless_asked() {
    let output = run_true(&[], &[]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert_eq!(stderr(&output), "", "a plain run prints nothing");

    let output = run_true(&["-v"], &[]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.lines().any(|line| line.starts_with("distlock: info: ")),
        "-v shows the library's info events: {err:?}"
    );
    assert!(!err.contains("debug"), "-v is not -vv: {err}");

    let output = run_true(&[], &[("RUST_LOG", "distlock_core=debug")]);
    let err = stderr(&output);
    assert!(
        err.lines()
            .any(|line| line.starts_with("distlock: debug: ")),
        "RUST_LOG replaces the default levels: {err:?}"
    );

    let output = run_true(&["-q"], &[("RUST_LOG", "trace")]);
    assert_eq!(stderr(&output), "", "-q beats RUST_LOG");

    let output = run_true(&[], &[("RUST_LOG", "=[")]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains("ignoring RUST_LOG") && err.lines().count() == 1,
        "a RUST_LOG that does not parse is named once and ignored: {err:?}"
    );
}

/// `--ttl 300ms --max-hold 300ms` over a command that ignores SIGTERM: the
/// lease runs out while it runs (memory://, max-hold stops renewal), and
/// distlock exits 70.
fn lose_the_lock(flags: &[&str]) -> Output {
    let dir = TempDir::new("distlock-cli-output");
    let mut args = vec![
        "--ttl",
        "300ms",
        "--max-hold",
        "300ms",
        "--kill-grace",
        "50ms",
    ];
    args.extend(flags);
    let output = finish(
        run_sh(
            "memory://",
            "k",
            &args,
            dir.path(),
            r#"trap '' TERM; echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/token"; while :; do sleep 0.05; done"#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    assert!(dir.file("token").exists(), "the command ran");
    output
}

/// The reasons a lost line may give for a lease that ran out: the guard's
/// (it saw the stop moment pass) or the watchdog's (it stopped the
/// command at that moment and distlock noticed that first).
fn ran_out(line: &str) -> bool {
    line.contains(&LostReason::Expired.to_string())
        || line.contains("no renewal was confirmed by the stop moment")
}

#[test]
fn the_lost_line_gives_its_reason() {
    let output = lose_the_lock(&[]);
    let err = stderr(&output);
    let lost = err
        .lines()
        .find(|line| line.starts_with("distlock: lost lock \"k\" (fencing token "))
        .unwrap_or_else(|| panic!("no lost line: {err}"));
    assert!(ran_out(lost), "the lost line says why: {lost}");
    assert!(lost.contains("SIGTERM"), "and what it does: {lost}");
    // The command ignores SIGTERM, so it takes the SIGKILL after the grace.
    assert!(
        err.lines()
            .any(|line| line.starts_with("distlock: warning: ") && line.contains("SIGKILL")),
        "{err}"
    );
}

#[test]
fn quiet_keeps_only_the_error() {
    let output = lose_the_lock(&["-q"]);
    let err = stderr(&output);
    assert_eq!(err.lines().count(), 1, "only the lost line: {err}");
    assert!(err.starts_with("distlock: lost lock"), "{err}");
}

#[test]
fn json_log_lines_parse() {
    let output = lose_the_lock(&["--log-format", "json"]);
    let lines = json_lines(&stderr(&output));
    for line in &lines {
        for name in ["timestamp", "level", "target", "message"] {
            assert!(!field(line, name).is_empty(), "no {name}: {line:?}");
        }
        assert!(
            !line.contains_key("owner") && !line.contains_key("owner_token"),
            "never the owner token: {line:?}"
        );
    }
    let lost = lines
        .iter()
        .find(|line| field(line, "target") == "distlock_cli" && field(line, "level") == "ERROR")
        .unwrap_or_else(|| panic!("no error line of distlock's own: {lines:?}"));
    assert_eq!(field(lost, "key"), "k", "{lost:?}");
    assert!(
        field(lost, "fencing").parse::<u64>().is_ok(),
        "the fencing token: {lost:?}"
    );
    assert!(ran_out(field(lost, "message")), "{lost:?}");
    assert_eq!(lost.get("exit_code").and_then(Value::as_u64), Some(70));
    // The library's own event of the loss, with its reason, for machines.
    assert!(
        lines
            .iter()
            .any(|line| field(line, "target").starts_with("distlock_core")
                && field(line, "level") == "WARN"
                && field(line, "key") == "k"
                && !field(line, "reason").is_empty()),
        "the library's lost event: {lines:?}"
    );
}

/// Against Redis: the waiting line (key, holder's fencing token, the wait),
/// then the skip line; with -q nothing; as JSON the same facts as fields.
#[cfg(feature = "redis")]
#[test]
fn a_wait_starts_with_a_line_naming_the_holder() {
    use crate::support::{read_token, start, unique_name, wait_for_file};
    let server = start(distlock_conformance::server::Redis::default());
    let url = server.url();
    let dir = TempDir::new("distlock-cli-output");
    let key = unique_name("waiting");
    let holder = run_sh(
        &url,
        &key,
        &[],
        dir.path(),
        r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/t"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn the holder");
    wait_for_file(&dir.file("t"));
    let token = read_token(&dir.file("t"));
    // The holder keeps the lock until `go`, written after the waiters gave up.
    let waiter = |flags: &[&str]| {
        let mut args = vec!["--wait", "1500ms"];
        args.extend(flags);
        finish(
            run_sh(&url, &key, &args, dir.path(), r#"touch "$DIR/ran""#)
                .spawn()
                .expect("spawn a waiter"),
        )
    };

    let output = waiter(&[]);
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    let err = stderr(&output);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "the waiting line, then the skip: {err}");
    assert!(
        lines[0].starts_with(&format!(
            "distlock: lock {key:?} is held (fencing token {token}, "
        )) && lines[0].ends_with("; waiting up to 1.5s for it"),
        "{err}"
    );
    assert!(
        lines[1].contains("after waiting 1.5s; not running"),
        "{err}"
    );

    let output = waiter(&["-q"]);
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    assert_eq!(stderr(&output), "", "-q: a skipped run says nothing");

    let output = waiter(&["--log-format", "json"]);
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    let lines = json_lines(&stderr(&output));
    let waiting = lines
        .iter()
        .find(|line| line.contains_key("wait_ms"))
        .unwrap_or_else(|| panic!("no waiting line: {lines:?}"));
    assert_eq!(field(waiting, "key"), key);
    assert_eq!(field(waiting, "holder_fencing"), token.to_string());
    assert_eq!(waiting.get("wait_ms").and_then(Value::as_u64), Some(1500));
    assert_eq!(field(waiting, "level"), "INFO");

    assert!(!dir.file("ran").exists(), "no waiter ran its command");
    std::fs::write(dir.file("go"), "").expect("go");
    let held = finish(holder);
    assert_eq!(code(&held), 0, "{}", stderr(&held));
}

/// Against a Redis that stops answering (SIGSTOP) while the command runs:
/// each failed renewal is a warning, then the lost line gives its reason
/// and distlock exits 70.
#[cfg(feature = "redis")]
#[test]
fn failed_renewals_are_warnings_before_the_lost_line() {
    use crate::support::{start_process, wait_for_file};
    let server = start_process(distlock_conformance::server::Redis::default());
    // Each renewal gives up after 200 ms; the first is due 3 s in, the stop
    // moment 6 s in: a failed renewal is reported well before it.
    let url = format!("{}/?operation_timeout_ms=200", server.url());
    let dir = TempDir::new("distlock-cli-output");
    let holder = run_sh(
        &url,
        "frozen",
        &["--ttl", "9s"],
        dir.path(),
        r#"touch "$DIR/started"; while :; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn");
    wait_for_file(&dir.file("started"));
    server.pause().expect("SIGSTOP redis");
    let output = finish(holder);
    server.resume().expect("SIGCONT redis");
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    let err = stderr(&output);
    let lines: Vec<&str> = err.lines().collect();
    let lost = lines
        .iter()
        .position(|line| line.starts_with("distlock: lost lock \"frozen\""))
        .unwrap_or_else(|| panic!("no lost line: {err}"));
    assert!(ran_out(lines[lost]), "{err}");
    assert!(
        lines[..lost]
            .iter()
            .any(|line| line.starts_with("distlock: warning: ") && line.contains("renewal")),
        "a warning for the failed renewal before the lost line: {err}"
    );
}
