//! A lock server's password never reaches the command's environment
//! (unless asked for) nor any message distlock prints.

use distlock_conformance::server::Redis;

use std::process::Stdio;

use crate::support::{code, distlock, finish, start_process, stderr, stdout, TempDir};

/// Two fragments of a password that must never be printed.
const BEFORE: &str = "Xq7pre";
const AFTER: &str = "Zk9post";

fn assert_no_fragment(text: &str, context: &str) {
    assert!(
        !text.contains(BEFORE) && !text.contains(AFTER),
        "{context} shows part of the password: {text}"
    );
}

/// `distlock run` (with `--url URL`, or `DISTLOCK_URL=URL` in its
/// environment) of a command that writes its environment to `$DIR/env`;
/// what the command saw.
fn environment_of_the_command(url: &str, from_env: bool, extra: &[&str]) -> String {
    let dir = TempDir::new("distlock-cli-secrets");
    let mut command = distlock();
    command.arg("run");
    if from_env {
        command.env("DISTLOCK_URL", url);
    } else {
        command.args(["--url", url]);
    }
    command
        .args(["--key", "secret-job"])
        .args(extra)
        .args(["--", "sh", "-c", r#"env > "$DIR/env""#])
        .env("DIR", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let output = finish(command.spawn().expect("spawn"));
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    // Only what distlock set or passed on (the rest is this machine's).
    std::fs::read_to_string(dir.file("env"))
        .expect("the command ran")
        .lines()
        .filter(|line| {
            line.starts_with("DISTLOCK_") || line.contains(BEFORE) || line.contains(AFTER)
        })
        .map(|line| format!("{line}\n"))
        .collect()
}

#[test]
fn the_command_does_not_inherit_the_url_unless_asked() {
    for from_env in [true, false] {
        let env = environment_of_the_command("memory://", from_env, &[]);
        assert!(!env.contains("DISTLOCK_URL"), "{env}");
    }
    let env = environment_of_the_command("memory://", true, &["--pass-url"]);
    assert!(env.contains("DISTLOCK_URL=memory://\n"), "{env}");
}

#[test]
fn help_does_not_show_the_url_from_the_environment() {
    let url = format!("redis://user:{BEFORE}/{AFTER}@127.0.0.1:1");
    for args in [
        &["run", "--help"][..],
        &["status", "--help"],
        &["release", "--help"],
    ] {
        let output = distlock()
            .env("DISTLOCK_URL", &url)
            .args(args)
            .output()
            .expect("run");
        assert_eq!(code(&output), 0, "{}", stderr(&output));
        assert_no_fragment(&stdout(&output), &format!("{args:?}"));
        assert!(
            stdout(&output).contains("DISTLOCK_URL"),
            "{}",
            stdout(&output)
        );
    }
}

/// Passwords with the characters that end a URL's parts (`/`, `?`, `#`)
/// or separate its credentials (`@`, `:`), not percent-encoded, for every
/// scheme, given with --url or in DISTLOCK_URL, to `run` and `status`:
/// whatever the error, no part of the password is printed.
#[test]
fn errors_never_show_a_password_fragment() {
    let port = distlock_conformance::server::free_port().expect("port");
    let mut leaks = Vec::new();
    for scheme in ["redis", "rediss", "etcd", "postgres"] {
        for special in ['/', '?', '@', '#', ':'] {
            let url = format!(
                "{scheme}://user:{BEFORE}{special}{AFTER}@127.0.0.1:{port}/?connect_timeout_ms=300"
            );
            let run = distlock()
                .args(["run", "--url", &url, "--key", "k", "--", "true"])
                .output()
                .expect("run");
            let status = distlock()
                .env("DISTLOCK_URL", &url)
                .args(["status", "k"])
                .output()
                .expect("run");
            for (how, output) in [
                ("distlock run --url", run),
                ("DISTLOCK_URL= distlock status", status),
            ] {
                assert_ne!(code(&output), 0, "{how} {url}");
                let printed = format!("{}{}", stdout(&output), stderr(&output));
                if printed.contains(BEFORE) || printed.contains(AFTER) {
                    leaks.push(format!("{how} {url}: {}", printed.trim()));
                }
            }
        }
    }
    assert!(
        leaks.is_empty(),
        "{} messages show part of the password:\n{}",
        leaks.len(),
        leaks.join("\n")
    );
}

/// Against a Redis that requires a password: the command runs without the
/// URL (or with it, given --pass-url), and a wrong password (with a `/`,
/// percent-encoded as it must be) is a configuration error that does not
/// show it.
#[test]
fn a_real_password_stays_out_of_the_command_and_the_messages() {
    let password = format!("{BEFORE}-{AFTER}");
    let server = start_process(Redis::with_password(password.clone()));
    let url = server.url();
    assert!(url.contains(&password), "{url}");
    let env = environment_of_the_command(&url, true, &[]);
    assert_no_fragment(&env, "the command's environment");
    let env = environment_of_the_command(&url, true, &["--pass-url"]);
    assert!(env.contains(&format!("DISTLOCK_URL={url}\n")), "{env}");
    let wrong = format!(
        "redis://:{BEFORE}%2F{AFTER}x@{}/?connect_timeout_ms=2000",
        server.addr()
    );
    let output = distlock()
        .args(["run", "--url", &wrong, "--key", "secret-job", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(code(&output), 78, "{}", stderr(&output));
    assert_no_fragment(&stderr(&output), "a refused password");
}
