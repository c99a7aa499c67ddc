//! Mapping user keys into the namespace, Redis Cluster safe.
//!
//! A lock on key `K` in namespace `NS` uses
//!
//! - `NS:{E}:lock`  — the lock itself, a string `dl1:<owner hex>:<fencing token>` with a PX expiry;
//! - `NS:{E}:fence` — the fencing counter, with a retention expiry;
//! - `NS:{E}:gone` — the value of the lock released last and the id of
//!   that release, kept briefly (a release resent after it was applied is
//!   recognised);
//! - `NS:{E}:waiters` — the waiter line, a sorted set of
//!   `<client hex>:<owner hex>` scored by arrival: a release wakes its
//!   first waiter alone, on that client's channel `NS:{E}:released:<client hex>`;
//! - `NS:{E}:released` — the base of those channels, and
//!   `NS:{E}:released:observers` tells observers that a labelled holder
//!   took or left the lock;
//! - `NS:{E}:holder` — the holder label of the acquisition that stored it,
//!   `<owner hex>:<label>` with the lock's PX expiry (shown only while that
//!   owner holds the lock; written only when the holder gave a label);
//! - `NS:{E}:turn` — the turn of the line's woken head while the lock is
//!   free, `<client hex>:<owner hex>/<deadline>` (server milliseconds) with
//!   a PX expiry of two turns (see "Waiting" in the crate docs);
//!
//! and the semaphore of the same key `K` uses names of its own, in the same
//! slot ([`RedisKeys::semaphore`], the same roles but the turn: a
//! semaphore's line wakes its waiters as before, off the line):
//!
//! - `NS:{E}:sem:permits` — the permits, a sorted set of
//!   `dl1:<owner hex>:<fencing token>:<limit>` scored by expiry (server
//!   milliseconds), with a PX expiry no earlier than its last member's;
//! - `NS:{E}:sem:fence` — the semaphore's fencing counter, as the lock's;
//! - `NS:{E}:sem:gone` — released-by markers, a sorted set of
//!   `<owner hex>:<fencing token>/<release id>` scored by expiry;
//! - `NS:{E}:sem:waiters` — the semaphore's waiter line, as the lock's;
//! - `NS:{E}:sem:returned` — the base of its waiters' channels;
//! - `NS:{E}:sem:holder` — the permits' holder labels, a hash of
//!   `<owner hex>:<fencing token>` to label (a field only for a permit
//!   whose holder gave one, deleted with the permit), with a PX expiry no
//!   earlier than the permit set's;
//!
//! and the namespace has one format marker, `NS:format` ([`RedisKeys::format`]):
//! the [`distlock_core::STORAGE_FORMAT`] number as a string, no expiry. It
//! does not start with `NS:{`, so it is no lock's or semaphore's name;
//!
//! where `E` is `K` with `%`, `{` and `}` percent-escaped (`%25`, `%7B`, `%7D`).
//! The escape is injective (it is a standard percent-encoding of a subset of
//! characters, and `%` itself is escaped), so distinct keys never share Redis
//! keys; and `E` contains no brace, so `{E}` is always the hash tag and all
//! names hash to one cluster slot. The namespace is validated by
//! [`distlock_core::ClientOptions::validate`] (letters, digits, `_`, `-`, `.`),
//! so nothing a caller passes can reach outside `NS:{`.

use distlock_core::LockKey;

use crate::waiters::Line;

/// The Redis names one lock, or one semaphore, touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RedisKeys {
    /// The lock key (a semaphore's: its permit set).
    pub(crate) lock: String,
    /// The fencing counter key.
    pub(crate) fence: String,
    /// The released-by marker key.
    pub(crate) gone: String,
    /// The waiter line.
    pub(crate) waiters: String,
    /// The base of the release notification channels (one per client:
    /// `<channel>:<client hex>`).
    pub(crate) channel: String,
    /// The holder label key.
    pub(crate) holder: String,
    /// The woken head's turn (a lock's line only; a semaphore's name is
    /// never written).
    pub(crate) turn: String,
}

impl RedisKeys {
    /// The names for `key` in `namespace`.
    pub(crate) fn new(namespace: &str, key: &LockKey) -> Self {
        Self::tagged(namespace, &escape(key.as_str()), LOCK)
    }

