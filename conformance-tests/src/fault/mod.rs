//! Fault injection for the `fault::` cases: a TCP [`Proxy`] that drops or
//! black-holes one client's connections, a lock holder in a child process
//! ([`HolderProcess`]) that can be SIGKILLed, and short client timeouts
//! ([`with_timeouts`]). Server kill and restart are on
//! [`ServerProcess`](crate::server::ServerProcess); a case starts its own
//! with [`TestContext::start_server`](crate::TestContext::start_server) so
//! the shared server other cases use is never disturbed.

pub mod holder;
mod proxy;

use std::time::Duration;

pub use self::holder::{HolderProcess, HOLDER_ENV};
pub use self::proxy::Proxy;

/// `url` with our `connect_timeout_ms` and `operation_timeout_ms` query
/// parameters appended (after `?` or `&`, whichever fits), so a client
/// behind a fault notices it quickly.
///
/// ```
/// use std::time::Duration;
/// use conformance_tests::fault::with_timeouts;
/// let ms = Duration::from_millis;
/// assert_eq!(
///     with_timeouts("redis://127.0.0.1:1", ms(500), ms(800)),
///     "redis://127.0.0.1:1?connect_timeout_ms=500&operation_timeout_ms=800"
/// );
/// assert_eq!(
///     with_timeouts("redis://h?namespace=x", ms(500), ms(800)),
///     "redis://h?namespace=x&connect_timeout_ms=500&operation_timeout_ms=800"
/// );
/// ```
pub fn with_timeouts(url: &str, connect: Duration, operation: Duration) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!(
        "{url}{separator}connect_timeout_ms={}&operation_timeout_ms={}",
        connect.as_millis(),
        operation.as_millis()
    )
}
