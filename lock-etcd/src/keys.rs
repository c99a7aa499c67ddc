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
//! one key per waiting call: `NS/lock/<escape(k)>/waiters/<waiter id>`
//! (a client reuses its waiter ids once free: see `queue::slots`). The
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
//!
//! The holder's label ([`distlock_core::HolderId`]) is the sibling key
//! `NS/lock/<escape(k)>/holder`, valued `dl1:<owner hex>/<label>`: written
//! in the transaction that creates the lock, on the lock's lease, and
//! shown only while its owner is the lock's (a label another owner left
//! there, by a client that did not remove it, is ignored). The lock's own
//! value stays as it was, so clients that predate labels still read it
//! (they reject any other value as corrupted). `/holder` is outside the
//! queue and fence ranges, and no lock key (its escaped part has no `/`).
//!
//! A counting semaphore on user key `k` lives under its own base
//! `NS/lock/%sem/<escape(k)>` (see [`crate::semaphore`]):
//!
//! - `<base>/permits/<client>-<slot>`: one permit, on an etcd lease of
//!   its own (or its client's session lease), value
//!   `dl1:<owner hex>/<limit>` (the limit it was granted under; all live
//!   permits carry the same one). The name is a random id of the client
//!   and a number it reuses (see [`crate::permit_names`]); permits named by
//!   their owner's 32 hex digits, as clients before 0.1.0 wrote them, are
//!   read as well;
//! - `<base>/holders/<32 hex digits of the owner token>`: the holder label
//!   of that owner's permit, valued `dl1:<owner hex>/<label>` as a lock's,
//!   on the permit's lease, written in the transaction that puts the
//!   permit (only if its holder gave a label), moved and deleted with it;
//!   outside the permits' range, so no permit count or watch sees it;
//! - `<base>/waiters/<waiter id>`: its FIFO waiter queue, as a lock's;
//! - `<base>/fences/...`: fences of its queue entries and of permit
//!   attempts on a session lease, as a lock's (outside the permits, whose
//!   range is read and watched whole).
//!
//! `%se` is no escape, so no escaped key starts with `%sem`: no semaphore
//! key is a lock key or lies in a lock's queue or fence range, and (the
//! escaped key again containing no `/`) the ranges of two semaphores never
//! overlap. The semaphore and the lock of one name share nothing. Every
//! semaphore key starts with `NS/lock/` too, so the one readwrite
//! permission on that prefix covers semaphores as well.
//!
//! The namespace's format marker is `NS/lock/%format` ([`KeyLayout::format`]):
//! the [`distlock_core::STORAGE_FORMAT`] number as text, on no lease. `%fo`
//! is no escape and the name has no `/`, so it is no lock key, no
//! semaphore's, and lies in no queue or fence range; it is under `NS/lock/`,
//! so the one permission covers it too.

use distlock_core::{HolderId, LockKey, OwnerToken};

/// Prefix of every value we write.
const VALUE_PREFIX: &str = "dl1:";

/// What follows the namespace prefix in every semaphore key: `%se` is no
/// escape, so no escaped lock key starts with it.
const SEMAPHORES: &str = "%sem/";

/// Under a semaphore's base: its permits.
const PERMITS: &[u8] = b"/permits/";

/// Under a lock key or a semaphore's base: its waiter queue.
const WAITERS: &[u8] = b"/waiters/";

/// Under a lock key: its holder's label.
const HOLDER: &[u8] = b"/holder";

