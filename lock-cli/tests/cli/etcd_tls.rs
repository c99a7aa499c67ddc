//! `distlock run` against an etcd that requires mutual TLS:
//! `etcds://...?tls_ca_file=...&tls_cert_file=...&tls_key_file=...` works
//! (a waiter is woken over the TLS watch too), and the wrong CA fails at
//! once with a configuration error that says so.

use std::sync::Arc;

use distlock_conformance::server::{EtcdTls, ServerProcess, TestPki};

use crate::support::{code, run_sh, run_to_end, stderr, unique_name, TempDir};

#[test]
fn run_against_mutual_tls_etcd() {
    let pki_dir = TempDir::new("distlock-cli-etcd-pki");
    let pki = TestPki::generate(pki_dir.path()).expect("test PKI");
    let server = ServerProcess::start(Arc::new(EtcdTls::mutual(&pki))).expect("TLS etcd");
    let url = server.url();
    assert!(
        url.starts_with("etcds://") && url.contains("tls_cert_file="),
        "{url}"
    );
    let dir = Arc::new(TempDir::new("distlock-cli-etcd-tls"));
    let key = unique_name("tls");

    // A holder, and a run that waits for it over the TLS watch.
    let holder = {
        let (url, key, dir) = (url.clone(), key.clone(), dir.clone());
        std::thread::spawn(move || {
            run_to_end(run_sh(
                &url,
                &key,
                &[],
                dir.path(),
                r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/first"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#,
            ))
        })
    };
    while !dir.path().join("first").exists() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let waiter = {
        let (url, key, dir) = (url.clone(), key.clone(), dir.clone());
        std::thread::spawn(move || {
            run_to_end(run_sh(
                &url,
                &key,
                &["--wait", "60s"],
                dir.path(),
                r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/second""#,
            ))
        })
    };
    std::fs::write(dir.path().join("go"), "").expect("go");
    let holder = holder.join().expect("holder");
    assert_eq!(code(&holder), 0, "{}", stderr(&holder));
    let waiter = waiter.join().expect("waiter");
    assert_eq!(code(&waiter), 0, "{}", stderr(&waiter));
    let token = |name: &str| -> u64 {
        let text = std::fs::read_to_string(dir.path().join(name)).expect("token file");
        text.trim().parse().expect("a fencing token")
    };
    assert!(token("second") > token("first"));

    // The wrong CA: a configuration error (exit 78) naming the problem.
    let wrong_ca = url.replace(
        &format!("tls_ca_file={}", pki.ca.display()),
        &format!("tls_ca_file={}", pki.other_ca.display()),
    );
    assert_ne!(wrong_ca, url);
    let refused = run_to_end(run_sh(
        &wrong_ca,
        &key,
        &[],
        dir.path(),
        "touch \"$DIR/ran\"",
    ));
    assert_eq!(code(&refused), 78, "{}", stderr(&refused));
    let err = stderr(&refused);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("not signed by a CA"), "{err}");
    assert!(err.contains("tls_ca_file"), "{err}");
    assert!(!dir.path().join("ran").exists(), "the command never runs");
}
