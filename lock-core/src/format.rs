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
        return Err(not_a_marker(location, &format!("{:?}", truncated(stored))));
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

/// Checks the format marker a backend read at `location` while doing
/// `what` (both named in errors): `stored` is the marker's value as the
/// server keeps it (bytes that are not UTF-8 are not a format number). As
/// [`check_storage_format`], with `what` in front of the message.
///
/// ```
/// use distlock_core::{read_storage_format, ErrorKind};
/// assert!(read_storage_format("connecting", "ns:format", b"1").is_ok());
/// let err = read_storage_format("connecting", "ns:format", b"\xff").unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::Corrupted);
/// assert!(err.to_string().contains("connecting: the distlock format marker ns:format"));
/// ```
pub fn read_storage_format(what: &str, location: &str, stored: &[u8]) -> Result<(), LockError> {
    check_storage_format(&String::from_utf8_lossy(stored), location).map_err(|e| within(what, e))
}

/// The error for a format marker at `location` that is not a value at all
/// (`found`, such as `"a hash"` for a key of another type), found while
/// doing `what`: [`ErrorKind::Corrupted`](crate::ErrorKind::Corrupted),
/// worded as [`check_storage_format`] words a value that is not a number.
///
/// ```
/// use distlock_core::{foreign_storage_format, ErrorKind};
/// let err = foreign_storage_format("connecting", "at redis key \"ns:format\"", "a hash");
/// assert_eq!(err.kind(), ErrorKind::Corrupted);
/// assert!(err.to_string().contains("holds a hash, not a format number"));
/// ```
pub fn foreign_storage_format(what: &str, location: &str, found: &str) -> LockError {
    within(what, not_a_marker(location, found))
}

/// The marker at `location` holds `found`, which distlock never writes.
fn not_a_marker(location: &str, found: &str) -> LockError {
    LockError::corrupted(format!(
        "the distlock format marker {location} holds {found}, not a format number; distlock \
         did not write it and leaves it as it is: check what wrote it, or use another namespace"
    ))
}

/// `error`, its message after `what` (what the backend was doing).
fn within(what: &str, error: LockError) -> LockError {
    LockError::new(error.kind(), format!("{what}: {}", error.message()))
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

    #[test]
    fn read_and_foreign_markers_say_what_was_being_done() {
        read_storage_format("w", "k", b"1").unwrap();
        let newer = read_storage_format("w", "k", b"2").unwrap_err();
        assert_eq!(newer.kind(), ErrorKind::Config);
        assert!(
            newer
                .message()
                .starts_with("w: the server stores distlock format 2 (k)"),
            "{newer}"
        );
        for stored in [&b"\xff\xfe"[..], b"x"] {
            let err = read_storage_format("w", "k", stored).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupted, "{stored:?}");
            assert!(
                err.message()
                    .starts_with("w: the distlock format marker k holds "),
                "{err}"
            );
        }
        let err = foreign_storage_format("w", "k", "a hash");
        assert_eq!(err.kind(), ErrorKind::Corrupted);
        assert_eq!(
            err.message(),
            read_storage_format("w", "k", b"x")
                .unwrap_err()
                .message()
                .replace("\"x\"", "a hash")
        );
    }
}
