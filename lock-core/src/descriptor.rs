//! What a backend crate tells a front end that opens lock URLs (the
//! `distlock` facade): its name, its URL schemes and how to connect.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::{LockClient, LockError};

/// The future a [`BackendDescriptor`] returns from [`connect`](BackendDescriptor::connect).
pub type Connecting<'a> = Pin<Box<dyn Future<Output = Result<LockClient, LockError>> + Send + 'a>>;

/// One backend as a front end that opens lock URLs sees it: a name, the URL
/// schemes the backend opens, and how to open a [`LockClient`] from such a
/// URL. Each backend crate exports its own as `DESCRIPTOR`
/// ([`MemoryLock::DESCRIPTOR`](crate::MemoryLock::DESCRIPTOR) for the
/// in-memory backend), so the scheme list lives next to the URL parser that
/// accepts it.
///
/// ```
/// use distlock_core::{BackendDescriptor, LockClient, MemoryLock};
///
/// /// A backend that opens `scratch://` URLs (here, a fresh in-memory server).
/// const SCRATCH: BackendDescriptor = BackendDescriptor::new("scratch", &["scratch"], |_url| {
///     Box::pin(async move { Ok(LockClient::new(MemoryLock::new())) })
/// });
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// assert!(SCRATCH.opens("SCRATCH"));
/// let client = SCRATCH.connect("scratch://").await?;
/// # drop(client);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct BackendDescriptor {
    name: &'static str,
    schemes: &'static [&'static str],
    connect: fn(&str) -> Connecting<'_>,
}

impl BackendDescriptor {
    /// A backend called `name` (for messages: "Redis", "PostgreSQL") that
    /// opens URLs whose scheme is one of `schemes` (lowercase, without
    /// `://`) with `connect`, which gets the whole URL.
    pub const fn new(
        name: &'static str,
        schemes: &'static [&'static str],
        connect: fn(&str) -> Connecting<'_>,
    ) -> Self {
        Self {
            name,
            schemes,
            connect,
        }
    }

    /// The backend's name, for messages.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The URL schemes the backend opens (lowercase, without `://`).
    pub const fn schemes(&self) -> &'static [&'static str] {
        self.schemes
    }

    /// Whether the backend opens URLs with `scheme` (without `://`; any
    /// case, as URL schemes are case-insensitive).
    pub fn opens(&self, scheme: &str) -> bool {
        self.schemes.iter().any(|s| s.eq_ignore_ascii_case(scheme))
    }

    /// Opens a client for `url`, one of the backend's schemes (the backend
    /// checks it: another scheme is a [`Config`](crate::ErrorKind::Config)
    /// error).
    pub fn connect<'a>(&self, url: &'a str) -> Connecting<'a> {
        (self.connect)(url)
    }
}

impl fmt::Debug for BackendDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendDescriptor")
            .field("name", &self.name)
            .field("schemes", &self.schemes)
            .finish_non_exhaustive()
    }
}
