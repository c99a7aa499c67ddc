//! `distlock run` against a TLS-only Redis: it runs the command
//! given the server's CA, and fails fast with a message about the
//! certificate given the wrong one.

use std::path::Path;
use std::process::Output;
use std::sync::Arc;

use distlock_conformance::server::{RedisTls, ServerProcess, TestPki};

use crate::support::{distlock, run_to_end, TempDir};

/// `distlock run --url URL --key KEY -- touch MARKER`, with `env` set.
fn run(url: &str, key: &str, marker: &Path, env: &[(&str, &Path)]) -> Output {
    let mut command = distlock();
    command
        .args(["run", "--url", url, "--key", key, "--", "touch"])
        .arg(marker);
    for (name, value) in env {
        command.env(name, value);
    }
    run_to_end(command)
}

#[test]
fn run_against_tls_redis_with_its_ca_and_fails_fast_with_the_wrong_one() {
    let dir = TempDir::new("distlock-cli-redis-tls");
    let pki = TestPki::generate(&dir.file("pki")).expect("test certificates");
    let server = ServerProcess::start(Arc::new(RedisTls::new(pki.clone())))
        .expect("cannot start redis-server with TLS");

    // The server's CA: the command runs.
    let ran = dir.file("ran");
    let output = run(&server.url(), "tls-job", &ran, &[]);
    assert!(
        output.status.success(),
        "{:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(ran.exists(), "the command ran");

    // Another CA: exit 78 (configuration), a message about the
    // certificate and what to do, and the command never ran.
    let refused = dir.file("refused");
    let url = format!(
        "rediss://{}/?tls_ca_file={}&connect_timeout_ms=2000",
        server.addr(),
        pki.other_ca.display()
    );
    let output = run(&url, "tls-job", &refused, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("TLS certificate problem") && stderr.contains("tls_ca_file"),
        "{stderr}"
    );
    assert!(!refused.exists(), "the command did not run");

    // tls_ca_file adds to the platform's roots: with the server's CA as the
    // platform's (SSL_CERT_FILE) and another as tls_ca_file, it connects.
    let empty = dir.file("no-more-roots");
    std::fs::create_dir_all(&empty).unwrap();
    let both = dir.file("both");
    let output = run(
        &url,
        "tls-job",
        &both,
        &[("SSL_CERT_FILE", &pki.ca), ("SSL_CERT_DIR", &empty)],
    );
    assert!(
        output.status.success(),
        "{:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(both.exists(), "the command ran");
}
