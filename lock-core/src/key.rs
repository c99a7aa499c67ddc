//! Validated lock keys.

use std::fmt;
use std::str::FromStr;

use crate::LockError;

/// The longest key accepted, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 512;

/// The name of a lock: non-empty UTF-8, at most [`MAX_KEY_BYTES`] bytes, no NUL.
///
/// Every backend maps the key into its own namespace; two distinct keys never
/// interfere, however alike they look (`a/b`, `a:b`, `a{b}`).
///
/// ```
/// use distlock_core::LockKey;
/// let key = LockKey::new("reports/nightly")?;
/// assert_eq!(key.as_str(), "reports/nightly");
/// assert!(LockKey::new("a\0b").is_err());
/// // A key over the limit is refused with a pointer to `JobKey`, which
/// // hashes the long parts (a job's arguments) into a short key.
/// let err = LockKey::new("x".repeat(513)).unwrap_err();
/// assert!(err.message().contains("distlock_core::JobKey"), "{err}");
/// let short = distlock_core::JobKey::new("report").args(&"x".repeat(513))?.key()?;
/// assert!(short.as_str().len() <= distlock_core::MAX_KEY_BYTES);
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(String);

impl LockKey {
    /// Validates `key`. Returns an [`ErrorKind::InvalidInput`](crate::ErrorKind)
    /// error saying what is wrong for an empty key, a key over 512 bytes or a
    /// key containing NUL.
    pub fn new(key: impl Into<String>) -> Result<Self, LockError> {
        let key = key.into();
        if key.is_empty() {
            return Err(LockError::invalid_input(
                "lock key is empty; give every lock a non-empty name",
            ));
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(LockError::invalid_input(format!(
                "lock key is {} bytes, the limit is {MAX_KEY_BYTES}; use a shorter name, or pass the long parts as arguments of distlock_core::JobKey, which hashes them",
                key.len()
            )));
        }
        if key.contains('\0') {
            return Err(LockError::invalid_input(
                "lock key contains a NUL character, which no backend can store",
            ));
        }
        Ok(Self(key))
    }

    /// The key as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for LockKey {
    type Err = LockError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<&str> for LockKey {
    type Error = LockError;
    fn try_from(s: &str) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl TryFrom<String> for LockKey {
    type Error = LockError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn limits() {
        assert!(LockKey::new("x".repeat(512)).is_ok());
        assert_eq!(
            LockKey::new("x".repeat(513)).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
        // 512 bytes of multi-byte characters is fine, 513 is not.
        assert!(LockKey::new("é".repeat(256)).is_ok());
        assert!(LockKey::new(format!("{}x", "é".repeat(256))).is_err());
        assert!(LockKey::new("").is_err());
        assert!(LockKey::new("\0").is_err());
    }
}
