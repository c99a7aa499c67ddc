//! TLS: the URL's `tls_ca_file`, `tls_cert_file` and `tls_key_file` as the
//! redis driver's certificates, and the driver's TLS failures as errors
//! that say whether the certificate or the connection is the problem.

use distlock_core::{ErrorKind, LockError, TlsAdvice, TlsFailure, TlsFiles};
use redis::{ConnectionAddr, ConnectionInfo, RedisError};

use crate::config::Server;

/// Whether `server` is reached over TLS.
pub(crate) fn is_tls(server: &Server) -> bool {
    match server {
        Server::Single(info) => matches!(info.addr(), ConnectionAddr::TcpTls { .. }),
        Server::Sentinel(sentinel) => sentinel.tls,
        Server::Cluster(cluster) => cluster.tls,
    }
}

/// Adds to a failed first connection what a TLS mismatch looks like from
/// this side, as far as it can be told apart: a TLS-only port resets a
/// plaintext connection; a plaintext port never answers a TLS handshake.
pub(crate) fn connect_hint(err: LockError, tls: bool) -> LockError {
    let message = err.message().to_owned();
    let hint = match err.kind() {
        ErrorKind::Timeout if tls => {
            "TLS connection problem? No TLS handshake completed: if the server does not use TLS on this port, use redis:// instead of rediss://"
        }
        ErrorKind::Unavailable
            if !tls && (message.contains("reset by peer") || message.contains("closed")) =>
        {
            "TLS connection problem? The server closed the connection during setup, as a TLS-only port does with plaintext: if it requires TLS, use rediss:// instead of redis://"
        }
        _ => return err,
    };
    let hinted = format!("{message}. {hint}");
    match err.kind() {
        ErrorKind::Timeout => LockError::timeout(hinted),
        _ => LockError::unavailable(hinted),
    }
    .with_source(err)
}

/// The redis driver's certificate settings, for TLS connections.
#[cfg(feature = "tls")]
pub(crate) type Certificates = Option<redis::TlsCertificates>;
/// Without the `tls` feature there are none (TLS URLs are refused earlier).
#[cfg(not(feature = "tls"))]
pub(crate) type Certificates = Option<std::convert::Infallible>;

/// For a `tls` connection: the trusted roots and the client certificate,
/// from `files` (errors name the parameter and the path).
///
/// The roots are the platform's, read once per process with
/// `rustls-native-certs`, followed by `tls_ca_file`'s (trusted *in
/// addition to* the platform's). The driver is always given them: it would
/// otherwise read and parse the platform's store again for every
/// connection, and it *replaces* its roots by whatever it is given.
#[cfg(feature = "tls")]
pub(crate) async fn certificates(files: &TlsFiles, tls: bool) -> Result<Certificates, LockError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    if !tls {
        return Ok(None);
    }
    let pem = files.read().await?;
    let mut roots = match PLATFORM_ROOTS.get() {
        Some(roots) => roots.clone(),
        None => {
            let loaded = tokio::task::spawn_blocking(platform_roots_pem)
                .await
                .map_err(|e| {
                    LockError::config(format!(
                        "loading the platform's root certificates failed: {e}"
                    ))
                })?;
            PLATFORM_ROOTS.get_or_init(|| loaded).clone()
        }
    };
    if let Some(ca) = pem.ca {
        let parsed = CertificateDer::pem_slice_iter(&ca).collect::<Result<Vec<_>, _>>();
        if let Err(e) = parsed {
            return Err(LockError::config(format!(
                "tls_ca_file: {} is not a PEM certificate: {e}",
                path(files.ca_file())
            )));
        }
        roots.extend_from_slice(&ca);
    }
    let root_cert = Some(roots);
    let client_tls = match pem.identity {
        None => None,
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(&cert).collect::<Result<Vec<_>, _>>();
            if let Err(e) = chain {
                return Err(LockError::config(format!(
                    "tls_cert_file: {} is not a PEM certificate: {e}",
                    path(files.cert_file())
                )));
            }
            if let Err(e) = PrivateKeyDer::from_pem_slice(&key) {
                return Err(LockError::config(format!(
                    "tls_key_file: {} holds no usable private key: {e}",
                    path(files.key_file())
                )));
            }
            Some(redis::ClientTlsConfig {
                client_cert: cert,
                client_key: key,
            })
        }
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// Without the `tls` feature no TLS URL gets this far.
#[cfg(not(feature = "tls"))]
pub(crate) async fn certificates(files: &TlsFiles, tls: bool) -> Result<Certificates, LockError> {
    let _ = (files, tls);
    Ok(None)
}

#[cfg(feature = "tls")]
fn path(file: Option<&std::path::Path>) -> String {
    file.map(|p| p.display().to_string()).unwrap_or_default()
}

/// The platform's roots as PEM, read once per process (reading and parsing
/// the store costs more than a TLS handshake).
#[cfg(feature = "tls")]
static PLATFORM_ROOTS: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();

/// The platform's trusted roots as PEM. A store that cannot be read (or
/// holds nothing) leaves only the CA file: a warning, not an error.
#[cfg(feature = "tls")]
fn platform_roots_pem() -> Vec<u8> {
    use base64::Engine;

    let found = rustls_native_certs::load_native_certs();
    for error in &found.errors {
        tracing::warn!(%error, "cannot read some of the platform's root certificates; trusting tls_ca_file and the rest");
    }
    let mut pem = Vec::new();
    for cert in found.certs {
        let text = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
        pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
        for line in text.as_bytes().chunks(64) {
            pem.extend_from_slice(line);
            pem.push(b'\n');
        }
        pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
    }
    pem
}

/// `info` with the certificates (a TLS address without settings of its
/// own only; others are returned as they are).
pub(crate) fn with_certificates(
    info: ConnectionInfo,
    certificates: &Certificates,
) -> Result<ConnectionInfo, LockError> {
    #[cfg(feature = "tls")]
    if let (Some(certificates), redis::ConnectionAddr::TcpTls { .. }) = (certificates, info.addr())
    {
        let client = redis::Client::build_with_tls(info, certificates.clone()).map_err(|e| {
            LockError::config(format!("invalid TLS certificate settings: {e}")).with_source(e)
        })?;
        return Ok(client.get_connection_info().clone());
    }
    let _ = certificates;
    Ok(info)
}

/// What a redis user changes for each TLS failure.
const ADVICE: TlsAdvice = TlsAdvice {
    server: "redis",
    trust: "tls_ca_file=PATH (trusted in addition to the platform's roots)",
    client_certificate: "tls_cert_file=PATH and tls_key_file=PATH",
    plaintext: "use redis:// instead of rediss://",
};

/// The error for `what` (the request) if `err` is a TLS failure.
pub(crate) fn failure(err: RedisError, what: &str) -> Result<LockError, RedisError> {
    // The driver turns rustls errors into I/O errors; their text is all
    // that survives (e.g. "invalid peer certificate: UnknownIssuer").
    match TlsFailure::of_text(&format!("{err:?} {err}")) {
        Some(failure) => Ok(failure.error(what, &err, &ADVICE).with_source(err)),
        None => Err(err),
    }
}
