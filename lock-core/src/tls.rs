//! The TLS files every backend accepts, read once with errors that name the
//! file and the parameter.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::LockError;

/// TLS files for a backend client, from the URL parameters every backend
/// takes (`tls_ca_file=PATH`, `tls_cert_file=PATH`, `tls_key_file=PATH`),
/// so one deployment recipe works for all of them.
///
/// - `ca_file`: PEM certificates to trust *in addition to* the platform's
///   roots (a private CA);
/// - `cert_file` + `key_file`: a PEM client certificate and its private key
///   (mutual TLS); one without the other is a configuration error.
///
/// ```
/// use distlock_core::TlsFiles;
/// let only_cert = TlsFiles { cert_file: Some("client.pem".into()), ..TlsFiles::default() };
/// assert!(only_cert.validate().is_err());
/// assert!(TlsFiles::default().is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// Extra trusted CA certificates (PEM).
    pub ca_file: Option<PathBuf>,
    /// The client certificate (PEM), for mutual TLS.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key_file: Option<PathBuf>,
}

/// The contents of [`TlsFiles`], read and checked to be PEM.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TlsPem {
    /// Extra trusted CA certificates.
    pub ca: Option<Vec<u8>>,
    /// The client certificate and its key, if mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for TlsPem {
    // The private key never reaches a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsPem")
            .field("ca", &self.ca.as_ref().map(Vec::len))
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

impl TlsFiles {
    /// No file given.
    pub fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.cert_file.is_none() && self.key_file.is_none()
    }

    /// Refuses a client certificate without its key or a key without its
    /// certificate.
    pub fn validate(&self) -> Result<(), LockError> {
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => Err(LockError::config(
                "tls_cert_file is given without tls_key_file; a client certificate needs its private key",
            )),
            (None, Some(_)) => Err(LockError::config(
                "tls_key_file is given without tls_cert_file; a private key needs its client certificate",
            )),
            _ => Ok(()),
        }
    }

    /// Reads the files. A missing, unreadable or non-PEM file is an
    /// [`ErrorKind::Config`](crate::ErrorKind) error naming the parameter
    /// and the path.
    pub async fn read(&self) -> Result<TlsPem, LockError> {
        self.validate()?;
        let ca = match &self.ca_file {
            Some(path) => Some(read_pem("tls_ca_file", path, "CERTIFICATE").await?),
            None => None,
        };
        let identity = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Some((
                read_pem("tls_cert_file", cert, "CERTIFICATE").await?,
                read_pem("tls_key_file", key, "PRIVATE KEY").await?,
            )),
            _ => None,
        };
        Ok(TlsPem { ca, identity })
    }
}

impl TlsFiles {
    /// Reads one PEM file named by a backend's own URL parameter (e.g.
    /// PostgreSQL's `sslrootcert`) with the same checks and errors as
    /// [`read`](Self::read): a missing, unreadable or non-PEM file is an
    /// [`ErrorKind::Config`](crate::ErrorKind) error naming `parameter` and
    /// the path. `label` is the PEM block label expected (`CERTIFICATE`, or
    /// `PRIVATE KEY`, which also covers RSA and EC keys).
    pub async fn read_file(
        parameter: &str,
        path: &Path,
        label: &str,
    ) -> Result<Vec<u8>, LockError> {
        read_pem(parameter, path, label).await
    }
}

/// Reads `path` and checks it holds a PEM block whose label ends with
/// `label` (`CERTIFICATE`, `PRIVATE KEY` covers PKCS#8, RSA and EC keys).
async fn read_pem(parameter: &str, path: &Path, label: &str) -> Result<Vec<u8>, LockError> {
    let bytes = tokio::fs::read(path).await.map_err(|e| {
        LockError::config(format!("{parameter}: cannot read {}: {e}", path.display()))
            .with_source(e)
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let has_block = text.lines().any(|line| {
        line.trim()
            .strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|found| found.ends_with(label))
    });
    if !has_block {
        return Err(LockError::config(format!(
            "{parameter}: {} holds no PEM {label} (expected a -----BEGIN ...{label}----- block)",
            path.display()
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[tokio::test]
    async fn missing_and_wrong_files_name_the_parameter() {
        let dir = std::env::temp_dir().join(format!("distlock-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let not_pem = dir.join("not.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        let cert = dir.join("cert.pem");
        std::fs::write(
            &cert,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .unwrap();

        let missing = TlsFiles {
            ca_file: Some(dir.join("absent.pem")),
            ..TlsFiles::default()
        };
        let err = missing.read().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("tls_ca_file"), "{err}");
        assert!(err.to_string().contains("absent.pem"), "{err}");

        let wrong = TlsFiles {
            cert_file: Some(cert.clone()),
            key_file: Some(not_pem),
            ..TlsFiles::default()
        };
        let err = wrong.read().await.unwrap_err();
        assert!(err.to_string().contains("tls_key_file"), "{err}");
        assert!(err.to_string().contains("PRIVATE KEY"), "{err}");

        let ok = TlsFiles {
            ca_file: Some(cert),
            ..TlsFiles::default()
        };
        let pem = ok.read().await.unwrap();
        assert!(pem.ca.is_some() && pem.identity.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
