//! `etcds://` against real TLS etcd servers: what works, and
//! each way it can be set up wrong giving a typed error that names the
//! problem (certificate or connection) within the connect timeout. The
//! whole conformance suite over mutual TLS is `tls::` in
//! tests/conformance.rs.
#![cfg(feature = "tls")]

mod common;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use distlock_conformance::server::{Etcd, EtcdTls, ServerProcess, TestPki};
use distlock_core::{AcquireAttempt, ErrorKind, LockClient, LockError};
use distlock_etcd::EtcdLock;

use common::unique_key;

/// Every case below answers on its own, without waiting it out. A try
/// gets a third of it: at 3 s, a loaded 2-core machine left a plaintext
/// client's tries against the TLS port unanswered within 1 s each, so the
/// case saw "no answer" instead of the server closing the connection.
const CONNECT: &str = "connect_timeout_ms=10000&operation_timeout_ms=10000";

/// Hang guard only (not a timing assertion).
const HANG: Duration = Duration::from_secs(60);

async fn connect(url: &str) -> Result<LockClient, LockError> {
    tokio::time::timeout(HANG, EtcdLock::connect(url))
        .await
        .unwrap_or_else(|_| panic!("connecting to {url} hung"))
        .map(LockClient::new)
}

/// Connecting to `url` fails with `kind`, and the message holds every
/// one of `words`.
async fn refused(url: &str, kind: ErrorKind, words: &[&str]) {
    let err = match connect(url).await {
        Ok(_) => panic!("{url} connected"),
        Err(err) => err,
    };
    assert_eq!(err.kind(), kind, "{url}: {err}");
    for word in words {
        assert!(
            err.to_string().contains(word),
            "{url}: {word:?} not in: {err}"
        );
    }
}

fn files(ca: &Path, cert: Option<(&Path, &Path)>) -> String {
    let mut query = format!("tls_ca_file={}", ca.display());
    if let Some((cert, key)) = cert {
        query.push_str(&format!(
            "&tls_cert_file={}&tls_key_file={}",
            cert.display(),
            key.display()
        ));
    }
    query
}

async fn start<F, T>(f: F) -> T
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f).await.expect("server start")
}

fn server(kind: impl distlock_conformance::server::ServerKind) -> ServerProcess {
    ServerProcess::start(Arc::new(kind)).expect("etcd must start")
}

/// Runs `test` with a fresh PKI.
async fn with_pki<F, Fut>(test: F)
where
    F: FnOnce(TestPki) -> Fut,
    Fut: Future<Output = ()>,
{
    test(TestPki::temporary().expect("test PKI")).await;
}

/// Mutual TLS: the client certificate is required and, signed by the
/// server's trusted CA, accepted; the wrong CA, a missing or untrusted
/// client certificate, and a plaintext URL are each refused with an
/// error that says which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls() {
    with_pki(|pki| async move {
        let tls = {
            let kind = EtcdTls::mutual(&pki);
            start(move || server(kind)).await
        };
        let addr = tls.addr();
        let client = (pki.client.cert.as_path(), pki.client.key.as_path());

        // Accepted: lock, release.
        let good = format!("etcds://{addr}?{}&{CONNECT}", files(&pki.ca, Some(client)));
        let lock = connect(&good).await.expect("mutual TLS connects");
        let k = unique_key("tls");
        match lock
            .try_acquire(&k, Duration::from_secs(5))
            .await
            .expect("acquire")
        {
            AcquireAttempt::Acquired(lease) => lock.release(&lease).await.expect("release"),
            AcquireAttempt::Held { .. } => panic!("{k} is new, yet held"),
        }
        // By host name too (the certificate names localhost).
        let by_name = format!(
            "etcds://localhost:{}?{}&{CONNECT}",
            addr.port(),
            files(&pki.ca, Some(client))
        );
        connect(&by_name).await.expect("by host name");

        // The server's certificate is not from the CA we trust.
        let wrong_ca = format!(
            "etcds://{addr}?{}&{CONNECT}",
            files(&pki.other_ca, Some(client))
        );
        refused(
            &wrong_ca,
            ErrorKind::Config,
            &["certificate", "not signed by a CA", "tls_ca_file"],
        )
        .await;

        // No client certificate, and one from an untrusted CA.
        let none = format!("etcds://{addr}?{}&{CONNECT}", files(&pki.ca, None));
        refused(
            &none,
            ErrorKind::Config,
            &["requires a client certificate", "tls_cert_file"],
        )
        .await;
        let untrusted = (
            pki.other_client.cert.as_path(),
            pki.other_client.key.as_path(),
        );
        let other = format!(
            "etcds://{addr}?{}&{CONNECT}",
            files(&pki.ca, Some(untrusted))
        );
        refused(
            &other,
            ErrorKind::Config,
            &["refused this client's certificate"],
        )
        .await;

        // Plaintext against the TLS port.
        let plain = format!("etcd://{addr}?{CONNECT}");
        refused(
            &plain,
            ErrorKind::Unavailable,
            &["closed the connection", "etcds://"],
        )
        .await;
    })
    .await;
}

/// The server's certificate names another host: refused, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_name_mismatch() {
    with_pki(|pki| async move {
        let wrong_host = {
            let kind = EtcdTls::server_only(&pki).with_server_cert(pki.wrong_host.clone());
            start(move || server(kind)).await
        };
        let url = format!(
            "etcds://{}?{}&{CONNECT}",
            wrong_host.addr(),
            files(&pki.ca, None)
        );
        refused(
            &url,
            ErrorKind::Config,
            &["not valid for the host name", "127.0.0.1", "wrong.example"],
        )
        .await;
    })
    .await;
}

/// TLS against a plaintext port: refused, saying the port does not seem
/// to speak TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_against_a_plaintext_port() {
    with_pki(|pki| async move {
        let plain = start(|| server(Etcd)).await;
        let url = format!(
            "etcds://{}?{}&{CONNECT}",
            plain.addr(),
            files(&pki.ca, None)
        );
        refused(&url, ErrorKind::Unavailable, &["TLS handshake", "etcd://"]).await;
    })
    .await;
}

/// Missing, unreadable and wrong files are configuration errors naming
/// the parameter and the path, before anything is sent (no server here).
#[tokio::test]
async fn bad_files_are_named() {
    with_pki(|pki| async move {
        let dir = pki.ca.parent().expect("PKI directory").to_owned();
        let missing = dir.join("absent.pem");
        let url = |query: String| format!("etcds://127.0.0.1:1?{query}&{CONNECT}");
        refused(
            &url(files(&missing, None)),
            ErrorKind::Config,
            &["tls_ca_file", "absent.pem"],
        )
        .await;
        // A directory cannot be read as a file (even by root).
        refused(
            &url(files(&pki.ca, Some((&dir, &pki.client.key)))),
            ErrorKind::Config,
            &["tls_cert_file", "cannot read"],
        )
        .await;
        // A certificate where the key should be.
        refused(
            &url(files(&pki.ca, Some((&pki.client.cert, &pki.client.cert)))),
            ErrorKind::Config,
            &["tls_key_file", "PRIVATE KEY"],
        )
        .await;
        // A PEM block that is not a certificate.
        let garbage = dir.join("garbage.crt");
        std::fs::write(
            &garbage,
            "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        refused(
            &url(files(&garbage, None)),
            ErrorKind::Config,
            &["tls_ca_file", "garbage.crt"],
        )
        .await;
        // TLS files on a plaintext URL.
        let plain = format!("etcd://127.0.0.1:1?{}", files(&pki.ca, None));
        refused(&plain, ErrorKind::Config, &["etcds://"]).await;
    })
    .await;
}
