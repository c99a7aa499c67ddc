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
/// An error returned by a [`LockClient`](crate::LockClient) call names what
/// was being done: the backend, the operation and the key (see
/// [`with_context`](Self::with_context)); the backends' own messages leave
/// these out.
///
/// ```
/// use distlock_core::{ErrorKind, LockKey};
/// let err = LockKey::new("").unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::InvalidInput);
/// assert!(err.to_string().contains("empty"));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {}{message}", Lead(context.as_deref()))]
pub struct LockError {
    kind: ErrorKind,
    message: String,
    context: Option<Box<Context>>,
    #[source]
    source: Option<Source>,
}

/// What was being done when an error happened (boxed: errors stay small).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Context {
    backend: String,
    operation: String,
    key: String,
}

/// The context as the start of a message: `acquire "jobs/nightly" on redis: `,
/// or nothing.
struct Lead<'a>(Option<&'a Context>);

impl fmt::Display for Lead<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => Ok(()),
            Some(Context {
                backend,
                operation,
                key,
            }) => write!(f, "{operation} {key:?} on {backend}: "),
        }
    }
}

impl LockError {
    /// An error of `kind` with a message that tells the user what happened and
    /// what to do.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            context: None,
            source: None,
        }
    }

    /// Names what was being done: the `operation` (`acquire`, `release`,
    /// ...) on `key` at the `backend` (`redis`, ...). The message then reads
    /// `lock backend timed out: acquire "jobs/nightly" on redis: <message>`.
    /// An error that already has a context keeps it: the innermost call
    /// knows best what failed.
    ///
    /// ```
    /// use distlock_core::LockError;
    /// let err = LockError::timeout("no reply within 2s")
    ///     .with_context("redis", "acquire", "jobs/nightly")
    ///     .with_context("etcd", "release", "other");
    /// assert_eq!(err.to_string(), r#"lock backend timed out: acquire "jobs/nightly" on redis: no reply within 2s"#);
    /// assert_eq!(err.operation(), Some("acquire"));
    /// ```
    pub fn with_context(mut self, backend: &str, operation: &str, key: &str) -> Self {
        if self.context.is_none() {
            self.context = Some(Box::new(Context {
                backend: backend.to_owned(),
                operation: operation.to_owned(),
                key: key.to_owned(),
            }));
        }
        self
    }

    /// The backend's name, if the error has a context (see
    /// [`with_context`](Self::with_context)).
    pub fn backend(&self) -> Option<&str> {
        self.context.as_deref().map(|c| c.backend.as_str())
    }

    /// The operation that failed, if the error has a context.
    pub fn operation(&self) -> Option<&str> {
        self.context.as_deref().map(|c| c.operation.as_str())
    }

    /// The key the operation was on, if the error has a context.
    pub fn key(&self) -> Option<&str> {
        self.context.as_deref().map(|c| c.key.as_str())
    }

    /// Attaches the underlying cause (a driver error, an I/O error).
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// A copy for one of several callers that share this error (each lock
    /// of a failed batch): same kind, message and context; the source, which
    /// cannot be cloned, is kept as its text.
    ///
    /// ```
    /// use distlock_core::{ErrorKind, LockError};
    /// let shared = LockError::timeout("no reply within 2s").with_context("redis", "extend", "a");
    /// let copy = shared.duplicate();
    /// assert_eq!(copy.kind(), ErrorKind::Timeout);
    /// assert_eq!(copy.to_string(), shared.to_string());
    /// ```
    pub fn duplicate(&self) -> Self {
        Self {
            kind: self.kind,
            message: self.message.clone(),
            context: self.context.clone(),
            source: self.source.as_ref().map(|s| Source::from(s.to_string())),
        }
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

    /// The human-readable message, without the kind prefix and the context.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// True for failures where retrying later may help (unavailable, timeout).
    pub fn is_transient(&self) -> bool {
        matches!(self.kind, ErrorKind::Unavailable | ErrorKind::Timeout)
    }
}

/// The `what` of a request made inside a lock call, for
/// [`request_message`]: nothing, as the error [`LockClient`](crate::LockClient)
/// returns names the operation, the key and the backend already.
pub const IN_LOCK_CALL: &str = "";

/// A backend's message about a failed request: `"{what}: {message}"`
/// (`connecting to redis at ...: cannot reach the server`), or `message`
/// alone when `what` is empty ([`IN_LOCK_CALL`]): the error
/// [`LockClient`](crate::LockClient) returns names the operation, the key
/// and the backend already.
///
/// ```
/// use distlock_core::request_message;
/// assert_eq!(request_message("connecting", "refused"), "connecting: refused");
/// assert_eq!(request_message("", "refused"), "refused");
/// ```
pub fn request_message(what: &str, message: impl fmt::Display) -> String {
    if what.is_empty() {
        message.to_string()
    } else {
        format!("{what}: {message}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_without_context_is_kind_and_message() {
        let err = LockError::unavailable("cannot reach the server");
        assert_eq!(
            err.to_string(),
            "lock backend unavailable: cannot reach the server"
        );
        assert_eq!(
            (err.backend(), err.operation(), err.key()),
            (None, None, None)
        );
    }

    #[test]
    fn display_with_context_names_operation_key_and_backend() {
        let err = LockError::timeout("no reply within 2s").with_context(
            "redis",
            "acquire",
            "jobs/nightly",
        );
        assert_eq!(
            err.to_string(),
            r#"lock backend timed out: acquire "jobs/nightly" on redis: no reply within 2s"#
        );
        assert_eq!(err.backend(), Some("redis"));
        assert_eq!(err.operation(), Some("acquire"));
        assert_eq!(err.key(), Some("jobs/nightly"));
        assert_eq!(err.message(), "no reply within 2s");
        assert_eq!(err.kind(), ErrorKind::Timeout);
    }

    #[test]
    fn context_is_added_once() {
        let err = LockError::not_held("this lease no longer holds the lock")
            .with_context("etcd", "release", "a")
            .with_context("postgres", "extend", "b");
        assert_eq!(
            err.to_string(),
            r#"lock not held: release "a" on etcd: this lease no longer holds the lock"#
        );
        assert_eq!(err.to_string().matches(" on ").count(), 1, "{err}");
    }

    #[test]
    fn context_keeps_the_source() {
        let io = std::io::Error::other("refused");
        let err = LockError::unavailable("cannot reach the server")
            .with_source(io)
            .with_context("redis", "inspect", "k");
        let source = std::error::Error::source(&err).expect("source kept");
        assert_eq!(source.to_string(), "refused");
    }
}
