//! TLS settings of one URL: libpq's `sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey` (and sqlx's aliases), and the `tls_ca_file`, `tls_cert_file`,
//! `tls_key_file` every distlock backend takes.

use std::path::{Path, PathBuf};

use distlock_core::{LockError, LockUrl, TlsFiles};
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// Whether this build can speak TLS (the `tls` cargo feature).
const TLS_BUILT: bool = cfg!(feature = "tls");

/// One file a URL names, with the parameter that named it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct File {
    parameter: String,
    path: PathBuf,
}

/// A CA to trust besides the platform's roots.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Root {
    File(File),
    /// libpq's `sslrootcert=system`: the platform's roots only.
    System,
}

/// The TLS settings a URL gave (see [`PostgresConfig`](super::PostgresConfig)).
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsSettings {
    mode: Option<PgSslMode>,
    root: Option<Root>,
    cert: Option<File>,
    key: Option<File>,
}

/// Takes the first of `names` present in `url` as `(name, value)`,
/// refusing two of them at once.
fn take_one(
    url: &mut LockUrl,
    names: &[&'static str],
) -> Result<Option<(&'static str, String)>, LockError> {
    let mut found: Option<(&'static str, String)> = None;
    for name in names {
        if let Some(value) = url.take(name) {
            if let Some((first, _)) = &found {
                return Err(LockError::config(format!(
                    "URL parameters {first} and {name} both set the same TLS setting; give one"
                )));
            }
            found = Some((name, value));
        }
    }
    Ok(found)
}

/// Takes a file parameter (any of `names`).
fn take_file(url: &mut LockUrl, names: &[&'static str]) -> Result<Option<File>, LockError> {
    Ok(take_one(url, names)?.map(|(name, value)| File {
        parameter: name.to_owned(),
        path: value.into(),
    }))
}

/// Merges libpq's file parameter with the shared one, refusing both.
fn merge(
    libpq: Option<File>,
    shared: Option<&Path>,
    shared_name: &str,
) -> Result<Option<File>, LockError> {
    match (libpq, shared) {
        (Some(file), Some(_)) => Err(LockError::config(format!(
            "URL parameters {shared_name} and {} both name the same TLS file; give one ({shared_name} is distlock's name for {})",
            file.parameter, file.parameter
        ))),
        (Some(file), None) => Ok(Some(file)),
        (None, Some(path)) => Ok(Some(File {
            parameter: shared_name.to_owned(),
            path: path.to_path_buf(),
        })),
        (None, None) => Ok(None),
    }
}

impl TlsSettings {
    /// Takes the TLS parameters from `url`; `shared` holds the URL's
    /// `tls_*_file` parameters (already taken).
    pub(crate) fn take(url: &mut LockUrl, shared: &TlsFiles) -> Result<Self, LockError> {
        shared.validate()?;
        let mode = take_one(url, &["sslmode", "ssl-mode"])?
            .map(|(name, value)| {
                value.parse::<PgSslMode>().map_err(|_| {
                    LockError::config(format!(
                        "{name}={value:?} is not an SSL mode; use disable, allow, prefer, require, verify-ca or verify-full"
                    ))
                })
            })
            .transpose()?;
        let root = merge(
            take_file(url, &["sslrootcert", "ssl-root-cert", "ssl-ca"])?,
            shared.ca_file(),
            "tls_ca_file",
        )?
        .map(|file| {
            if file.path.as_os_str() == "system" {
                Root::System
            } else {
                Root::File(file)
            }
        });
        let cert = merge(
            take_file(url, &["sslcert", "ssl-cert"])?,
            shared.cert_file(),
            "tls_cert_file",
        )?;
        let key = merge(
            take_file(url, &["sslkey", "ssl-key"])?,
            shared.key_file(),
            "tls_key_file",
        )?;
        let settings = Self {
            mode,
            root,
            cert,
            key,
        };
        settings.validate()?;
        Ok(settings)
    }

    /// Whether the URL gave no TLS parameter at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.mode.is_none() && self.root.is_none() && self.cert.is_none() && self.key.is_none()
    }

    fn files(&self) -> impl Iterator<Item = (&File, &'static str)> {
        let root = match &self.root {
            Some(Root::File(file)) => Some((file, "CERTIFICATE")),
            _ => None,
        };
        root.into_iter()
            .chain(self.cert.iter().map(|f| (f, "CERTIFICATE")))
            .chain(self.key.iter().map(|f| (f, "PRIVATE KEY")))
    }

    /// The SSL mode the connection uses, if the URL decides it:
    ///
    /// - as given, except `require` with a CA file, which verifies the
    ///   server's certificate against it as `verify-ca` (libpq does the
    ///   same);
    /// - not given, with a CA file, a client certificate or
    ///   `sslrootcert=system`: `verify-full`, so naming a CA means checking
    ///   the server against it;
    /// - otherwise not decided here (sqlx's default: `PGSSLMODE`, else
    ///   `prefer`).
    fn effective_mode(&self) -> Option<PgSslMode> {
        let has_files = self.root.is_some() || self.cert.is_some();
        match self.mode {
            Some(PgSslMode::Require) if matches!(self.root, Some(Root::File(_))) => {
                Some(PgSslMode::VerifyCa)
            }
            Some(mode) => Some(mode),
            None if has_files => Some(PgSslMode::VerifyFull),
            None => None,
        }
    }

    fn validate(&self) -> Result<(), LockError> {
        match (&self.cert, &self.key) {
            (Some(cert), None) => {
                return Err(LockError::config(format!(
                    "{} is given without a private key (sslkey or tls_key_file); a client certificate needs its key",
                    cert.parameter
                )))
            }
            (None, Some(key)) => {
                return Err(LockError::config(format!(
                    "{} is given without a client certificate (sslcert or tls_cert_file); a private key needs its certificate",
                    key.parameter
                )))
            }
            _ => {}
        }
        let mode = self.effective_mode();
        let plaintext = match mode {
            Some(PgSslMode::Disable) => Some("disable"),
            Some(PgSslMode::Allow) => Some("allow"),
            _ => None,
        };
        if let (Some(plaintext), Some((file, _))) = (plaintext, self.files().next()) {
            return Err(LockError::config(format!(
                "{} is given with sslmode={plaintext}, which never uses TLS here; use sslmode=verify-full (or leave sslmode out) to use the file",
                file.parameter,
            )));
        }
        let needs_tls = self.root.is_some()
            || self.cert.is_some()
            || matches!(
                mode,
                Some(PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull)
            );
        if needs_tls && !TLS_BUILT {
            return Err(LockError::config(
                "this URL asks for TLS (sslmode=require/verify-ca/verify-full or a TLS file), but distlock was built without TLS: enable the `tls` cargo feature (of distlock, or of distlock-postgres)",
            ));
        }
        Ok(())
    }

    /// `options` with these settings.
    pub(crate) fn apply(&self, mut options: PgConnectOptions) -> PgConnectOptions {
        if let Some(mode) = self.effective_mode() {
            options = options.ssl_mode(mode);
        }
        if let Some(Root::File(file)) = &self.root {
            options = options.ssl_root_cert(&file.path);
        }
        if let Some(cert) = &self.cert {
            options = options.ssl_client_cert(&cert.path);
        }
        if let Some(key) = &self.key {
            options = options.ssl_client_key(&key.path);
        }
        options
    }

    /// Reads every file named, so a missing, unreadable or non-PEM one is
    /// a configuration error naming its parameter and path before any
    /// connection is tried. They are read again at every connect of
    /// distlock's own tasks and at each sweep for the pool (see
    /// [`loaded`](Self::loaded)), so renewed certificates are picked up.
    pub(crate) async fn check_files(&self) -> Result<(), LockError> {
        // The same reads and checks as a connect of distlock's own.
        self.loaded(PgConnectOptions::new()).await.map(drop)
    }

    /// `options` with these settings' files read now, held in memory: for
    /// a connection one of distlock's own tasks opens (the sweep, the
    /// listener), and for the pool's (at connect, then at each sweep).
    /// Given a path, sqlx reads the file on a blocking thread and panics
    /// if the runtime shuts down meanwhile (its join handle `expect`s);
    /// read here, that is an error.
    pub(crate) async fn loaded(
        &self,
        mut options: PgConnectOptions,
    ) -> Result<PgConnectOptions, LockError> {
        if let Some(Root::File(file)) = &self.root {
            let pem = TlsFiles::read_file(&file.parameter, &file.path, "CERTIFICATE").await?;
            options = options.ssl_root_cert_from_pem(pem);
        }
        if let Some(cert) = &self.cert {
            let pem = TlsFiles::read_file(&cert.parameter, &cert.path, "CERTIFICATE").await?;
            options = options.ssl_client_cert_from_pem(pem);
        }
        if let Some(key) = &self.key {
            let pem = TlsFiles::read_file(&key.parameter, &key.path, "PRIVATE KEY").await?;
            options = options.ssl_client_key_from_pem(pem);
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use distlock_core::ErrorKind;

    use super::*;

    fn settings(query: &str) -> Result<TlsSettings, LockError> {
        let mut url = LockUrl::parse(&format!("postgres://h/db?{query}"))?;
        let shared = url.take_client_options()?.tls().clone();
        let settings = TlsSettings::take(&mut url, &shared)?;
        url.finish()?;
        Ok(settings)
    }

    #[cfg(feature = "tls")]
    fn mode(query: &str) -> String {
        format!("{:?}", settings(query).unwrap().effective_mode())
    }

    fn config_error(query: &str, names: &[&str]) {
        let err = settings(query).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{query}: {err}");
        for name in names {
            assert!(err.to_string().contains(name), "{query}: {err}");
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn shared_and_libpq_names_map_to_one_setting() {
        let libpq = settings("sslrootcert=/ca.pem&sslcert=/c.pem&sslkey=/k.pem").unwrap();
        let shared =
            settings("tls_ca_file=/ca.pem&tls_cert_file=/c.pem&tls_key_file=/k.pem").unwrap();
        assert_eq!(mode("sslrootcert=/ca.pem"), "Some(VerifyFull)");
        assert_eq!(mode("tls_ca_file=/ca.pem"), "Some(VerifyFull)");
        let paths = |s: &TlsSettings| s.files().map(|(f, _)| f.path.clone()).collect::<Vec<_>>();
        assert_eq!(paths(&libpq), paths(&shared));
        assert!(settings("").unwrap().is_empty());
        assert_eq!(mode("sslmode=disable"), "Some(Disable)");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn modes_follow_libpq() {
        assert_eq!(mode("sslmode=require"), "Some(Require)");
        assert_eq!(mode("sslmode=require&sslrootcert=/ca"), "Some(VerifyCa)");
        assert_eq!(mode("sslmode=verify-ca&tls_ca_file=/ca"), "Some(VerifyCa)");
        assert_eq!(mode("sslrootcert=system"), "Some(VerifyFull)");
        assert_eq!(mode("ssl-mode=prefer"), "Some(Prefer)");
        assert_eq!(mode(""), "None");
    }

    #[test]
    fn contradictions_are_refused_naming_the_parameters() {
        config_error(
            "tls_ca_file=/a&sslrootcert=/b",
            &["tls_ca_file", "sslrootcert"],
        );
        config_error("sslrootcert=/a&ssl-ca=/b", &["sslrootcert", "ssl-ca"]);
        config_error(
            "tls_cert_file=/c&tls_key_file=/k&sslcert=/c",
            &["tls_cert_file", "sslcert"],
        );
        config_error("sslcert=/c", &["sslcert", "key"]);
        config_error("tls_key_file=/k", &["tls_key_file"]);
        config_error(
            "sslmode=disable&tls_ca_file=/a",
            &["tls_ca_file", "disable"],
        );
        config_error("sslmode=sometimes", &["sslmode", "sometimes"]);
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn without_the_tls_feature_tls_urls_name_it() {
        config_error("sslmode=verify-full", &["`tls` cargo feature"]);
        config_error("tls_ca_file=/a", &["`tls` cargo feature"]);
        assert!(settings("sslmode=prefer").is_ok());
    }

    #[cfg(feature = "tls")]
    #[tokio::test]
    async fn loaded_reads_the_files_at_each_call() {
        let dir = std::env::temp_dir().join(format!("distlock-pg-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        let pem = "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n";
        std::fs::write(&ca, pem).unwrap();
        let tls = settings(&format!("sslrootcert={}", ca.display())).unwrap();
        assert!(tls.loaded(PgConnectOptions::new()).await.is_ok());
        // Read again, not remembered: a file gone since is an error
        // naming its parameter.
        std::fs::remove_file(&ca).unwrap();
        let err = tls.loaded(PgConnectOptions::new()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        assert!(err.to_string().contains("sslrootcert"), "{err}");
        let _ = std::fs::remove_dir(&dir);
        // No files named: nothing read.
        assert!(TlsSettings::default()
            .loaded(PgConnectOptions::new())
            .await
            .is_ok());
    }
}
