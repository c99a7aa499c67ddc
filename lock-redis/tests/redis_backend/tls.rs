//! TLS: `rediss://` against TLS-only servers with certificates
//! from a throwaway CA. Every refusal is a typed error that says whether
//! the certificate or the connection is the problem, within the connect
//! timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::naming::unique_name;
use distlock_conformance::server::{
    self, RedisSentinel, RedisTls, RedisTlsAuth, ServerProcess, TestPki,
};
use distlock_core::ErrorKind;
use distlock_redis::redis::{self, aio::MultiplexedConnection};

use crate::support::*;

/// A fresh PKI in its own directory, removed when dropped.
struct Pki {
    pki: TestPki,
    dir: std::path::PathBuf,
}

impl Pki {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(unique_name("distlock-redis-tls-test"));
        Self {
            pki: TestPki::generate(&dir).expect("test certificates"),
            dir,
        }
    }

    fn ca(&self) -> String {
        self.pki.ca.display().to_string()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_tls(kind: RedisTls) -> ServerProcess {
    ServerProcess::start(Arc::new(kind)).expect("cannot start redis-server with TLS")
}

/// A short connect timeout, so refusals that wait for it stay quick.
const CONNECT: &str = "connect_timeout_ms=1000&operation_timeout_ms=1000";

/// Connects to `url`, expecting a refusal of `kind` within the connect
/// timeout (1 s) plus a margin for a loaded machine; returns the message.
async fn refused(url: &str, kind: ErrorKind) -> String {
    let started = Instant::now();
    let err = connect(url).await.expect_err(url);
    let took = started.elapsed();
    assert_eq!(err.kind(), kind, "{url}: {err}");
    assert!(
        took < Duration::from_secs(30),
        "{url}: refused only after {took:?}, the connect never gave up"
    );
    err.message().to_owned()
}

/// A raw TLS connection to `url` (`rediss://[:password@]host:port`,
/// parameters ignored) trusting the PKI's CA, as the PKI's client if
/// `client`.
async fn raw_tls(url: &str, pki: &TestPki, client: bool) -> MultiplexedConnection {
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    let certificates = redis::TlsCertificates {
        client_tls: client.then(|| redis::ClientTlsConfig {
            client_cert: read(&pki.client.cert),
            client_key: read(&pki.client.key),
        }),
        root_cert: Some(read(&pki.ca)),
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = url.split('?').next().unwrap_or(url);
    redis::Client::build_with_tls(url, certificates)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("raw TLS connection to the test server")
}

/// A holder and a waiter over `url`: the waiter, subscribed (seen on
/// `admin`), is woken by the release (pub/sub over the same TLS settings).
async fn lock_and_wake(url: &str, admin: &mut MultiplexedConnection) {
    let holder = connect(url).await.unwrap();
    let waiter = connect(url).await.unwrap();
    let waiting = Waiting::start(&holder, &waiter, admin, "tls").await;
    let got = waiting.release_wakes_the_waiter(&holder, admin).await;
    waiter.release(&got).await.unwrap();
}

/// The server's certificate is signed by a CA the client does not trust:
/// no `tls_ca_file` (the platform's roots alone), or the wrong one.
#[tokio::test]
async fn an_untrusted_server_certificate_is_refused() {
    let pki = Pki::new();
    let server = start_tls(RedisTls::new(pki.pki.clone()));
    for url in [
        format!("rediss://{}/?{CONNECT}", server.addr()),
        format!(
            "rediss://{}/?{CONNECT}&tls_ca_file={}",
            server.addr(),
            pki.pki.other_ca.display()
        ),
    ] {
        let message = refused(&url, ErrorKind::Config).await;
        assert!(
            message.contains("TLS certificate problem") && message.contains("not trusted"),
            "{url}: {message}"
        );
        assert!(
            message.contains("tls_ca_file"),
            "{url}: says what to do: {message}"
        );
    }
}

/// The certificate is signed by the trusted CA but for another name.
#[tokio::test]
async fn a_host_name_mismatch_is_refused() {
    let pki = Pki::new();
    let server = start_tls(RedisTls::new(pki.pki.clone()).serve(pki.pki.wrong_host.clone()));
    let url = format!(
        "rediss://{}/?{CONNECT}&tls_ca_file={}",
        server.addr(),
        pki.ca()
    );
    let message = refused(&url, ErrorKind::Config).await;
    assert!(
        message.contains("TLS certificate problem") && message.contains("host name"),
        "{message}"
    );
    // The right certificate is accepted under either name it lists.
    let good = start_tls(RedisTls::new(pki.pki.clone()));
    for host in ["127.0.0.1", "localhost"] {
        let url = format!("rediss://{host}:{}/?tls_ca_file={}", good.port(), pki.ca());
        connect(&url).await.unwrap_or_else(|e| panic!("{url}: {e}"));
    }
}

/// `tls-auth-clients yes`: no client certificate, or one from another CA,
/// is refused naming the client certificate; the PKI's is accepted, and
/// locks, waits and wake-ups work over mutual TLS.
#[tokio::test]
async fn a_required_client_certificate_is_asked_for_and_accepted() {
    let pki = Pki::new();
    let server = start_tls(RedisTls::new(pki.pki.clone()).client_auth(RedisTlsAuth::Required));
    let other = &pki.pki.other_client;
    for url in [
        format!(
            "rediss://{}/?{CONNECT}&tls_ca_file={}",
            server.addr(),
            pki.ca()
        ),
        format!(
            "rediss://{}/?{CONNECT}&tls_ca_file={}&tls_cert_file={}&tls_key_file={}",
            server.addr(),
            pki.ca(),
            other.cert.display(),
            other.key.display()
        ),
    ] {
        let message = refused(&url, ErrorKind::Config).await;
        assert!(
            message.contains("TLS certificate problem") && message.contains("client certificate"),
            "{url}: {message}"
        );
    }
    let mut admin = raw_tls(&format!("rediss://{}", server.addr()), &pki.pki, true).await;
    lock_and_wake(&server.url(), &mut admin).await;
}

/// A Redis ACL user over TLS: its password and permissions apply as over
/// plain TCP (wrong password refused, missing permission named), and it
/// locks and is woken.
#[tokio::test]
async fn an_acl_user_over_tls() {
    let pki = Pki::new();
    let server = start_tls(RedisTls::new(pki.pki.clone()));
    let mut admin = raw_tls(&format!("rediss://{}", server.addr()), &pki.pki, false).await;
    acl_user(&mut admin, "jobs", DOC_PERMISSIONS).await;
    let url = |user: &str, namespace: &str| {
        format!(
            "rediss://{user}@{}/?{CONNECT}&namespace={namespace}&tls_ca_file={}",
            server.addr(),
            pki.ca()
        )
    };
    let message = refused(&url("jobs:wrong", "distlock"), ErrorKind::Config).await;
    assert!(message.contains("authentication failed"), "{message}");
    let message = refused(&url("jobs:pw", "other"), ErrorKind::Config).await;
    assert!(
        message.contains("~other:*"),
        "names the missing keys: {message}"
    );
    lock_and_wake(&url("jobs:pw", "distlock"), &mut admin).await;
}

/// A plaintext URL against a TLS-only port, and a TLS URL against a
/// plaintext port: typed errors naming a TLS connection problem and the
/// scheme to use, within the connect timeout.
#[tokio::test]
async fn plaintext_and_tls_mixed_up_name_the_scheme() {
    let pki = Pki::new();
    let tls = start_tls(RedisTls::new(pki.pki.clone()));
    let plain = start(server::Redis::default());

    let message = refused(
        &format!("redis://{}/?{CONNECT}", tls.addr()),
        ErrorKind::Unavailable,
    )
    .await;
    assert!(
        message.contains("TLS connection problem") && message.contains("rediss://"),
        "{message}"
    );
    let url = format!(
        "rediss://{}/?{CONNECT}&tls_ca_file={}",
        plain.addr(),
        pki.ca()
    );
    let message = refused(&url, ErrorKind::Timeout).await;
    assert!(
        message.contains("TLS connection problem") && message.contains("redis://"),
        "{message}"
    );
}

/// A missing or unreadable CA, certificate or key file: a configuration
/// error naming the parameter and the path, before any connection.
#[tokio::test]
async fn missing_or_unusable_tls_files_name_the_parameter_and_path() {
    let pki = Pki::new();
    let addr = "127.0.0.1:1";
    let client = &pki.pki.client;
    let missing = pki.dir.join("absent.pem");
    let cases = [
        (
            format!("rediss://{addr}/?tls_ca_file={}", missing.display()),
            "tls_ca_file",
            missing.display().to_string(),
        ),
        (
            format!(
                "rediss://{addr}/?tls_cert_file={}&tls_key_file={}",
                missing.display(),
                client.key.display()
            ),
            "tls_cert_file",
            missing.display().to_string(),
        ),
        (
            // A certificate where the key should be.
            format!(
                "rediss://{addr}/?tls_cert_file={}&tls_key_file={}",
                client.cert.display(),
                client.cert.display()
            ),
            "tls_key_file",
            client.cert.display().to_string(),
        ),
        (
            // A directory cannot be read as a file.
            format!("rediss://{addr}/?tls_ca_file={}", pki.dir.display()),
            "tls_ca_file",
            pki.dir.display().to_string(),
        ),
        (
            format!("rediss://{addr}/?tls_cert_file={}", client.cert.display()),
            "tls_key_file",
            String::new(),
        ),
    ];
    for (url, parameter, path) in cases {
        let message = refused(&url, ErrorKind::Config).await;
        assert!(message.contains(parameter), "{url}: {message}");
        assert!(message.contains(&path), "{url}: {message}");
    }
    // TLS files on a plaintext URL are a mistake, not ignored.
    let message = refused(
        &format!("redis://{addr}/?tls_ca_file={}", pki.ca()),
        ErrorKind::Config,
    )
    .await;
    assert!(message.contains("rediss://"), "{message}");
}

/// `rediss+sentinel://`: the sentinels, the primary and the replication
/// speak TLS only; the client finds the primary over TLS, locks, and its
/// waiter is woken over a TLS pub/sub connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls() {
    let pki = Pki::new();
    let tls = pki.pki.clone();
    let group = tokio::task::spawn_blocking(move || RedisSentinel::start_tls(tls))
        .await
        .unwrap()
        .expect("cannot start the TLS sentinel group");
    let url = group.url();
    assert!(url.starts_with("rediss+sentinel://"), "{url}");
    let mut admin = raw_tls(&group.node_url(group.primary().unwrap()), &pki.pki, false).await;
    lock_and_wake(&url, &mut admin).await;
    // The sentinels' certificate must be trusted too.
    let untrusted = url.replace(&pki.ca(), &pki.pki.other_ca.display().to_string());
    let message = refused(&format!("{untrusted}&{CONNECT}"), ErrorKind::Config).await;
    assert!(message.contains("TLS certificate problem"), "{message}");
}
