//! Fresh random names for whatever a test creates on a shared server (keys,
//! namespaces, tables, roles, temporary directories), so tests and test runs
//! never share state and nothing has to be wiped.

use distlock_core::LockKey;

/// 16 random hex digits (64 bits): enough that two tests, or two runs, never
/// pick the same name.
pub fn random_hex() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// `{prefix}_{16 hex digits}`: letters, digits and `_` only when `prefix`
/// is, so it is also a valid unquoted SQL identifier, a file name and a
/// namespace.
///
/// ```
/// let name = distlock_conformance::naming::unique_name("orders");
/// assert!(name.starts_with("orders_") && name.len() == "orders_".len() + 16);
/// ```
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{}", random_hex())
}

/// A fresh key `{label}-{16 hex digits}`.
///
/// # Panics
///
/// If `label` makes the key invalid (empty labels are fine; a NUL or more
/// than 490 bytes is not): a bug in the test, not in the backend.
///
/// ```
/// let key = distlock_conformance::naming::unique_key("job");
/// assert!(key.as_str().starts_with("job-"));
/// ```
pub fn unique_key(label: &str) -> LockKey {
    LockKey::new(format!("{label}-{}", random_hex())).expect("valid test key")
}
