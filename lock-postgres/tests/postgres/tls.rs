//! TLS against a TLS-only server (`hostssl` lines only, `ssl_ca_file` for
//! client certificates): libpq's parameters and the shared `tls_*` ones,
//! the listener over TLS, and each TLS failure as a typed error that names
//! the problem.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use distlock_conformance::server::{PostgresTls, ServerKind, ServerProcess, CERT_USER};
use distlock_core::{ErrorKind, LockError};
use distlock_postgres::PostgresLock;

use super::support::*;

/// The shared TLS-only server and its kind (for URLs and certificates).
fn tls_server() -> &'static (PostgresTls, ServerProcess) {
    static SERVER: OnceLock<(PostgresTls, ServerProcess)> = OnceLock::new();
    SERVER.get_or_init(|| {
        let kind = PostgresTls::new().expect("generate the test PKI");
        let server = ServerProcess::start(Arc::new(kind.clone()))
            .unwrap_or_else(|e| panic!("cannot start the TLS PostgreSQL: {e}"));
        (kind, server)
    })
}

async fn started() -> &'static (PostgresTls, ServerProcess) {
    tokio::task::spawn_blocking(tls_server).await.unwrap()
}

/// Connecting to `url` fails with a `Config` error whose message holds
/// every one of `words`; the outer timeout only guards against a hang.
async fn refused(url: &str, words: &[&str]) -> LockError {
    let result = tokio::time::timeout(Duration::from_secs(30), PostgresLock::connect(url))
        .await
        .expect("a TLS failure is reported, never a hang");
    let err = result.expect_err("the connection must be refused");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    for word in words {
        assert!(err.to_string().contains(word), "{word:?} not in: {err}");
    }
    err
}

