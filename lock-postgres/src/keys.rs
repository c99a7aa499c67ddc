//! How user keys, namespaces and table names reach PostgreSQL.
//!
//! A lock is the row `(namespace, key)` of the lock table: the namespace and
//! the user key are two separate columns, each sent as a bind parameter (or,
//! behind a transaction pooler, a dollar-quoted literal that reads as the
//! same text: see the `sql` module), so the mapping is injective by
//! construction — look-alike keys (`a`, `a/b`, `a:b`, `a{b}`, `a%2Fb`,
//! unicode, quotes, backslashes) are different rows, and a client only ever
//! reads or writes rows of its own namespace.
//!
//! Schema and table names are identifiers, which cannot be bind parameters;
//! they come from the configuration (never from a lock key), are validated
//! and are always double-quoted.

use distlock_core::LockError;

/// The longest identifier PostgreSQL keeps (NAMEDATALEN - 1).
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// Checks a schema or table name: 1 to 63 bytes, no NUL.
pub(crate) fn validate_identifier(what: &str, name: &str) -> Result<(), LockError> {
    if name.is_empty() || name.len() > MAX_IDENTIFIER_BYTES || name.contains('\0') {
        return Err(LockError::config(format!(
            "{what} name {name:?} is invalid: PostgreSQL identifiers are 1 to {MAX_IDENTIFIER_BYTES} bytes without NUL"
        )));
    }
    Ok(())
}

/// Quotes an identifier for SQL text: `"` around it, inner `"` doubled.
pub(crate) fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `"schema"."table"`.
pub(crate) fn qualified_table(schema: &str, table: &str) -> String {
    format!("{}.{}", quote_identifier(schema), quote_identifier(table))
}

/// The name of the index on `(namespace, fencing)` of the table `table`
/// that the sweep of idle rows reads: `{table}_fencing`, the table's part
/// cut (at a character boundary) so that it fits in an identifier.
pub(crate) fn fencing_index_name(table: &str) -> String {
    const SUFFIX: &str = "_fencing";
    let mut end = table.len().min(MAX_IDENTIFIER_BYTES - SUFFIX.len());
    while !table.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{SUFFIX}", &table[..end])
}

/// The LISTEN/NOTIFY channel of one namespace in one lock table.
///
/// Channel names are identifiers (at most 63 bytes), so the channel is
/// `distlock_` and a 64-bit FNV-1a hash of schema, table and namespace —
/// the same in every process and every version of this crate. The payload
/// of a notification is the user key, so a hash collision between two
/// namespaces only causes a spurious wake-up, never a missed one.
pub fn channel_name(schema: &str, table: &str, namespace: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in schema
        .bytes()
        .chain([0])
        .chain(table.bytes())
        .chain([0])
        .chain(namespace.bytes())
    {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("distlock_{hash:016x}")
}

/// Whether `owner` is in the form distlock writes: 32 lowercase hex digits.
pub(crate) fn is_owner_token(owner: &str) -> bool {
    owner.len() == 32
        && owner
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote_identifier("a\"b"), "\"a\"\"b\"");
        assert_eq!(qualified_table("public", "t"), "\"public\".\"t\"");
        assert!(validate_identifier("table", "").is_err());
        assert!(validate_identifier("table", &"x".repeat(64)).is_err());
        assert!(validate_identifier("table", "distlock_locks").is_ok());
    }

    #[test]
    fn channels() {
        let a = channel_name("public", "distlock_locks", "distlock");
        assert!(a.len() <= MAX_IDENTIFIER_BYTES);
        assert_eq!(a, channel_name("public", "distlock_locks", "distlock"));
        assert_ne!(a, channel_name("public", "distlock_locks", "other"));
        assert_ne!(channel_name("ab", "c", "ns"), channel_name("a", "bc", "ns"));
    }

    #[test]
    fn fencing_index_names_fit_in_an_identifier() {
        assert_eq!(
            fencing_index_name("distlock_locks"),
            "distlock_locks_fencing"
        );
        let long = "é".repeat(31) + "x";
        let name = fencing_index_name(&long);
        assert!(name.len() <= MAX_IDENTIFIER_BYTES, "{name}");
        assert!(name.ends_with("é_fencing"), "{name}");
    }

    #[test]
    fn owners() {
        assert!(is_owner_token(&"0123456789abcdef".repeat(2)));
        assert!(!is_owner_token(&"0123456789ABCDEF".repeat(2)));
        assert!(!is_owner_token("nope"));
    }
}
