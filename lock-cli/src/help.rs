//! The text after `--help`: examples, the exit codes, and the URL schemes
//! this build opens (the facade's `BACKENDS`: each backend crate's own
//! descriptor).

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
  distlock status --json migrate

  # One scheduler among all hosts: the others stand by and take over when
  # its host dies (after --ttl); follow who leads.
  distlock elect --url etcd://127.0.0.1:2379 --id \"$(hostname)\" --ttl 10s scheduler -- ./scheduler
  distlock observe --url etcd://127.0.0.1:2379 scheduler";

/// The exit codes, one a line (the README has the same table).
pub const EXIT_CODES: &str = "\
Exit codes:
  0      done: run's (elect's) command exited 0; status: the key is free;
         observe: ended by SIGINT/SIGTERM
  N      run, elect: the command's own exit code, passed through
  128+N  run, elect: the command died of signal N, or distlock got
         SIGINT/SIGTERM (N) before the command started (it did not run)
  64     usage: a bad flag, duration, key or --id, or flags that do not fit
         together
  69     the lock server is unavailable (unreachable, or it did not answer
         in time); not retried: the command did not run (observe retries)
  70     run, elect: the lock (leadership) was lost while the command ran (it
         was stopped), or an internal failure
  75     the lock is held elsewhere: run skipped the command, elect still was
         not leading after --wait (--conflict-exit-code changes the code);
         status: the key is held
  78     configuration: a bad URL, a scheme not in this build, --permits on a
         backend without semaphores, data at the key that distlock did not
         write, observe on a backend without operator calls
  126    run, elect: the command could not be executed (not executable, ...)
  127    run, elect: the command was not found";

/// The backend features of this CLI (each brings the facade's feature of
/// the same name), whether or not this build has them: the backends
/// themselves, their names and schemes, are [`distlock::BACKENDS`].
const BACKEND_FEATURES: &[&str] = &["redis", "etcd", "postgres"];

/// The `memory://` backend's line: it is always there, and not for real
/// use.
const MEMORY_NOTE: &str = "in this process only (to try distlock out; nothing is shared)";

/// `scheme://, scheme://` for a backend's schemes.
fn urls(schemes: &[&str]) -> String {
    let list: Vec<String> = schemes.iter().map(|s| format!("{s}://")).collect();
    list.join(", ")
}

/// The URL schemes this build opens, and the backends it was built without.
fn schemes() -> String {
    let mut text = String::from("URL schemes:");
    for backend in distlock::BACKENDS {
        let descriptor = &backend.descriptor;
        let urls = urls(descriptor.schemes());
        match backend.feature {
            None => text.push_str(&format!("\n  {urls}  {MEMORY_NOTE}")),
            Some(_) => text.push_str(&format!("\n  {urls}  ({})", descriptor.name())),
        }
    }
    if cfg!(feature = "tls") {
        text.push_str("\n  TLS (rediss…://, etcds://, PostgreSQL sslmode=) is in this build.");
    } else {
        text.push_str(
            "\n  TLS (rediss…://, etcds://, PostgreSQL sslmode=) is not in this build (feature `tls`).",
        );
    }
    let missing = left_out();
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
    BACKEND_FEATURES
        .iter()
        .copied()
        .filter(|feature| {
            !distlock::BACKENDS
                .iter()
                .any(|backend| backend.feature == Some(*feature))
        })
        .collect()
}

/// For a URL whose scheme no backend of this build opens, while the build
/// leaves some backend out: the message to give instead of the library's
/// (which tells a Cargo.toml how to enable a feature).
pub fn not_in_this_build(url: &str) -> Option<String> {
    let (scheme, _) = url.split_once("://")?;
    let missing = left_out();
    if missing.is_empty()
        || distlock::BACKENDS
            .iter()
            .any(|backend| backend.descriptor.opens(scheme))
    {
        return None;
    }
    let opens: Vec<String> = distlock::BACKENDS
        .iter()
        .map(|backend| urls(backend.descriptor.schemes()))
        .collect();
    Some(format!(
        "{}:// is not a URL scheme this build of distlock opens ({}); it was built without {}: `cargo install distlock-cli` builds every backend{}",
        scheme.to_ascii_lowercase(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend the facade brings by a feature this list lacks would
    /// never be named as left out.
    #[test]
    fn every_backend_feature_of_the_facade_is_listed() {
        for backend in distlock::BACKENDS {
            if let Some(feature) = backend.feature {
                assert!(BACKEND_FEATURES.contains(&feature), "{feature}");
                assert!(!left_out().contains(&feature), "{feature}");
            }
        }
    }

    #[test]
    fn the_help_lists_each_backend_by_its_descriptor() {
        let text = schemes();
        for backend in distlock::BACKENDS {
            let line = text
                .lines()
                .find(|line| line.contains(&urls(backend.descriptor.schemes())));
            assert!(line.is_some(), "{:?}: {text}", backend.descriptor);
        }
    }
}