/// Whether every connection of `app` (the pool's and the listener's) is
/// encrypted, and how many there are.
async fn encrypted(lock: &Pg, app: &str) -> (bool, i64) {
    sqlx::query_as(
        "SELECT coalesce(bool_and(s.ssl), false), count(*) FROM pg_stat_activity a
         JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = $1",
    )
    .bind(app)
    .fetch_one(lock.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn verify_full_with_libpq_parameters_and_waiters_over_tls() {
    let (kind, server) = started().await;
    let ns = unique_name("tls");
    let app = unique_name("tls_app");
    let url = format!(
        "{}&namespace={ns}&application_name={app}",
        kind.url(server.addr())
    );
    let holder = Pg::connect(&url).await;
    let waiter = Pg::connect(&url).await;
    assert_release_heard(&holder, &waiter, &key("k"), "no NOTIFY over TLS").await;
    let (all, count) = encrypted(&holder, &app).await;
    assert!(
        all && count >= 3,
        "{count} connections, all encrypted: {all}"
    );

    // A listen_url without TLS settings of its own takes the main URL's:
    // this server refuses plaintext, so the waiter is only woken if it did.
    let direct = format!(
        "postgres://postgres:postgres@{}/postgres?application_name={app}",
        server.addr()
    );
    let waiter = Pg::connect(&format!("{url}&listen_url={}", percent_encode(&direct))).await;
    assert_release_heard(
        &holder,
        &waiter,
        &key("k2"),
        "the listen_url connection did not take the main URL's TLS settings",
    )
    .await;
}

#[tokio::test]
async fn an_untrusted_server_certificate_is_a_certificate_error() {
    let (kind, server) = started().await;
    let other_ca = &kind.pki().other_ca;
    refused(
        &kind.url_with_ca(server.addr(), other_ca),
        &["TLS certificate problem", "not trusted", "sslrootcert"],
    )
    .await;
    // The shared parameter means the same.
    refused(
        &format!(
            "postgres://postgres:postgres@{}/postgres?tls_ca_file={}",
            server.addr(),
            percent_encode(&other_ca.to_string_lossy())
        ),
        &["TLS certificate problem", "not trusted"],
    )
    .await;
    // Without a CA, the platform's roots do not know the test CA either.
    refused(
        &format!(
            "postgres://postgres:postgres@{}/postgres?sslmode=verify-ca",
            server.addr()
        ),
        &["TLS certificate problem", "not trusted"],
    )
    .await;
}

#[tokio::test]
async fn a_host_name_mismatch_is_refused() {
    let (kind, _) = started().await;
    // Its own server: it presents a certificate for wrong.example, signed
    // by the trusted CA.
    let wrong = kind.clone().with_server_cert(kind.pki().wrong_host.clone());
    let server = tokio::task::spawn_blocking(move || ServerProcess::start(Arc::new(wrong)))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start the TLS PostgreSQL: {e}"));
    let url = kind.url_with_ca(server.addr(), &kind.pki().ca);
    refused(
        &url,
        &["TLS certificate problem", "not valid for the host name"],
    )
    .await;
    // (sslmode=verify-ca should skip the name check, as in libpq, but
    // sqlx 0.8.6 with rustls 0.23.24+ refuses the name too:
    // launchbadge/sqlx#3793. The README says so.)
}

#[tokio::test]
async fn a_client_certificate_is_required_and_accepted() {
    let (kind, server) = started().await;
    let pki = kind.pki();
    // With the PKI's client certificate (CN distlock), through the shared
    // parameters and through libpq's.
    let shared = kind.mutual_url(server.addr(), &pki.client);
    let libpq = format!(
        "postgres://{CERT_USER}@{}/postgres?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        server.addr(),
        percent_encode(&pki.ca.to_string_lossy()),
        percent_encode(&pki.client.cert.to_string_lossy()),
        percent_encode(&pki.client.key.to_string_lossy()),
    );
    for url in [&shared, &libpq] {
        let ns = unique_name("mtls");
        let lock = Pg::connect(&format!("{url}&namespace={ns}")).await;
        let other = Pg::connect(&format!("{url}&namespace={ns}")).await;
        assert_release_heard(&lock, &other, &key("k"), "no NOTIFY over mutual TLS").await;
    }
    // Without a certificate: the server asks for one.
    refused(
        &format!(
            "postgres://{CERT_USER}@{}/postgres?sslmode=verify-full&sslrootcert={}",
            server.addr(),
            percent_encode(&pki.ca.to_string_lossy())
        ),
        &["TLS certificate problem", "requires a client certificate"],
    )
    .await;
    // A certificate signed by a CA the server does not trust.
    refused(
        &kind.mutual_url(server.addr(), &pki.other_client),
        &[
            "TLS certificate problem",
            "refused this client's certificate",
        ],
    )
    .await;
}

#[tokio::test]
async fn plaintext_and_tls_mismatches_are_connection_errors() {
    let (_, server) = started().await;
    // Plaintext against the hostssl-only server.
    refused(
        &format!(
            "postgres://postgres:postgres@{}/postgres?sslmode=disable",
            server.addr()
        ),
        &[
            "TLS connection problem",
            "accepts only TLS",
            "sslmode=verify-full",
        ],
    )
    .await;
    // TLS required of the plain test server (ssl = off).
    refused(
        &format!("{}?sslmode=require", super::support::server().url()),
        &["TLS connection problem", "does not accept TLS"],
    )
    .await;
}

#[tokio::test]
async fn missing_unreadable_and_non_pem_files_are_named() {
    let (kind, server) = started().await;
    let base = format!("postgres://postgres:postgres@{}/postgres", server.addr());
    let dir = std::env::temp_dir().join(unique_name("distlock-tls-files"));
    std::fs::create_dir_all(&dir).unwrap();
    let not_pem = dir.join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let path = |p: &std::path::Path| percent_encode(&p.to_string_lossy());
    let missing = dir.join("absent.pem");
    let ca = path(&kind.pki().ca);
    let cert = path(&kind.pki().client.cert);
    for (query, words) in [
        (
            format!("sslrootcert={}", path(&missing)),
            vec!["sslrootcert", "absent.pem"],
        ),
        (
            format!("tls_ca_file={}", path(&missing)),
            vec!["tls_ca_file", "absent.pem"],
        ),
        // A directory cannot be read as a file (root reads any file).
        (
            format!(
                "tls_ca_file={ca}&tls_cert_file={cert}&tls_key_file={}",
                path(&dir)
            ),
            vec!["tls_key_file", "cannot read"],
        ),
        (
            format!("sslrootcert={ca}&sslcert={cert}&sslkey={}", path(&not_pem)),
            vec!["sslkey", "PRIVATE KEY"],
        ),
    ] {
        refused(&format!("{base}?{query}"), &words).await;
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The pool's connections get the TLS files as distlock read them, never
/// a path for sqlx to read inside a lock call (it reads on a blocking
/// thread and panics if the runtime shuts down meanwhile). A renewed file
/// reaches the pool at the next sweep.
#[tokio::test]
async fn the_pool_gets_the_tls_files_as_read_and_renewed_ones_at_a_sweep() {
    let (kind, server) = started().await;
    let pki = kind.pki();
    let ca = std::env::temp_dir().join(format!("{}.pem", unique_name("renewed_ca")));
    std::fs::copy(&pki.ca, &ca).expect("copy the CA");
    // A sweep is due at most every second with a two-second retention.
    let url = format!(
        "{}&namespace={}&fence_retention_ms=2000",
        kind.url_with_ca(server.addr(), &ca),
        unique_name("tls_pool")
    );
    let lock = Pg::connect(&url).await;
    let options = || format!("{:?}", lock.pool().connect_options());
    let path = ca.to_string_lossy().into_owned();
    assert!(
        !options().contains(&path),
        "the pool's options name the CA file for sqlx to read: {}",
        options()
    );
    let inline =
        |file: &std::path::Path| format!("Inline({:?})", std::fs::read(file).expect("read the CA"));
    assert!(options().contains(&inline(&pki.ca)), "{}", options());

    // Renewed: the same CA in other bytes (new connections still work).
    let renewed = format!(
        "{}\n",
        std::fs::read_to_string(&pki.ca).expect("read the CA")
    );
    std::fs::write(&ca, &renewed).expect("renew the CA file");
    let renewed = format!("Inline({:?})", renewed.as_bytes());
    let k = key("renewed");
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    // Acquisitions start sweeps (one a second at most), each reading the
    // files again for the pool.
    while !options().contains(&renewed) {
        assert!(
            std::time::Instant::now() < give_up,
            "the renewed CA never reached the pool"
        );
        let lease = take(
            &lock,
            &k,
            Duration::from_secs(30),
            "nobody else uses the key",
        )
        .await;
        lock.release(&lease).await.expect("release");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = std::fs::remove_file(&ca);
}
