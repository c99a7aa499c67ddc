//! The one error type of distlock, with kinds a caller can match on.

use std::fmt;

/// What kind of failure a [`LockError`] is. Match on this, not on messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller passed something invalid (bad key, zero TTL, a lease from
    /// another client). Retrying the same call cannot succeed.
    InvalidInput,
    /// The lease is no longer held: it was released, it expired, or another
    /// owner holds the key now.
    NotHeld,
    /// The lock server could not be reached or refused the connection.
    /// Retrying later may succeed.
    Unavailable,
    /// A network operation did not finish within its configured timeout
    /// (whether it took effect on the server is unknown), or a lock was
    /// granted too late to use: already inside its stop margin, so it was
    /// released unused (see [`LockOptions::with_stop_margin`](crate::LockOptions::with_stop_margin)).
    Timeout,
    /// A value at a lock key was not written by distlock (or was edited into an
    /// impossible state). It is reported and never overwritten.
    Corrupted,
    /// The backend is misconfigured (bad URL, wrong credentials or
    /// permissions, missing cargo feature). Retrying cannot help.
    Config,
    /// The backend does not implement this optional operation (see
    /// [`LockBackend::admin`](crate::LockBackend::admin)).
    Unsupported,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::NotHeld => "lock not held",
            ErrorKind::Unavailable => "lock backend unavailable",
            ErrorKind::Timeout => "lock backend timed out",
            ErrorKind::Corrupted => "corrupted lock data",
            ErrorKind::Config => "configuration error",
            ErrorKind::Unsupported => "operation not supported by this backend",
        })
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error from any distlock operation.
///
/// ```
/// use distlock_core::{ErrorKind, LockKey};
/// let err = LockKey::new("").unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::InvalidInput);
/// assert!(err.to_string().contains("empty"));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct LockError {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<Source>,
}

impl LockError {
    /// An error of `kind` with a message that tells the user what happened and
    /// what to do.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying cause (a driver error, an I/O error).
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Shorthand for [`ErrorKind::InvalidInput`].
    pub fn invalid_input(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    /// Shorthand for [`ErrorKind::NotHeld`].
    pub fn not_held(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotHeld, message)
    }

    /// Shorthand for [`ErrorKind::Unavailable`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// Shorthand for [`ErrorKind::Timeout`].
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Timeout, message)
    }

    /// Shorthand for [`ErrorKind::Corrupted`].
    pub fn corrupted(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Corrupted, message)
    }

    /// Shorthand for [`ErrorKind::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }

    /// Shorthand for [`ErrorKind::Config`].
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }

    /// The kind, for matching.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The human-readable message, without the kind prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// True for failures where retrying later may help (unavailable, timeout).
    pub fn is_transient(&self) -> bool {
        matches!(self.kind, ErrorKind::Unavailable | ErrorKind::Timeout)
    }
}