    /// The names of the semaphore `key` in `namespace`: in the lock's slot,
    /// never one of the lock's names (their suffixes differ).
    pub(crate) fn semaphore(namespace: &str, key: &LockKey) -> Self {
        Self::tagged(namespace, &escape(key.as_str()), SEMAPHORE)
    }

    /// Names in `namespace` that no lock key maps to (`%` is always escaped,
    /// so `{%probe}` is never a lock's hash tag), for checking permissions.
    pub(crate) fn probe(namespace: &str) -> Self {
        Self::tagged(namespace, "%probe", LOCK)
    }

    /// [`probe`](Self::probe) for a semaphore's names.
    pub(crate) fn semaphore_probe(namespace: &str) -> Self {
        Self::tagged(namespace, "%probe", SEMAPHORE)
    }

    /// The format marker of `namespace` (`NS:format`): in the namespace,
    /// outside every `NS:{...}` name, in a cluster slot of its own.
    pub(crate) fn format(namespace: &str) -> String {
        format!("{namespace}:format")
    }

    /// The line, the lock's or semaphore's names, and the client id, of a
    /// waiter's channel (`NS:{E}:released:<client hex>` or
    /// `NS:{E}:sem:returned:<client hex>`, see
    /// [`client_channel`](Self::client_channel)); `None` for any other
    /// channel (the observers', a base channel).
    pub(crate) fn of_waiter_channel(channel: &str) -> Option<(Line, Self, &str)> {
        let (base, client) = channel.rsplit_once(':')?;
        if client.is_empty() || !client.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let (namespace, rest) = base.split_once(":{")?;
        // The escaped key holds no brace: the first `}:` closes the tag.
        let (tag, role) = rest.split_once("}:")?;
        let (line, names) = match role {
            role if role == LOCK[4] => (Line::Lock, LOCK),
            role if role == SEMAPHORE[4] => (Line::Permits, SEMAPHORE),
            _ => return None,
        };
        Some((line, Self::tagged(namespace, tag, names), client))
    }

    /// The channel of `client`'s waiters: the base channel and its id.
    pub(crate) fn client_channel(&self, client: &str) -> String {
        format!("{}:{client}", self.channel)
    }

    /// The channel on which scripts tell a key's observers that its
    /// labelled holder changed (`observers` is no client's hex id).
    pub(crate) fn observers_channel(&self) -> String {
        self.client_channel("observers")
    }

    fn tagged(
        namespace: &str,
        tag: &str,
        [lock, fence, gone, waiters, channel, holder, turn]: [&str; 7],
    ) -> Self {
        // `NS:{tag}:suffix`, each in one allocation of its exact size
        // (every operation builds these: `format!` grew each string in
        // several reallocations).
        let name = |suffix: &str| {
            let mut name = String::with_capacity(namespace.len() + tag.len() + suffix.len() + 4);
            for part in [namespace, ":{", tag, "}:", suffix] {
                name.push_str(part);
            }
            name
        };
        Self {
            lock: name(lock),
            fence: name(fence),
            gone: name(gone),
            waiters: name(waiters),
            channel: name(channel),
            holder: name(holder),
            turn: name(turn),
        }
    }
}

