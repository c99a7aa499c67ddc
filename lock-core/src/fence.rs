//! The fencing-counter retention shared by the backends whose tokens are
//! `max(counter + 1, server clock in microseconds)` and whose counters are
//! reclaimed a while after their last use (Redis, PostgreSQL): its bounds
//! and their check, so both accept and refuse the same values with the
//! same words.

use std::time::Duration;

use crate::LockError;

/// How long a fencing counter outlives its last use, at least, unless
/// configured (the `fence_retention_ms` URL parameter of the backends that
/// have one; see their crate docs for why a counter may expire at all).
/// One hour.
pub const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(3600);

/// The longest fencing-counter retention accepted: 365 days, the longest
/// TTL. (A longer one was accepted once and failed inside Redis's acquire
/// script.)
pub const MAX_FENCE_RETENTION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Checks a fencing-counter retention (`name` says where it was given, e.g.
/// `URL parameter fence_retention_ms`): more than zero, at most
/// [`MAX_FENCE_RETENTION`]; a [`Config`](crate::ErrorKind::Config) error
/// otherwise.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::check_fence_retention;
/// assert!(check_fence_retention(Duration::from_millis(200), "fence_retention").is_ok());
/// let err = check_fence_retention(Duration::ZERO, "fence_retention").unwrap_err();
/// assert!(err.to_string().contains("greater than zero"));
/// ```
pub fn check_fence_retention(retention: Duration, name: &str) -> Result<(), LockError> {
    if retention.is_zero() {
        return Err(LockError::config(format!(
            "{name} must be greater than zero"
        )));
    }
    if retention > MAX_FENCE_RETENTION {
        return Err(LockError::config(format!(
            "{name} of {retention:?} is longer than the longest accepted, {} days ({} ms)",
            MAX_FENCE_RETENTION.as_secs() / 86_400,
            MAX_FENCE_RETENTION.as_millis()
        )));
    }
    Ok(())
}
