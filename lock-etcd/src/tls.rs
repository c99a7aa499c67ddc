//! TLS for `etcds://` (cargo feature `tls`): the gRPC channel's TLS
//! options from the URL's files, checked before anything is sent, and what
//! a failed handshake means in words.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockError, TlsAdvice, TlsFailure, TlsFiles, TlsPem};
use etcd_client::{Certificate, Identity, TlsOptions};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::AsyncReadExt;

/// The TLS options for `files`: the platform's root certificates plus
/// `tls_ca_file`, and the client certificate if given; the handshake is
/// bounded by `handshake_timeout`. A file that is missing, unreadable or
/// not the PEM it should be is a `Config` error naming parameter and path,
/// and so is a platform without root certificates when no `tls_ca_file`
/// is given.
pub(crate) async fn options(
    files: &TlsFiles,
    handshake_timeout: Duration,
) -> Result<TlsOptions, LockError> {
    let pem = files.read().await?;
    let mut tls = TlsOptions::new().timeout(handshake_timeout);
    // tonic refuses to build a channel asked for platform roots when there
    // are none (a container without ca-certificates): use them only if
    // there are some.
    let platform_roots =
        tokio::task::spawn_blocking(|| !rustls_native_certs::load_native_certs().certs.is_empty())
            .await
            .unwrap_or(false);
    if platform_roots {
        tls = tls.with_native_roots();
    }
    match (&pem.ca, &files.ca_file()) {
        (Some(ca), Some(path)) => {
            certificates("tls_ca_file", path, ca)?;
            tls = tls.ca_certificate(Certificate::from_pem(ca));
        }
        _ if !platform_roots => {
            return Err(LockError::config(
                "this system has no trusted root certificates to check the etcd server's certificate with; give the CA that signed it with tls_ca_file=PATH (or install the platform's CA certificates)",
            ));
        }
        _ => {}
    }
    if let (Some((cert, key)), Some(cert_path), Some(key_path)) =
        (&pem.identity, &files.cert_file(), &files.key_file())
    {
        certificates("tls_cert_file", cert_path, cert)?;
        PrivateKeyDer::from_pem_slice(key).map_err(|e| {
            LockError::config(format!(
                "tls_key_file: {} holds no usable private key: {e}",
                key_path.display()
            ))
        })?;
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Ok(tls)
}

/// Checks that `pem` (from `path`, given as `parameter`) parses as one or
/// more certificates.
fn certificates(parameter: &str, path: &Path, pem: &[u8]) -> Result<(), LockError> {
    let mut found = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        cert.map_err(|e| {
            LockError::config(format!(
                "{parameter}: {} holds a certificate that does not parse: {e}",
                path.display()
            ))
        })?;
        found += 1;
    }
    if found == 0 {
        return Err(LockError::config(format!(
            "{parameter}: {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(())
}

/// What an etcd user changes for each TLS failure.
const ADVICE: TlsAdvice = TlsAdvice {
    server: "etcd",
    trust: "tls_ca_file=PATH",
    client_certificate:
        "tls_cert_file=PATH&tls_key_file=PATH (signed by a CA in etcd's --trusted-ca-file)",
    plaintext: "use etcd:// for a plaintext port",
};

/// The error for `what` (the request) failing on rustls' verdict `error`.
pub(crate) fn error(what: &str, error: &rustls::Error) -> LockError {
    TlsFailure::of_rustls(error).error(what, error, &ADVICE)
}

/// Finds out why a TLS connection to `endpoint` (`https://host:port`) was
/// closed by the server right after the handshake, which tonic reports only
/// as a broken pipe: one handshake with the same trust and client
/// certificate, then one read, which brings the server's alert if it
/// refused the client certificate (TLS 1.3 servers check it after the
/// handshake). `None` if nothing conclusive came within `timeout`.
pub(crate) async fn refusal(
    endpoint: &str,
    files: &TlsFiles,
    timeout: Duration,
) -> Option<rustls::Error> {
    let address = endpoint.strip_prefix("https://")?;
    let (host, _) = address.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(host.to_owned()).ok()?;
    let config = client_config(&files.read().await.ok()?).await?;
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(address).await.ok()?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let mut tls = match connector.connect(name, tcp).await {
            Ok(tls) => tls,
            Err(e) => return rustls_error(&e),
        };
        let mut byte = [0u8; 1];
        match tls.read(&mut byte).await {
            Err(e) => rustls_error(&e),
            Ok(_) => None,
        }
    };
    tokio::time::timeout(timeout, attempt).await.ok().flatten()
}

fn rustls_error(error: &std::io::Error) -> Option<rustls::Error> {
    error.get_ref()?.downcast_ref::<rustls::Error>().cloned()
}

/// A rustls client configuration like tonic's: platform roots plus the CA
/// file, the client certificate if any, HTTP/2 by ALPN.
async fn client_config(pem: &TlsPem) -> Option<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let platform = tokio::task::spawn_blocking(|| rustls_native_certs::load_native_certs().certs)
        .await
        .ok()?;
    roots.add_parsable_certificates(platform);
    if let Some(ca) = &pem.ca {
        roots.add_parsable_certificates(CertificateDer::pem_slice_iter(ca).flatten());
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .ok()?
    .with_root_certificates(roots);
    let mut config = match &pem.identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(cert).flatten().collect(),
                PrivateKeyDer::from_pem_slice(key).ok()?,
            )
            .ok()?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Some(config)
}