/// Under a semaphore's base: its permits' holder labels.
const HOLDERS: &[u8] = b"/holders/";

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

    /// The namespace's format marker, `NS/lock/%format`.
    pub(crate) fn format(&self) -> String {
        format!("{}%format", self.prefix)
    }

    /// The prefix of the waiter queue of `key` (ends with `/`).
    pub(crate) fn queue_prefix(&self, key: &LockKey) -> Vec<u8> {
        waiters_of(self.lock_key(key))
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
        self.escaped("", key)
    }

    /// The key of the label of `key`'s holder (`<lock key>/holder`).
    pub(crate) fn holder_key(&self, key: &LockKey) -> Vec<u8> {
        let mut out = self.lock_key(key);
        out.extend_from_slice(HOLDER);
        out
    }

    /// The base of the semaphore `key` (`NS/lock/%sem/<escaped key>`): its
    /// permits, waiters and fences lie below it.
    pub(crate) fn semaphore_base(&self, key: &LockKey) -> Vec<u8> {
        self.escaped(SEMAPHORES, key)
    }

    /// The prefix of the permits of the semaphore `key` (ends with `/`).
    pub(crate) fn permits_prefix(&self, key: &LockKey) -> Vec<u8> {
        let mut out = self.semaphore_base(key);
        out.extend_from_slice(PERMITS);
        out
    }

    /// The permit named `name` in the semaphore `key`.
    pub(crate) fn permit_key(&self, key: &LockKey, name: &[u8]) -> Vec<u8> {
        let mut out = self.permits_prefix(key);
        out.extend_from_slice(name);
        out
    }

    /// The prefix of the holder labels of the semaphore `key`'s permits
    /// (ends with `/`).
    pub(crate) fn permit_holders_prefix(&self, key: &LockKey) -> Vec<u8> {
        let mut out = self.semaphore_base(key);
        out.extend_from_slice(HOLDERS);
        out
    }

    /// The holder label of `owner`'s permit of the semaphore `key`.
    pub(crate) fn permit_holder_key(&self, key: &LockKey, owner: OwnerToken) -> Vec<u8> {
        let mut out = self.permit_holders_prefix(key);
        out.extend_from_slice(owner.to_hex().as_bytes());
        out
    }

    /// The prefix of the waiter queue of the semaphore `key`.
    pub(crate) fn permit_queue_prefix(&self, key: &LockKey) -> Vec<u8> {
        waiters_of(self.semaphore_base(key))
    }

    /// `NS/lock/<infix><escape(key)>`.
    fn escaped(&self, infix: &str, key: &LockKey) -> Vec<u8> {
        let mut out = String::with_capacity(self.prefix.len() + key.as_str().len() + 16);
        out.push_str(&self.prefix);
        out.push_str(infix);
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

/// The waiter queue prefix below a lock key or semaphore base.
fn waiters_of(mut base: Vec<u8>) -> Vec<u8> {
    base.extend_from_slice(WAITERS);
    base
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

/// The value of the label key of `owner`'s lock, labelled `holder`.
pub(crate) fn encode_holder(owner: OwnerToken, holder: &HolderId) -> Vec<u8> {
    format!("{VALUE_PREFIX}{}/{holder}", owner.to_hex()).into_bytes()
}

/// Parses a value found at a label key: its owner and label; `None` for
/// anything else (a label is for people: bad data there is ignored, never
/// an error).
pub(crate) fn decode_holder(value: &[u8]) -> Option<(OwnerToken, HolderId)> {
    let text = std::str::from_utf8(value).ok()?;
    let (owner, label) = text.strip_prefix(VALUE_PREFIX)?.split_once('/')?;
    Some((OwnerToken::from_hex(owner)?, HolderId::new(label).ok()?))
}

/// The value stored at the permit of `owner`, granted under `limit`.
pub(crate) fn encode_permit(owner: OwnerToken, limit: u32) -> Vec<u8> {
    format!("{VALUE_PREFIX}{}/{limit}", owner.to_hex()).into_bytes()
}

/// Parses a value found at a permit key: its owner and limit; `None` if
/// distlock did not write it.
pub(crate) fn decode_permit(value: &[u8]) -> Option<(OwnerToken, u32)> {
    let text = std::str::from_utf8(value).ok()?;
    let (owner, limit_text) = text.strip_prefix(VALUE_PREFIX)?.split_once('/')?;
    let limit: u32 = limit_text.parse().ok().filter(|l| *l > 0)?;
    // Only the form we write (no sign, no leading zeros).
    if limit.to_string() != limit_text {
        return None;
    }
    Some((OwnerToken::from_hex(owner)?, limit))
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
    fn semaphore_keys_never_meet_lock_keys() {
        let layout = KeyLayout::new("distlock");
        let keys = [
            "a",
            "a/b",
            "a%2Fb",
            "%sem",
            "%sem/a",
            "%25sem",
            "sem",
            "a/permits",
            "/",
            "%",
            "ключ",
        ];
        let keys: Vec<LockKey> = keys.iter().map(|k| LockKey::new(*k).unwrap()).collect();
        let name = b"0123456789abcdef-0";
        for k in &keys {
            let base = layout.semaphore_base(k);
            assert!(base.starts_with(layout.prefix().as_bytes()));
            let mine = [
                layout.permits_prefix(k),
                layout.permit_key(k, name),
                layout.permit_queue_prefix(k),
            ];
            for m in &mine {
                assert!(m.starts_with(&base));
            }
            for other in &keys {
                // No lock key, lock queue or lock fence range meets a
                // semaphore's keys, whatever the two names.
                let lock = layout.lock_key(other);
                let mut lock_below = lock.clone();
                lock_below.push(b'/');
                for m in &mine {
                    assert_ne!(m, &lock);
                    assert!(!m.starts_with(&lock_below));
                    assert!(!lock.starts_with(m));
                }
                if other != k {
                    let mut theirs = layout.semaphore_base(other);
                    theirs.push(b'/');
                    assert!(!layout.permit_key(k, name).starts_with(&theirs));
                    assert!(!layout.permit_queue_prefix(k).starts_with(&theirs));
                }
            }
        }
        assert_eq!(
            layout.permits_prefix(&LockKey::new("a/b").unwrap()),
            b"distlock/lock/%sem/a%2Fb/permits/"
        );
    }

    #[test]
    fn the_format_marker_is_no_lock_or_semaphore_key() {
        let layout = KeyLayout::new("distlock");
        let marker = layout.format();
        assert_eq!(marker, "distlock/lock/%format");
        let marker = marker.as_bytes();
        let name = b"0123456789abcdef-0";
        for k in ["%format", "format", "%", "%f", "a", "%sem", "%25format"] {
            let k = LockKey::new(k).unwrap();
            for base in [layout.lock_key(&k), layout.semaphore_base(&k)] {
                assert_ne!(base.as_slice(), marker);
                let mut below = base.clone();
                below.push(b'/');
                assert!(!marker.starts_with(&below));
            }
            assert_ne!(layout.permit_key(&k, name).as_slice(), marker);
        }
    }

    #[test]
    fn permit_values_round_trip() {
        let owner = OwnerToken::random();
        assert_eq!(decode_permit(&encode_permit(owner, 3)), Some((owner, 3)));
        assert_eq!(decode_permit(&encode_value(owner)), None);
        let hex = owner.to_hex();
        for bad in ["0", "03", "+3", "-1", "x", ""] {
            assert_eq!(decode_permit(format!("dl1:{hex}/{bad}").as_bytes()), None);
        }
    }

    #[test]
    fn holder_keys_lie_outside_every_range() {
        let layout = KeyLayout::new("distlock");
        let keys = ["a", "a/holder", "a%2Fholder", "holder", "%sem", "/", "%"];
        let keys: Vec<LockKey> = keys.iter().map(|k| LockKey::new(*k).unwrap()).collect();
        for k in &keys {
            let label = layout.holder_key(k);
            assert!(label.starts_with(&layout.lock_key(k)));
            assert!(label.starts_with(layout.prefix().as_bytes()));
            for other in &keys {
                assert_ne!(label, layout.lock_key(other));
                assert!(!label.starts_with(&layout.queue_prefix(other)));
                assert!(!label.starts_with(&layout.semaphore_base(other)));
                let mut fences = layout.lock_key(other);
                fences.extend_from_slice(b"/fences/");
                assert!(!label.starts_with(&fences));
                if other != k {
                    assert_ne!(label, layout.holder_key(other));
                }
            }
        }
        assert_eq!(
            layout.holder_key(&LockKey::new("a/b").unwrap()),
            b"distlock/lock/a%2Fb/holder"
        );
    }

    #[test]
    fn holder_values_round_trip() {
        let owner = OwnerToken::random();
        let label = HolderId::new("pod-7/é:42").unwrap();
        let value = encode_holder(owner, &label);
        assert_eq!(decode_holder(&value), Some((owner, label)));
        // The lock's value is untouched by labels.
        assert_eq!(decode_value(&value), None);
        let hex = owner.to_hex();
        for bad in [
            format!("dl1:{hex}/"),
            format!("dl1:{hex}"),
            format!("dl1:{hex}/a\nb"),
            "dl1:xyz/a".to_owned(),
            format!("dl2:{hex}/a"),
            format!(
                "dl1:{hex}/{}",
                "x".repeat(distlock_core::MAX_HOLDER_BYTES + 1)
            ),
        ] {
            assert_eq!(decode_holder(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(decode_holder(&[0xff, 0xfe]), None);
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
