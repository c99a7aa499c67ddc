//! etcd serving its clients over TLS (`etcds://`), optionally requiring
//! client certificates (`--client-cert-auth`), with certificates from a
//! [`TestPki`].

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use super::etcd::{member_command, port_file, wait_healthy, PEER_PORT_FILE, SINGLE};
use super::{free_port, CertFiles, ServerKind, TestPki};

/// File in the server directory that keeps the plain-HTTP metrics port
/// (`/health` for readiness; the client port speaks only TLS).
const METRICS_PORT_FILE: &str = "metrics-port";

/// etcd with `--cert-file`/`--key-file` on an `https://127.0.0.1:PORT`
/// client URL; with client authentication also `--client-cert-auth` and
/// `--trusted-ca-file` (the PKI's CA), as Kubernetes runs it.
///
/// Its [`url`](ServerKind::url) is
/// `etcds://127.0.0.1:PORT?tls_ca_file=CA` plus, with client
/// authentication, `&tls_cert_file=CLIENT&tls_key_file=CLIENT_KEY`. Set
/// `DISTLOCK_ETCDS_URL` to use an existing TLS cluster instead.
///
/// ```no_run
/// use std::sync::Arc;
/// use distlock_conformance::server::{EtcdTls, ServerProcess, TestPki};
/// let pki = TestPki::generate(&std::env::temp_dir().join("etcd-pki"))?;
/// let server = ServerProcess::start(Arc::new(EtcdTls::mutual(&pki)))?;
/// assert!(server.url().starts_with("etcds://127.0.0.1:"));
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pki: TestPki,
    server_cert: CertFiles,
    client_auth: bool,
}

impl EtcdTls {
    /// Mutual TLS: the PKI's server certificate, and client certificates
    /// signed by its CA required.
    pub fn mutual(pki: &TestPki) -> Self {
        Self {
            pki: pki.clone(),
            server_cert: pki.server.clone(),
            client_auth: true,
        }
    }

    /// Server-side TLS only: any client may connect.
    pub fn server_only(pki: &TestPki) -> Self {
        Self {
            client_auth: false,
            ..Self::mutual(pki)
        }
    }

    /// Serves `cert` instead of the PKI's server certificate (e.g.
    /// [`TestPki::wrong_host`] to test host-name verification).
    pub fn with_server_cert(mut self, cert: CertFiles) -> Self {
        self.server_cert = cert;
        self
    }

    /// The PKI the server's certificates come from.
    pub fn pki(&self) -> &TestPki {
        &self.pki
    }
}

impl ServerKind for EtcdTls {
    fn name(&self) -> &'static str {
        "etcd-tls"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_ETCDS_URL"
    }

    fn prepare(&self, dir: &Path) -> io::Result<()> {
        std::fs::write(dir.join(PEER_PORT_FILE), free_port()?.to_string())?;
        std::fs::write(dir.join(METRICS_PORT_FILE), free_port()?.to_string())
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        // Unreadable port files make etcd fail loudly on port 0.
        let peer = port_file(dir, PEER_PORT_FILE).unwrap_or(0);
        let metrics = port_file(dir, METRICS_PORT_FILE).unwrap_or(0);
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut command = member_command(
            "distlock",
            dir,
            &format!("https://127.0.0.1:{port}"),
            &peer_url,
            &format!("distlock={peer_url}"),
            SINGLE,
        );
        command
            .arg("--cert-file")
            .arg(&self.server_cert.cert)
            .arg("--key-file")
            .arg(&self.server_cert.key)
            .arg("--listen-metrics-urls")
            .arg(format!("http://127.0.0.1:{metrics}"));
        if self.client_auth {
            command
                .arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&self.pki.ca);
        }
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        let mut url = format!("etcds://{addr}?tls_ca_file={}", self.pki.ca.display());
        if self.client_auth {
            url.push_str(&format!(
                "&tls_cert_file={}&tls_key_file={}",
                self.pki.client.cert.display(),
                self.pki.client.key.display()
            ));
        }
        url
    }

    fn wait_ready(&self, dir: &Path, _port: u16) -> io::Result<()> {
        wait_healthy(port_file(dir, METRICS_PORT_FILE)?)
    }
}
