//! Mapping lock keys into the namespace, and the value format of a lock.
//!
//! A lock on user key `k` in namespace `NS` is the etcd key
//! `NS/lock/<escape(k)>`, where `escape` percent-encodes `%` and `/`
//! (`%25`, `%2F`) and keeps every other byte. The escape is injective (it
//! can be undone), so two distinct user keys never map to the same etcd key,
//! and an escaped key never contains `/`, so no lock key is a path below
//! another.
//!
//! The waiters of `k` queue (FIFO) under `NS/lock/<escape(k)>/waiters/`,
//! one key per waiting call: `NS/lock/<escape(k)>/waiters/<waiter id>`. The
//! only range the backend reads is such a queue prefix. It ends with `/` and
//! the escaped key in it contains none, so the queue prefix of `k` is never
//! a prefix of another key's lock key or queue entries (`a` vs `a/b`, whose
//! queue is `NS/lock/a%2Fb/waiters/`), and no lock key lies in any queue
//! range. Every key the backend touches starts with `NS/lock/`, so one
//! readwrite permission on that prefix covers locks and queues.
//!
//! A request whose outcome is unknown is fenced off under
//! `NS/lock/<escape(k)>/fences/` (see [`crate::fence`]): no lock key and no
//! queue range lies there.
//!
//! The value is `dl1:<32 hex digits of the owner token>`; anything else at a
//! lock key was not written by distlock and is reported as corrupted.

use distlock_core::{LockKey, OwnerToken};

/// Prefix of every value we write.
const VALUE_PREFIX: &str = "dl1:";

/// The etcd key layout of one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyLayout {
    prefix: String,
}

impl KeyLayout {
    /// The layout for `namespace` (already validated: ASCII letters, digits,
    /// `_`, `-`, `.`; so it contains no `/`).
    pub(crate) fn new(namespace: &str) -> Self {
        Self {
            prefix: format!("{namespace}/lock/"),
        }
    }

    /// The prefix every lock key starts with (`NS/lock/`): the range a
    /// restricted etcd user needs readwrite permission on.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The prefix of the waiter queue of `key` (ends with `/`).
    pub(crate) fn queue_prefix(&self, key: &LockKey) -> Vec<u8> {
        let mut out = self.lock_key(key);
        out.extend_from_slice(b"/waiters/");
        out
    }

    /// The queue entry of waiter `waiter_id` (`<session lease id>-<number>`,
    /// hex digits and `-`) on `key`.
    pub(crate) fn queue_entry(&self, key: &LockKey, waiter_id: &str) -> Vec<u8> {
        let mut out = self.queue_prefix(key);
        out.extend_from_slice(waiter_id.as_bytes());
        out
    }

    /// The etcd key of the lock on `key`.
    pub(crate) fn lock_key(&self, key: &LockKey) -> Vec<u8> {
        let mut out = String::with_capacity(self.prefix.len() + key.as_str().len() + 8);
        out.push_str(&self.prefix);
        for c in key.as_str().chars() {
            match c {
                '%' => out.push_str("%25"),
                '/' => out.push_str("%2F"),
                c => out.push(c),
            }
        }
        out.into_bytes()
    }
}

/// The value stored at a lock key held by `owner`.
pub(crate) fn encode_value(owner: OwnerToken) -> Vec<u8> {
    format!("{VALUE_PREFIX}{}", owner.to_hex()).into_bytes()
}

/// Parses a value found at a lock key; `None` if distlock did not write it.
pub(crate) fn decode_value(value: &[u8]) -> Option<OwnerToken> {
    let text = std::str::from_utf8(value).ok()?;
    OwnerToken::from_hex(text.strip_prefix(VALUE_PREFIX)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn look_alike_keys_do_not_collide() {
        let layout = KeyLayout::new("distlock");
        let keys = [
            "a", "a/b", "a%2Fb", "a%b", "a:b", "a{b}", "a/", "/a", "a//b", "a%2F", "ключ", "a b",
            "%", "%25", "/",
        ];
        let mapped: HashSet<Vec<u8>> = keys
            .iter()
            .map(|k| layout.lock_key(&LockKey::new(*k).unwrap()))
            .collect();
        assert_eq!(mapped.len(), keys.len());
        for m in &mapped {
            let rest = &m[layout.prefix().len()..];
            assert!(m.starts_with(layout.prefix().as_bytes()));
            assert!(!rest.contains(&b'/'));
        }
        assert_eq!(
            layout.lock_key(&LockKey::new("a/b").unwrap()),
            b"distlock/lock/a%2Fb"
        );
    }

    #[test]
    fn queue_prefixes_never_overlap() {
        let layout = KeyLayout::new("distlock");
        let keys = [
            "a",
            "a/b",
            "a%2Fb",
            "a%b",
            "a:b",
            "a/",
            "/a",
            "a//b",
            "ключ",
            "%",
            "/",
            "a/waiters",
            "a/waiters/x",
        ];
        let keys: Vec<LockKey> = keys.iter().map(|k| LockKey::new(*k).unwrap()).collect();
        for k in &keys {
            let prefix = layout.queue_prefix(k);
            assert!(prefix.ends_with(b"/"));
            for other in &keys {
                // No lock key lies in a queue range.
                assert!(!layout.lock_key(other).starts_with(&prefix));
                if other != k {
                    let theirs = layout.queue_prefix(other);
                    assert!(!theirs.starts_with(&prefix) && !prefix.starts_with(&theirs));
                    assert!(!layout.queue_entry(other, "00ff").starts_with(&prefix));
                }
            }
            assert!(layout.queue_entry(k, "00ff").starts_with(&prefix));
        }
        assert_eq!(
            layout.queue_entry(&LockKey::new("a/b").unwrap(), "0a"),
            b"distlock/lock/a%2Fb/waiters/0a"
        );
    }

    #[test]
    fn values_round_trip() {
        let owner = OwnerToken::random();
        assert_eq!(decode_value(&encode_value(owner)), Some(owner));
        assert_eq!(decode_value(b"hello"), None);
        assert_eq!(decode_value(b"dl1:xyz"), None);
        assert_eq!(decode_value(&[0xff, 0xfe]), None);
    }
}
