//! The redis server over TLS only: `redis-server --port 0 --tls-port P`
//! with the certificates of a [`TestPki`].

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use super::{CertFiles, ServerKind, TestPki};

/// Whether a [`RedisTls`] server asks clients for a certificate
/// (`tls-auth-clients`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisTlsAuth {
    /// No client certificate is asked for (`no`).
    Off,
    /// A client certificate is checked if sent (`optional`).
    Optional,
    /// Connections without a certificate signed by the CA are refused
    /// (`yes`); the [`url`](ServerKind::url) then carries the PKI's client
    /// certificate.
    Required,
}

/// A `redis-server` that accepts TLS connections only (its plaintext port
/// is off), on 127.0.0.1, persistence off, serving the PKI's `server`
/// certificate (or another one, see [`serve`](Self::serve)) and trusting
/// its CA for client certificates.
///
/// Its [`url`](ServerKind::url) is
/// `rediss://127.0.0.1:PORT/?tls_ca_file=CA` (plus `tls_cert_file` and
/// `tls_key_file` when client certificates are [`Required`](RedisTlsAuth::Required)).
///
/// ```no_run
/// use std::sync::Arc;
/// use distlock_conformance::server::{RedisTlsAuth, RedisTls, ServerProcess, TestPki};
/// let pki = TestPki::generate(&std::env::temp_dir().join("redis-tls-example"))?;
/// let server = ServerProcess::start(Arc::new(RedisTls::new(pki).client_auth(RedisTlsAuth::Required)))?;
/// assert!(server.url().starts_with("rediss://127.0.0.1:"));
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RedisTls {
    pki: TestPki,
    served: CertFiles,
    client_auth: RedisTlsAuth,
}

impl RedisTls {
    /// A server with `pki`'s server certificate, not asking for client
    /// certificates.
    pub fn new(pki: TestPki) -> Self {
        Self {
            served: pki.server.clone(),
            pki,
            client_auth: RedisTlsAuth::Off,
        }
    }

    /// Sets whether client certificates are asked for.
    pub fn client_auth(mut self, client_auth: RedisTlsAuth) -> Self {
        self.client_auth = client_auth;
        self
    }

    /// Serves `certificate` instead of the PKI's server certificate (e.g.
    /// its `wrong_host` one, to test host-name verification).
    pub fn serve(mut self, certificate: CertFiles) -> Self {
        self.served = certificate;
        self
    }

    /// The certificates.
    pub fn pki(&self) -> &TestPki {
        &self.pki
    }
}

impl ServerKind for RedisTls {
    fn name(&self) -> &'static str {
        "redis-tls"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_REDIS_TLS_URL"
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let auth = match self.client_auth {
            RedisTlsAuth::Off => "no",
            RedisTlsAuth::Optional => "optional",
            RedisTlsAuth::Required => "yes",
        };
        let mut command = Command::new("redis-server");
        command
            .args(["--port", "0", "--tls-port"])
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .arg("--tls-cert-file")
            .arg(&self.served.cert)
            .arg("--tls-key-file")
            .arg(&self.served.key)
            .arg("--tls-ca-cert-file")
            .arg(&self.pki.ca)
            .args(["--tls-auth-clients", auth]);
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        let mut url = format!("rediss://{addr}/?tls_ca_file={}", self.pki.ca.display());
        if self.client_auth == RedisTlsAuth::Required {
            url.push_str(&format!(
                "&tls_cert_file={}&tls_key_file={}",
                self.pki.client.cert.display(),
                self.pki.client.key.display()
            ));
        }
        url
    }
}
