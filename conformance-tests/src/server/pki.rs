//! A throwaway certificate authority for TLS test servers: generated at test
//! time (nothing secret is committed), written as PEM files a server and a
//! client URL can point at.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// A certificate and its private key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM, PKCS#8).
    pub key: PathBuf,
}

/// The files of a test PKI, all under one directory:
///
/// - `ca`: the CA certificate servers and clients trust;
/// - `server`: a server certificate for `localhost` and `127.0.0.1`, signed
///   by `ca`;
/// - `wrong_host`: a server certificate signed by `ca` for another name only
///   (`wrong.example`), to test host-name verification;
/// - `client`: a client certificate (CN `distlock`, also the user name for
///   certificate authentication) signed by `ca`;
/// - `other_ca` and `other_client`: a second, untrusted CA and a client
///   certificate it signed, to test that the wrong CA is refused.
///
/// ```no_run
/// let dir = std::env::temp_dir().join("pki-example");
/// let pki = distlock_conformance::server::TestPki::generate(&dir)?;
/// let url = format!("rediss://127.0.0.1:6380?tls_ca_file={}", pki.ca.display());
/// # let _ = url; Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The trusted CA's certificate (PEM).
    pub ca: PathBuf,
    /// The trusted CA's certificate and key.
    pub ca_pair: CertFiles,
    /// The server certificate for `localhost` / `127.0.0.1`.
    pub server: CertFiles,
    /// A server certificate for `wrong.example` only.
    pub wrong_host: CertFiles,
    /// A client certificate signed by the trusted CA.
    pub client: CertFiles,
    /// An untrusted CA's certificate (PEM).
    pub other_ca: PathBuf,
    /// A client certificate signed by the untrusted CA.
    pub other_client: CertFiles,
}

impl TestPki {
    /// Generates a fresh PKI into a new temporary directory of its own,
    /// removed once the test process has exited (the servers that read the
    /// files may outlive every value holding the paths).
    pub fn temporary() -> io::Result<TestPki> {
        let dir = std::env::temp_dir().join(crate::naming::unique_name("distlock-pki"));
        let pki = Self::generate(&dir)?;
        super::reap_when_process_exits(&dir, None)?;
        Ok(pki)
    }

    /// Generates a fresh PKI into `dir` (created if missing; private keys
    /// mode 0600, as PostgreSQL insists).
    pub fn generate(dir: &Path) -> io::Result<TestPki> {
        std::fs::create_dir_all(dir)?;
        let (ca_cert, ca_key) = ca("distlock test CA")?;
        let (other_cert, other_key) = ca("untrusted test CA")?;
        let ca_pair = write_pair(dir, "ca", &ca_cert.pem(), &ca_key.serialize_pem())?;
        let other_pair = write_pair(
            dir,
            "other-ca",
            &other_cert.pem(),
            &other_key.serialize_pem(),
        )?;
        let loopback = [
            SanType::DnsName("localhost".try_into().map_err(err)?),
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        ];
        let server = leaf(
            dir,
            "server",
            "localhost",
            &loopback,
            false,
            &ca_cert,
            &ca_key,
        )?;
        let wrong = [SanType::DnsName("wrong.example".try_into().map_err(err)?)];
        let wrong_host = leaf(
            dir,
            "wrong-host",
            "wrong.example",
            &wrong,
            false,
            &ca_cert,
            &ca_key,
        )?;
        let client = leaf(dir, "client", "distlock", &[], true, &ca_cert, &ca_key)?;
        let other_client = leaf(
            dir,
            "other-client",
            "distlock",
            &[],
            true,
            &other_cert,
            &other_key,
        )?;
        Ok(TestPki {
            ca: ca_pair.cert.clone(),
            ca_pair,
            server,
            wrong_host,
            client,
            other_ca: other_pair.cert,
            other_client,
        })
    }
}

fn err(e: rcgen::Error) -> io::Error {
    io::Error::other(format!("generating a test certificate: {e}"))
}

fn ca(name: &str) -> io::Result<(rcgen::Certificate, KeyPair)> {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.self_signed(&key).map_err(err)?;
    Ok((cert, key))
}

fn leaf(
    dir: &Path,
    name: &str,
    common_name: &str,
    sans: &[SanType],
    client: bool,
    ca_cert: &rcgen::Certificate,
    ca_key: &KeyPair,
) -> io::Result<CertFiles> {
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.subject_alt_names = sans.to_vec();
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![if client {
        ExtendedKeyUsagePurpose::ClientAuth
    } else {
        ExtendedKeyUsagePurpose::ServerAuth
    }];
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.signed_by(&key, ca_cert, ca_key).map_err(err)?;
    write_pair(dir, name, &cert.pem(), &key.serialize_pem())
}

fn write_pair(dir: &Path, name: &str, cert: &str, key: &str) -> io::Result<CertFiles> {
    let files = CertFiles {
        cert: dir.join(format!("{name}.crt")),
        key: dir.join(format!("{name}.key")),
    };
    std::fs::write(&files.cert, cert)?;
    std::fs::write(&files.key, key)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&files.key, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_file() {
        let dir = std::env::temp_dir().join(format!("distlock-pki-{}", std::process::id()));
        let pki = TestPki::generate(&dir).unwrap();
        for path in [
            &pki.ca,
            &pki.server.cert,
            &pki.server.key,
            &pki.wrong_host.cert,
            &pki.client.key,
            &pki.other_ca,
            &pki.other_client.cert,
        ] {
            let text = std::fs::read_to_string(path).unwrap();
            assert!(text.starts_with("-----BEGIN "), "{}", path.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