/// A lock's suffixes: lock, fence, released-by marker, waiter line,
/// channel, holder label, turn.
const LOCK: [&str; 7] = [
    "lock", "fence", "gone", "waiters", "released", "holder", "turn",
];
/// A semaphore's, in the same roles.
const SEMAPHORE: [&str; 7] = [
    "sem:permits",
    "sem:fence",
    "sem:gone",
    "sem:waiters",
    "sem:returned",
    "sem:holder",
    "sem:turn",
];

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

    /// The lock's and the semaphore's names of `key`.
    fn both(key: &str) -> [RedisKeys; 2] {
        let key = LockKey::new(key).unwrap();
        [RedisKeys::new("ns", &key), RedisKeys::semaphore("ns", &key)]
    }

    #[test]
    fn lookalikes_never_collide() {
        let mut seen = HashSet::new();
        for key in LOOKALIKES {
            for keys in both(key) {
                assert!(seen.insert(keys.lock.clone()), "collision for {key:?}");
                assert!(seen.insert(keys.fence.clone()));
                assert!(seen.insert(keys.gone.clone()));
                assert!(seen.insert(keys.channel.clone()));
                assert!(seen.insert(keys.holder.clone()));
                assert!(seen.insert(keys.turn.clone()));
            }
        }
    }

    #[test]
    fn one_slot_per_lock_and_semaphore_and_inside_namespace() {
        for key in LOOKALIKES {
            let tag = escape(key);
            for keys in both(key) {
                assert_eq!(hash_part(&keys.lock), tag);
                assert_eq!(hash_part(&keys.fence), tag);
                assert_eq!(hash_part(&keys.gone), tag);
                assert_eq!(hash_part(&keys.channel), tag);
                assert_eq!(hash_part(&keys.waiters), tag);
                assert_eq!(hash_part(&keys.holder), tag);
                assert_eq!(hash_part(&keys.turn), tag);
                assert!(keys.lock.starts_with("ns:{"));
            }
        }
    }

    #[test]
    fn the_probe_is_no_lock_or_semaphore() {
        for probe in [RedisKeys::probe("ns"), RedisKeys::semaphore_probe("ns")] {
            assert!(probe.lock.starts_with("ns:{"));
            for key in LOOKALIKES.iter().chain(&["%probe", "{%probe}"]) {
                for keys in both(key) {
                    assert_ne!(keys.lock, probe.lock);
                    assert_ne!(keys.channel, probe.channel);
                }
            }
        }
    }

    #[test]
    fn the_format_marker_is_no_lock_or_semaphore() {
        let marker = RedisKeys::format("ns");
        assert_eq!(marker, "ns:format");
        assert_eq!(hash_part(&marker), marker);
        for key in LOOKALIKES.iter().chain(&["format", "%probe"]) {
            for keys in both(key) {
                for name in [
                    &keys.lock,
                    &keys.fence,
                    &keys.gone,
                    &keys.waiters,
                    &keys.channel,
                    &keys.holder,
                    &keys.turn,
                ] {
                    assert_ne!(name, &marker);
                }
            }
        }
    }

    /// The names servers hold are `NS:{escaped key}:suffix`, exactly.
    #[test]
    fn names_are_namespace_tag_and_suffix() {
        let key = LockKey::new("a{b}").unwrap();
        let lock = RedisKeys::new("ns", &key);
        assert_eq!(lock.lock, "ns:{a%7Bb%7D}:lock");
        assert_eq!(lock.fence, "ns:{a%7Bb%7D}:fence");
        assert_eq!(lock.gone, "ns:{a%7Bb%7D}:gone");
        assert_eq!(lock.waiters, "ns:{a%7Bb%7D}:waiters");
        assert_eq!(lock.channel, "ns:{a%7Bb%7D}:released");
        assert_eq!(lock.holder, "ns:{a%7Bb%7D}:holder");
        assert_eq!(lock.turn, "ns:{a%7Bb%7D}:turn");
        let semaphore = RedisKeys::semaphore("ns", &key);
        assert_eq!(semaphore.lock, "ns:{a%7Bb%7D}:sem:permits");
        assert_eq!(semaphore.holder, "ns:{a%7Bb%7D}:sem:holder");
    }

    #[test]
    fn a_waiter_channel_names_its_lock_or_semaphore() {
        for key in LOOKALIKES {
            let [lock, semaphore] = both(key);
            assert_eq!(
                RedisKeys::of_waiter_channel(&lock.client_channel("0a1b")),
                Some((Line::Lock, lock.clone(), "0a1b"))
            );
            assert_eq!(
                RedisKeys::of_waiter_channel(&semaphore.client_channel("0a1b")),
                Some((Line::Permits, semaphore.clone(), "0a1b"))
            );
            for other in [
                lock.observers_channel(),
                lock.channel.clone(),
                semaphore.channel.clone(),
            ] {
                assert_eq!(RedisKeys::of_waiter_channel(&other), None, "{other}");
            }
        }
    }

    #[test]
    fn escape_examples() {
        assert_eq!(escape("a{b}%c"), "a%7Bb%7D%25c");
        assert_eq!(escape("plain/key:1"), "plain/key:1");
    }
}
