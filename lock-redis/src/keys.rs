//! Mapping user keys into the namespace, Redis Cluster safe.
//!
//! A lock on key `K` in namespace `NS` uses
//!
//! - `NS:{E}:lock`  — the lock itself, a string `dl1:<owner hex>:<fencing token>` with a PX expiry;
//! - `NS:{E}:fence` — the fencing counter, with a retention expiry;
//! - `NS:{E}:gone` — the value of the lock released last and the id of
//!   that release, kept briefly (a release resent after it was applied is
//!   recognised);
//! - `NS:{E}:released` — the pub/sub channel a release publishes on;
//!
//! where `E` is `K` with `%`, `{` and `}` percent-escaped (`%25`, `%7B`, `%7D`).
//! The escape is injective (it is a standard percent-encoding of a subset of
//! characters, and `%` itself is escaped), so distinct keys never share Redis
//! keys; and `E` contains no brace, so `{E}` is always the hash tag and all
//! names hash to one cluster slot. The namespace is validated by
//! [`distlock_core::ClientOptions::validate`] (letters, digits, `_`, `-`, `.`),
//! so nothing a caller passes can reach outside `NS:{`.

use distlock_core::LockKey;

/// The Redis names one lock touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RedisKeys {
    /// The lock key.
    pub(crate) lock: String,
    /// The fencing counter key.
    pub(crate) fence: String,
    /// The released-by marker key.
    pub(crate) gone: String,
    /// The release notification channel.
    pub(crate) channel: String,
}

impl RedisKeys {
    /// The names for `key` in `namespace`.
    pub(crate) fn new(namespace: &str, key: &LockKey) -> Self {
        Self::tagged(namespace, &escape(key.as_str()))
    }

    /// Names in `namespace` that no lock key maps to (`%` is always escaped,
    /// so `{%probe}` is never a lock's hash tag), for checking permissions.
    pub(crate) fn probe(namespace: &str) -> Self {
        Self::tagged(namespace, "%probe")
    }

    fn tagged(namespace: &str, tag: &str) -> Self {
        Self {
            lock: format!("{namespace}:{{{tag}}}:lock"),
            fence: format!("{namespace}:{{{tag}}}:fence"),
            gone: format!("{namespace}:{{{tag}}}:gone"),
            channel: format!("{namespace}:{{{tag}}}:released"),
        }
    }
}

/// Percent-escapes `%`, `{` and `}`.
pub(crate) fn escape(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 8);
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The part of `name` Redis Cluster hashes (its hash-tag rule).
    fn hash_part(name: &str) -> &str {
        if let Some(open) = name.find('{') {
            if let Some(len) = name[open + 1..].find('}') {
                if len > 0 {
                    return &name[open + 1..open + 1 + len];
                }
            }
        }
        name
    }

    const LOOKALIKES: &[&str] = &[
        "a",
        "a/b",
        "a:b",
        "a{b}",
        "a%2Fb",
        "a%b",
        "a%7Bb%7D",
        "{a}",
        "a}",
        "{",
        "}",
        "%",
        "%25",
        "a:{b}:lock",
        "ünï",
        "a b",
        "a\nb",
        "a:lock",
        "}{",
    ];

    #[test]
    fn lookalikes_never_collide() {
        let mut seen = HashSet::new();
        for key in LOOKALIKES {
            let keys = RedisKeys::new("ns", &LockKey::new(*key).unwrap());
            assert!(seen.insert(keys.lock.clone()), "collision for {key:?}");
            assert!(seen.insert(keys.fence.clone()));
            assert!(seen.insert(keys.gone.clone()));
            assert!(seen.insert(keys.channel.clone()));
        }
    }

    #[test]
    fn one_slot_per_lock_and_inside_namespace() {
        for key in LOOKALIKES {
            let keys = RedisKeys::new("ns", &LockKey::new(*key).unwrap());
            let tag = hash_part(&keys.lock);
            assert_eq!(tag, escape(key));
            assert_eq!(hash_part(&keys.fence), tag);
            assert_eq!(hash_part(&keys.gone), tag);
            assert_eq!(hash_part(&keys.channel), tag);
            assert!(keys.lock.starts_with("ns:{"));
        }
    }

    #[test]
    fn the_probe_is_no_lock() {
        let probe = RedisKeys::probe("ns");
        assert!(probe.lock.starts_with("ns:{"));
        for key in LOOKALIKES.iter().chain(&["%probe", "{%probe}"]) {
            let keys = RedisKeys::new("ns", &LockKey::new(*key).unwrap());
            assert_ne!(keys.lock, probe.lock);
            assert_ne!(keys.channel, probe.channel);
        }
    }

    #[test]
    fn escape_examples() {
        assert_eq!(escape("a{b}%c"), "a%7Bb%7D%25c");
        assert_eq!(escape("plain/key:1"), "plain/key:1");
    }
}
