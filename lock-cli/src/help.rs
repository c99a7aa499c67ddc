//! The text after `--help`: examples, the exit codes, and the URL schemes
//! this build opens (each backend crate's own `SCHEMES`).

const EXAMPLES: &str = "\
Examples:
  # The same crontab line on every host; the report runs on one of them.
  */5 * * * * distlock run --url redis://redis.internal:6379 --key nightly-report -- /usr/local/bin/report

  # Wait up to 2 minutes for the previous run instead of skipping.
  distlock run --url etcd://127.0.0.1:2379 --key backup --wait 2m -- ./backup.sh

  # The URL can come from the environment.
  export DISTLOCK_URL=postgres://locks@db/locks
  distlock run --key migrate --ttl 1m -- ./migrate --apply
  distlock status migrate
  distlock status --json migrate";

/// The exit codes, one a line (the README has the same table).
pub const EXIT_CODES: &str = "\
Exit codes:
  0      done: run's command exited 0; status: the key is free
  N      run: the command's own exit code, passed through
  128+N  run: the command died of signal N, or distlock got SIGINT/SIGTERM
         (N) before the command started (the command did not run)
  64     usage: a bad flag, duration or key, or flags that do not fit together
  69     the lock server is unavailable (unreachable, or it did not answer
         in time); not retried: the command did not run
  70     run: the lock was lost while the command ran (it was stopped), or an
         internal failure
  75     the lock is held elsewhere: run skipped the command (--conflict-exit-code
         changes the code); status: the key is held
  78     configuration: a bad URL, a scheme not in this build, --permits on a
         backend without semaphores, data at the key that distlock did not write
  126    run: the command could not be executed (not executable, ...)
  127    run: the command was not found";

/// One backend of this build: its name and the schemes it opens.
struct Backend {
    name: &'static str,
    feature: &'static str,
    schemes: Option<&'static [&'static str]>,
}

fn backends() -> [Backend; 3] {
    [
        Backend {
            name: "Redis",
            feature: "redis",
            #[cfg(feature = "redis")]
            schemes: Some(distlock::redis::SCHEMES),
            #[cfg(not(feature = "redis"))]
            schemes: None,
        },
        Backend {
            name: "etcd",
            feature: "etcd",
            #[cfg(feature = "etcd")]
            schemes: Some(distlock::etcd::SCHEMES),
            #[cfg(not(feature = "etcd"))]
            schemes: None,
        },
        Backend {
            name: "PostgreSQL",
            feature: "postgres",
            #[cfg(feature = "postgres")]
            schemes: Some(distlock::postgres::SCHEMES),
            #[cfg(not(feature = "postgres"))]
            schemes: None,
        },
    ]
}

/// The URL schemes this build opens, and the backends it was built without.
fn schemes() -> String {
    let mut text = String::from(
        "URL schemes:\n  memory://  in this process only (to try distlock out; nothing is shared)",
    );
    let mut missing = Vec::new();
    for backend in backends() {
        match backend.schemes {
            Some(schemes) => {
                let list: Vec<String> = schemes.iter().map(|s| format!("{s}://")).collect();
                text.push_str(&format!("\n  {}  ({})", list.join(", "), backend.name));
            }
            None => missing.push(backend.feature),
        }
    }
    if cfg!(feature = "tls") {
        text.push_str("\n  TLS (rediss…://, etcds://, PostgreSQL sslmode=) is in this build.");
    } else {
        text.push_str(
            "\n  TLS (rediss…://, etcds://, PostgreSQL sslmode=) is not in this build (feature `tls`).",
        );
    }
    if !missing.is_empty() {
        text.push_str(&format!(
            "\n  Not in this build: {} (`cargo install distlock-cli` builds every backend; etcd needs protoc to build).",
            missing.join(", ")
        ));
    }
    text
}

/// Everything after the options in `--help` (and in `run --help`).
pub fn after_help() -> String {
    format!("{EXAMPLES}\n\n{EXIT_CODES}\n\n{}", schemes())
}

/// The backend features this build leaves out.
fn left_out() -> Vec<&'static str> {
    backends()
        .into_iter()
        .filter(|backend| backend.schemes.is_none())
        .map(|backend| backend.feature)
        .collect()
}

/// For a URL whose scheme no backend of this build opens, while the build
/// leaves some backend out: the message to give instead of the library's
/// (which tells a Cargo.toml how to enable a feature).
pub fn not_in_this_build(url: &str) -> Option<String> {
    let (scheme, _) = url.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    let opened: Vec<&str> = backends()
        .into_iter()
        .filter_map(|backend| backend.schemes)
        .flatten()
        .copied()
        .collect();
    let missing = left_out();
    if scheme == "memory" || opened.contains(&scheme.as_str()) || missing.is_empty() {
        return None;
    }
    let mut opens = vec!["memory://".to_owned()];
    opens.extend(opened.iter().map(|s| format!("{s}://")));
    Some(format!(
        "{scheme}:// is not a URL scheme this build of distlock opens ({}); it was built without {}: `cargo install distlock-cli` builds every backend{}",
        opens.join(", "),
        missing.join(", "),
        if missing.contains(&"etcd") { " (etcd needs protoc to build)" } else { "" }
    ))
}

/// A hint for a configuration error from a build without TLS whose
/// message is about TLS (a `rediss://` URL, `sslmode=`): the library's
/// advice is for a Cargo.toml.
pub fn tls_hint(message: &str) -> Option<&'static str> {
    (!cfg!(feature = "tls") && message.to_ascii_lowercase().contains("tls")).then_some(
        "; this build of distlock has no TLS: build it with the `tls` feature (`cargo install distlock-cli --no-default-features --features redis,postgres,tls` needs no protoc)",
    )
}
