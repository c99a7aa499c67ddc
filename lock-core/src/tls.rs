//! TLS, once for every backend: the files every backend accepts (read with
//! errors that name the file and the parameter), and what a failed TLS
//! connection means ([`TlsFailure`]) in words that say what to change.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::LockError;

/// TLS files for a backend client, from the URL parameters every backend
/// takes (`tls_ca_file=PATH`, `tls_cert_file=PATH`, `tls_key_file=PATH`),
/// so one deployment recipe works for all of them.
///
/// - [`ca_file`](Self::ca_file): PEM certificates to trust *in addition
///   to* the platform's roots (a private CA);
/// - [`cert_file`](Self::cert_file) + [`key_file`](Self::key_file): a PEM
///   client certificate and its private key (mutual TLS); one without the
///   other is a configuration error.
///
/// ```
/// use distlock_core::TlsFiles;
/// let only_cert = TlsFiles::default().with_cert_file("client.pem");
/// assert!(only_cert.validate().is_err());
/// let mutual = only_cert.with_key_file("client.key");
/// assert_eq!(mutual.key_file(), Some(std::path::Path::new("client.key")));
/// assert!(mutual.validate().is_ok());
/// assert!(TlsFiles::default().is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    ca_file: Option<PathBuf>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
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
    /// Extra trusted CA certificates (PEM), `tls_ca_file`.
    pub fn ca_file(&self) -> Option<&Path> {
        self.ca_file.as_deref()
    }

    /// The client certificate (PEM), for mutual TLS, `tls_cert_file`.
    pub fn cert_file(&self) -> Option<&Path> {
        self.cert_file.as_deref()
    }

    /// The client certificate's private key (PEM), `tls_key_file`.
    pub fn key_file(&self) -> Option<&Path> {
        self.key_file.as_deref()
    }

    /// Sets the [CA file](Self::ca_file).
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Sets the [client certificate file](Self::cert_file).
    pub fn with_cert_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.cert_file = Some(path.into());
        self
    }

    /// Sets the [client key file](Self::key_file).
    pub fn with_key_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.key_file = Some(path.into());
        self
    }

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

/// Why a TLS connection failed, as far as a client can tell. Each backend
/// finds it in its driver's error ([`of_rustls`](Self::of_rustls) where the
/// driver keeps rustls' verdict, [`of_text`](Self::of_text) where only its
/// text survives); the wording and the advice are written here, once.
///
/// ```
/// use distlock_core::{ErrorKind, TlsAdvice, TlsFailure};
/// let advice = TlsAdvice {
///     server: "redis",
///     trust: "tls_ca_file=PATH",
///     client_certificate: "tls_cert_file=PATH and tls_key_file=PATH",
///     plaintext: "use redis:// instead of rediss://",
/// };
/// let failure = TlsFailure::of_text("invalid peer certificate: UnknownIssuer").unwrap();
/// assert_eq!(failure, TlsFailure::Untrusted);
/// let err = failure.error("connecting", "UnknownIssuer", &advice);
/// assert_eq!(err.kind(), ErrorKind::Config);
/// assert!(err.to_string().contains("tls_ca_file=PATH"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsFailure {
    /// The server's certificate is not signed by a CA the client trusts.
    Untrusted,
    /// The server's certificate does not name the host connected to.
    HostName,
    /// The server's certificate has expired or is not valid yet.
    NotValidNow,
    /// The server refused the client's certificate, or its absence.
    ClientRefused,
    /// The server answered with something other than TLS.
    NotTls,
    /// The handshake failed otherwise.
    Handshake,
}

/// What a backend's users change for each [`TlsFailure`]: the server's name
/// and the URL parameters or scheme that fix it.
#[derive(Debug, Clone, Copy)]
pub struct TlsAdvice {
    /// The server, as users call it (`redis`, `etcd`, `PostgreSQL`).
    pub server: &'static str,
    /// How to trust the CA that signed the server's certificate.
    pub trust: &'static str,
    /// How to give a client certificate and its key.
    pub client_certificate: &'static str,
    /// What to do if the server does not serve TLS on that port.
    pub plaintext: &'static str,
}

impl TlsFailure {
    /// The failure rustls' verdict on a handshake means.
    #[cfg(feature = "tls")]
    pub fn of_rustls(error: &rustls::Error) -> Self {
        use rustls::{AlertDescription as Alert, CertificateError as Cert, Error as Tls};
        match error {
            Tls::InvalidCertificate(
                Cert::NotValidForName | Cert::NotValidForNameContext { .. },
            ) => Self::HostName,
            Tls::InvalidCertificate(
                Cert::Expired
                | Cert::ExpiredContext { .. }
                | Cert::NotValidYet
                | Cert::NotValidYetContext { .. },
            ) => Self::NotValidNow,
            Tls::InvalidCertificate(_) => Self::Untrusted,
            Tls::AlertReceived(
                Alert::CertificateRequired
                | Alert::BadCertificate
                | Alert::UnknownCA
                | Alert::CertificateUnknown
                | Alert::UnsupportedCertificate
                | Alert::CertificateExpired
                | Alert::CertificateRevoked
                | Alert::AccessDenied,
            ) => Self::ClientRefused,
            Tls::InvalidMessage(_) => Self::NotTls,
            _ => Self::Handshake,
        }
    }

