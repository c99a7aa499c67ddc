//! Holder identity: a label saying who holds a lock, for people.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::LockError;

/// The longest holder label accepted, in bytes of UTF-8.
pub const MAX_HOLDER_BYTES: usize = 128;

/// Who holds a lock, permit or leadership, as people read it: a host name
/// and pid, a pod name, an instance id (ShedLock's `lockedBy`).
///
/// Stored with the lease and readable without taking the lock
/// ([`LockState::Held`](crate::LockState::Held), `distlock status`), it is
/// **never proof of ownership**: two processes may carry the same label,
/// and only the per-acquisition owner token lets a holder extend or release
/// its lock. Non-empty, at most [`MAX_HOLDER_BYTES`] bytes, no control
/// characters (so it prints on one line).
///
/// ```
/// use distlock_core::HolderId;
/// let id = HolderId::new("worker-3:4242")?;
/// assert_eq!(id.as_str(), "worker-3:4242");
/// assert!(HolderId::new("").is_err());
/// assert!(HolderId::new("two\nlines").is_err());
/// // The default a CLI uses: host name and pid.
/// assert!(HolderId::this_process().as_str().ends_with(&format!(":{}", std::process::id())));
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HolderId(Arc<str>);

impl HolderId {
    /// Validates `label`. An [`ErrorKind::InvalidInput`](crate::ErrorKind)
    /// error says what is wrong with an empty label, one over
    /// [`MAX_HOLDER_BYTES`] bytes, or one with a control character.
    pub fn new(label: impl AsRef<str>) -> Result<Self, LockError> {
        let label = label.as_ref();
        if label.is_empty() {
            return Err(LockError::invalid_input(
                "holder id is empty; name the holder (a host name and pid, a pod name) or set none",
            ));
        }
        if label.len() > MAX_HOLDER_BYTES {
            return Err(LockError::invalid_input(format!(
                "holder id is {} bytes, the limit is {MAX_HOLDER_BYTES}; use a shorter name",
                label.len()
            )));
        }
        if let Some(c) = label.chars().find(|c| c.is_control()) {
            return Err(LockError::invalid_input(format!(
                "holder id contains the control character {c:?}; use printable characters only"
            )));
        }
        Ok(Self(label.into()))
    }

    /// This process: `<host name>:<pid>` (the host name from the kernel
    /// or `$HOSTNAME`, cut to fit; `localhost` when neither says).
    pub fn this_process() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| {
                h.trim()
                    .chars()
                    .filter(|c| !c.is_control())
                    .collect::<String>()
            })
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".to_owned());
        let pid = format!(":{}", std::process::id());
        let mut end = host.len().min(MAX_HOLDER_BYTES - pid.len());
        while !host.is_char_boundary(end) {
            end -= 1;
        }
        Self(format!("{}{pid}", &host[..end]).into())
    }

    /// The label as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for HolderId {
    type Err = LockError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl AsRef<str> for HolderId {
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
        assert!(HolderId::new("x".repeat(MAX_HOLDER_BYTES)).is_ok());
        for bad in [
            "".to_owned(),
            "x".repeat(MAX_HOLDER_BYTES + 1),
            "a\u{7}b".into(),
            "tab\there".into(),
        ] {
            assert_eq!(
                HolderId::new(&bad).unwrap_err().kind(),
                ErrorKind::InvalidInput,
                "{bad:?}"
            );
        }
        assert!(HolderId::new("pod-é/ü 1").is_ok());
        let me = HolderId::this_process();
        assert!(me.as_str().len() <= MAX_HOLDER_BYTES);
        assert!(HolderId::new(me.as_str()).is_ok());
    }
}
