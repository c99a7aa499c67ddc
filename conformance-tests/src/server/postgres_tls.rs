//! PostgreSQL that accepts TLS connections only: [`Postgres`] with
//! `ssl = on`, certificates from a throwaway [`TestPki`] and a
//! `pg_hba.conf` of `hostssl` lines only (one of them requiring a client
//! certificate).

use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

use super::postgres::{SUPERUSER, SUPERUSER_PASSWORD};
use super::{CertFiles, Postgres, ServerKind, TestPki};
use crate::url::percent_encode;

/// The role that logs in with the PKI's client certificate (its common
/// name), under `clientcert=verify-full`.
pub const CERT_USER: &str = "distlock";

/// A PostgreSQL server reachable over TLS only, or the one named by
/// `DISTLOCK_POSTGRES_TLS_URL`.
///
/// `pg_hba.conf` (plaintext connections are refused: no `host` line):
///
/// ```text
/// hostssl all postgres 127.0.0.1/32 trust                          # server-verified TLS
/// hostssl all distlock 127.0.0.1/32 trust clientcert=verify-full   # mutual TLS
/// ```
///
/// The server presents the PKI's `server` certificate (for `localhost` and
/// `127.0.0.1`) unless [`with_server_cert`](Self::with_server_cert) says
/// otherwise, and trusts client certificates signed by the PKI's CA
/// (`ssl_ca_file`). The superuser `distlock` ([`CERT_USER`]) exists for
/// the mutual case. The PKI is generated when the kind is made
/// ([`TestPki::temporary`]).
///
/// Its [`url`](ServerKind::url) uses libpq's parameters:
/// `postgres://postgres:postgres@ADDR/postgres?sslmode=verify-full&sslrootcert=CA`;
/// [`mutual`](Self::mutual) makes it the client-certificate URL with the
/// parameters every distlock backend shares instead:
/// `postgres://distlock@ADDR/postgres?tls_ca_file=CA&tls_cert_file=CERT&tls_key_file=KEY`.
///
/// ```no_run
/// use std::sync::Arc;
/// use distlock_conformance::server::{PostgresTls, ServerProcess};
/// let kind = PostgresTls::new()?;
/// let server = ServerProcess::start(Arc::new(kind.clone()))?;
/// assert!(server.url().contains("sslmode=verify-full"));
/// let wrong_ca = kind.url_with_ca(server.addr(), &kind.pki().other_ca);
/// # let _ = wrong_ca; Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PostgresTls {
    pki: TestPki,
    server_cert: CertFiles,
    mutual: bool,
}

impl PostgresTls {
    /// A TLS-only server kind with a freshly generated PKI.
    pub fn new() -> io::Result<Self> {
        let pki = TestPki::temporary()?;
        Ok(Self {
            server_cert: pki.server.clone(),
            pki,
            mutual: false,
        })
    }

    /// Presents `cert` instead of the PKI's server certificate (e.g.
    /// [`TestPki::wrong_host`], to test host-name verification).
    pub fn with_server_cert(mut self, cert: CertFiles) -> Self {
        self.server_cert = cert;
        self
    }

    /// Makes [`url`](ServerKind::url) the mutual-TLS URL (see the type's
    /// docs).
    pub fn mutual(mut self) -> Self {
        self.mutual = true;
        self
    }

    /// The certificates: the CA clients trust, the client certificate, an
    /// untrusted CA and a client certificate it signed.
    pub fn pki(&self) -> &TestPki {
        &self.pki
    }

    /// The superuser's URL trusting `ca` (`sslmode=verify-full`).
    pub fn url_with_ca(&self, addr: SocketAddr, ca: &Path) -> String {
        format!(
            "postgres://{SUPERUSER}:{SUPERUSER_PASSWORD}@{addr}/postgres?sslmode=verify-full&sslrootcert={}",
            percent_encode(&ca.to_string_lossy())
        )
    }

    /// The [`CERT_USER`]'s URL presenting `client` and trusting the PKI's
    /// CA, with the parameters every backend shares.
    pub fn mutual_url(&self, addr: SocketAddr, client: &CertFiles) -> String {
        format!(
            "postgres://{CERT_USER}@{addr}/postgres?tls_ca_file={}&tls_cert_file={}&tls_key_file={}",
            percent_encode(&self.pki().ca.to_string_lossy()),
            percent_encode(&client.cert.to_string_lossy()),
            percent_encode(&client.key.to_string_lossy())
        )
    }

    /// Creates [`CERT_USER`] in the new cluster (single-user mode, before
    /// the server first starts).
    fn create_cert_user(dir: &Path) -> io::Result<()> {
        let mut command = Command::new(Postgres::program("postgres"));
        command
            .arg("--single")
            .arg("-D")
            .arg(dir.join("data"))
            .arg("postgres")
            .current_dir(dir)
            .env("LC_ALL", "C")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Postgres::as_user(&mut command)?;
        let mut child = command.spawn()?;
        if let Some(mut stdin) = child.stdin.take() {
            writeln!(stdin, "CREATE ROLE {CERT_USER} LOGIN SUPERUSER;")?;
        }
        let output = child.wait_with_output()?;
        let text = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() || text.contains("ERROR") {
            return Err(io::Error::other(format!(
                "creating the role {CERT_USER} failed ({}): {text}",
                output.status
            )));
        }
        Ok(())
    }
}

impl ServerKind for PostgresTls {
    fn name(&self) -> &'static str {
        "postgres-tls"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_POSTGRES_TLS_URL"
    }

    fn prepare(&self, dir: &Path) -> io::Result<()> {
        Postgres.prepare(dir)?;
        Self::create_cert_user(dir)?;
        let tls = dir.join("tls");
        std::fs::create_dir_all(&tls)?;
        Postgres::give(&tls, 0o700)?;
        for (from, name, mode) in [
            (&self.server_cert.cert, "server.crt", 0o644),
            (&self.server_cert.key, "server.key", 0o600),
            (&self.pki().ca, "ca.crt", 0o644),
        ] {
            let to = tls.join(name);
            std::fs::copy(from, &to)?;
            // PostgreSQL refuses a key readable by others or owned by
            // another user.
            Postgres::give(&to, mode)?;
        }
        std::fs::write(
            dir.join("data").join("pg_hba.conf"),
            format!(
                "hostssl all {SUPERUSER} 127.0.0.1/32 trust\n\
                 hostssl all {CERT_USER} 127.0.0.1/32 trust clientcert=verify-full\n"
            ),
        )
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let tls = dir.join("tls");
        let mut command = Postgres.command(dir, port);
        command.args(["-c", "ssl=on"]);
        for (setting, file) in [
            ("ssl_cert_file", "server.crt"),
            ("ssl_key_file", "server.key"),
            ("ssl_ca_file", "ca.crt"),
        ] {
            command
                .arg("-c")
                .arg(format!("{setting}={}", tls.join(file).display()));
        }
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        if self.mutual {
            self.mutual_url(addr, &self.pki().client)
        } else {
            self.url_with_ca(addr, &self.pki().ca)
        }
    }

    fn wait_ready(&self, dir: &Path, port: u16) -> io::Result<()> {
        // pg_isready's default sslmode (prefer) uses TLS.
        Postgres.wait_ready(dir, port)
    }
}