    /// The failure a driver's error text shows, for drivers that turn
    /// rustls' verdict into text (its variant names survive, e.g. "invalid
    /// peer certificate: UnknownIssuer"); `None` if the text shows no TLS
    /// failure.
    pub fn of_text(text: &str) -> Option<Self> {
        let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
        if has(&["NotValidForName", "not valid for name"]) {
            Some(Self::HostName)
        } else if has(&[
            "CertificateRequired",
            "certificate required",
            "BadCertificate",
            "bad certificate",
            "UnknownCA",
            "unknown ca",
            "CertificateUnknown",
            "CertificateExpired",
            "CertificateRevoked",
            "UnsupportedCertificate",
            "AccessDenied",
        ]) {
            Some(Self::ClientRefused)
        } else if has(&[
            "Expired",
            "NotValidYet",
            "certificate expired",
            "not valid yet",
        ]) {
            Some(Self::NotValidNow)
        } else if has(&["invalid peer certificate", "UnknownIssuer", "BadSignature"]) {
            Some(Self::Untrusted)
        } else if has(&[
            "InvalidContentType",
            "corrupt message",
            "InvalidMessage",
            "received corrupt",
        ]) {
            Some(Self::NotTls)
        } else {
            None
        }
    }

    /// The [`ErrorKind::Config`](crate::ErrorKind) error for `what` (the
    /// request, e.g. "connecting to 127.0.0.1:6380"; see
    /// [`request_message`](crate::request_message)) failing this way:
    /// what the failure is, `detail` (the driver's words), and what to
    /// change. Trying again cannot help, hence a configuration error.
    pub fn error(self, what: &str, detail: impl fmt::Display, advice: &TlsAdvice) -> LockError {
        let TlsAdvice {
            server,
            trust,
            client_certificate,
            plaintext,
        } = advice;
        LockError::config(crate::request_message(what, match self {
            Self::Untrusted => format!(
                "TLS certificate problem: the {server} server's certificate is not trusted: \
                 it is not signed by a CA this client trusts ({detail}); give the CA that signed it with {trust}"
            ),
            Self::HostName => format!(
                "TLS certificate problem: the {server} server's certificate is not valid for the host name in the URL ({detail}); \
                 connect with a host name or address its certificate lists"
            ),
            Self::NotValidNow => format!(
                "TLS certificate problem: the {server} server's certificate is not valid now ({detail}); \
                 renew it, or check the clocks"
            ),
            Self::ClientRefused => format!(
                "TLS certificate problem: the {server} server refused this client's certificate, or its absence ({detail}); \
                 it requires a client certificate signed by a CA it trusts: give one with {client_certificate}"
            ),
            Self::NotTls => format!(
                "TLS connection problem: the {server} server did not answer in TLS ({detail}); \
                 if it does not serve TLS on this port, {plaintext}"
            ),
            Self::Handshake => format!(
                "TLS connection problem: the TLS handshake with the {server} server failed ({detail})"
            ),
        }))
    }
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

    #[test]
    fn driver_texts_are_classified() {
        for (text, failure) in [
            (
                "invalid peer certificate: UnknownIssuer",
                TlsFailure::Untrusted,
            ),
            (
                "invalid peer certificate: NotValidForName",
                TlsFailure::HostName,
            ),
            ("invalid peer certificate: Expired", TlsFailure::NotValidNow),
            (
                "received fatal alert: CertificateRequired",
                TlsFailure::ClientRefused,
            ),
            (
                "received corrupt message of type InvalidContentType",
                TlsFailure::NotTls,
            ),
        ] {
            assert_eq!(TlsFailure::of_text(text), Some(failure), "{text}");
        }
        assert_eq!(TlsFailure::of_text("connection refused"), None);
    }

    #[cfg(feature = "tls")]
    #[test]
    fn rustls_verdicts_are_classified() {
        use rustls::{AlertDescription, CertificateError, Error};
        let cases = [
            (
                Error::InvalidCertificate(CertificateError::UnknownIssuer),
                TlsFailure::Untrusted,
            ),
            (
                Error::InvalidCertificate(CertificateError::NotValidForName),
                TlsFailure::HostName,
            ),
            (
                Error::InvalidCertificate(CertificateError::Expired),
                TlsFailure::NotValidNow,
            ),
            (
                Error::AlertReceived(AlertDescription::UnknownCA),
                TlsFailure::ClientRefused,
            ),
            (
                Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType),
                TlsFailure::NotTls,
            ),
            (Error::HandshakeNotComplete, TlsFailure::Handshake),
        ];
        for (error, failure) in cases {
            assert_eq!(TlsFailure::of_rustls(&error), failure, "{error:?}");
            // The text a driver makes of the verdict says the same.
            if failure != TlsFailure::Handshake {
                assert_eq!(
                    TlsFailure::of_text(&format!("{error} {error:?}")),
                    Some(failure)
                );
            }
        }
    }
}
