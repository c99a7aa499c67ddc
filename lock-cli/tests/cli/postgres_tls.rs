//! The real `distlock` binary against a `hostssl`-only PostgreSQL over TLS.

use std::process::Stdio;
use std::time::Duration;

use distlock_conformance::server::PostgresTls;

use crate::support::{distlock, finish_within, run_to_end, start_process, stderr, TempDir};

#[test]
fn run_against_a_hostssl_only_postgres() {
    let kind = PostgresTls::new().expect("generate the test PKI");
    let server = start_process(kind.clone());
    let dir = TempDir::new("distlock-cli-pg-tls");
    // libpq's parameters, as in a managed PostgreSQL's connection string.
    let url = kind.url_with_ca(server.addr(), &kind.pki().ca);
    assert!(url.contains("sslmode=verify-full&sslrootcert="), "{url}");
    let token = dir.path().join("token");
    let mut run = distlock();
    run.args(["run", "--url", &url, "--key", "tls-job", "--"])
        .args([
            "sh",
            "-c",
            r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/token""#,
        ])
        .env("DIR", dir.path());
    let output = run_to_end(run);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let written = std::fs::read_to_string(&token).expect("the command ran");
    assert!(written.trim().parse::<u64>().is_ok(), "{written:?}");

    // The wrong CA: a clear configuration error (78) at once, not retried
    // until the 60 s wait runs out (the limit is a hang guard below it).
    let wrong = kind.url_with_ca(server.addr(), &kind.pki().other_ca);
    let mut run = distlock();
    run.args([
        "run", "--url", &wrong, "--key", "tls-job", "--wait", "60s", "--", "true",
    ]);
    let child = run
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn distlock");
    let output = finish_within(child, Duration::from_secs(30));
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(78), "{err}");
    assert!(err.contains("TLS certificate problem"), "{err}");
    assert!(err.contains("not trusted"), "{err}");
    assert!(err.contains("sslrootcert"), "{err}");
}
