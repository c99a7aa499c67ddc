//! The storage format version every server-backed backend marks its
//! namespace with, and the connect-time check of that marker.
//!
//! A backend stores [`STORAGE_FORMAT`] once per namespace (a key, a row)
//! when it finds no marker, and at every connect reads the marker back
//! through [`check_storage_format`]: a client works only with the format it
//! was built for. A namespace without a marker holds format 1 (what clients
//! from before the marker stored).

use crate::LockError;

/// The version of what this release stores on a lock server: 1 is the
/// lock, fence, waiter-queue and semaphore layout documented in the README
/// ("What is stored on the server"). A release that changes what is stored
/// bumps it.
pub const STORAGE_FORMAT: u32 = 1;

/// Checks the format marker a backend read at `location` (the key or row,
/// named in errors; `stored` is its text).
///
/// A number equal to [`STORAGE_FORMAT`] is accepted; another number is
/// [`ErrorKind::Config`](crate::ErrorKind::Config) naming both numbers and
/// what to do; anything else is
/// [`ErrorKind::Corrupted`](crate::ErrorKind::Corrupted) naming the location.
///
/// ```
/// use distlock_core::{check_storage_format, ErrorKind, STORAGE_FORMAT};
/// assert!(check_storage_format(&STORAGE_FORMAT.to_string(), "ns:format").is_ok());
/// let newer = check_storage_format("2", "ns:format").unwrap_err();
/// assert_eq!(newer.kind(), ErrorKind::Config);
/// assert!(newer.to_string().contains("format 2"));
/// let garbage = check_storage_format("x", "ns:format").unwrap_err();
/// assert_eq!(garbage.kind(), ErrorKind::Corrupted);
/// ```
pub fn check_storage_format(stored: &str, location: &str) -> Result<(), LockError> {
    // Digits only: `+1`, ` 1` or `01` were not written by distlock.
    let number = Some(stored)
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .filter(|s| s.len() == 1 || !s.starts_with('0'))
        .and_then(|s| s.parse::<u32>().ok());
    let Some(found) = number else {
        return Err(LockError::corrupted(format!(
            "the distlock format marker {location} holds {:?}, not a format number; distlock \
             did not write it and leaves it as it is: check what wrote it, or use another namespace",
            truncated(stored)
        )));
    };
    if found == STORAGE_FORMAT {
        return Ok(());
    }
    let advice = if found > STORAGE_FORMAT {
        "it was written by a newer distlock release: upgrade this client to one that \
         stores that format, or use another namespace"
    } else {
        "it was written by an older distlock release: finish the upgrade as that release's \
         CHANGELOG says (stop the older clients first), or use another namespace"
    };
    Err(LockError::config(format!(
        "the server stores distlock format {found} ({location}), this client stores format \
         {STORAGE_FORMAT}; refusing to connect, as the two would not exclude each other \
         reliably: {advice}"
    )))
}

/// At most 64 characters of foreign data, for an error message.
fn truncated(stored: &str) -> String {
    const MAX: usize = 64;
    match stored.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}...", &stored[..end]),
        None => stored.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn the_current_format_passes() {
        check_storage_format("1", "k").unwrap();
    }

    #[test]
    fn other_numbers_are_refused_naming_both() {
        for (stored, word) in [("0", "older"), ("2", "newer"), ("4294967295", "newer")] {
            let err = check_storage_format(stored, "ns:format").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{stored}");
            let text = err.to_string();
            assert!(
                text.contains(&format!("format {stored} (ns:format)")),
                "{text}"
            );
            assert!(text.contains("this client stores format 1"), "{text}");
            assert!(text.contains(word), "{text}");
        }
    }

    #[test]
    fn anything_else_is_corrupted() {
        for stored in ["", "x", "01", "+1", " 1", "1.0", "4294967296", "-1"] {
            let err = check_storage_format(stored, "ns:format").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupted, "{stored:?}");
            assert!(err.to_string().contains("ns:format"), "{err}");
        }
        let long = "é".repeat(100);
        let err = check_storage_format(&long, "k").unwrap_err();
        assert!(err.to_string().len() < 400, "{err}");
    }
}
