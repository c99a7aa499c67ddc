//! [`ContendedKeys`]: the keys a client found taken lately, so that its
//! next attempt on one of them can ask the cheap way first.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::LockKey;

/// How long after a client found a key taken it counts as contended.
pub const CONTENDED_FOR: Duration = Duration::from_secs(10);

/// The most keys a client remembers as contended.
const CONTENDED_KEYS: usize = 1024;

/// The keys a client found taken (an attempt refused, or a release that
/// handed the key to a waiter) in the last [`CONTENDED_FOR`]: an attempt
/// on one of them is likely refused, and a backend whose refusal can be
/// cheaper than a full attempt (a read, not a write through Raft; a short
/// statement that only joins the line) asks that way first. A key free
/// by then costs one request more per attempt until this runs out.
///
/// Bounded: past 1,024 keys the stale ones are forgotten, and if every one
/// is fresh, all of them (the cost is the full attempt, as without this
/// memory).
///
/// ```
/// use distlock_core::{ContendedKeys, LockKey};
///
/// let contended = ContendedKeys::default();
/// let key = LockKey::new("nightly-report").unwrap();
/// assert!(!contended.is_contended(&key));
/// contended.found_taken(&key);
/// assert!(contended.is_contended(&key));
/// ```
#[derive(Debug, Default)]
pub struct ContendedKeys {
    found: Mutex<HashMap<LockKey, Instant>>,
}

impl ContendedKeys {
    /// This client found `key` taken just now.
    pub fn found_taken(&self, key: &LockKey) {
        let mut found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        if found.len() >= CONTENDED_KEYS && !found.contains_key(key) {
            let now = Instant::now();
            found.retain(|_, at| now.duration_since(*at) < CONTENDED_FOR);
            if found.len() >= CONTENDED_KEYS {
                found.clear();
            }
        }
        found.insert(key.clone(), Instant::now());
    }

    /// Whether this client found `key` taken in the last [`CONTENDED_FOR`].
    pub fn is_contended(&self, key: &LockKey) -> bool {
        self.found
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .is_some_and(|at| at.elapsed() < CONTENDED_FOR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_bound_stale_keys_go_first_then_all() {
        let contended = ContendedKeys::default();
        let keys: Vec<_> = (0..=CONTENDED_KEYS)
            .map(|n| LockKey::new(format!("k{n}")).unwrap())
            .collect();
        for key in &keys[..CONTENDED_KEYS] {
            contended.found_taken(key);
        }
        assert!(contended.is_contended(&keys[0]));
        // Every one fresh: all forgotten for the newcomer.
        contended.found_taken(&keys[CONTENDED_KEYS]);
        assert!(!contended.is_contended(&keys[0]));
        assert!(contended.is_contended(&keys[CONTENDED_KEYS]));
        assert_eq!(contended.found.lock().unwrap().len(), 1);
        // A stale key is forgotten to make room, the fresh ones kept.
        let mut found = contended.found.lock().unwrap();
        found.clear();
        let stale = Instant::now() - CONTENDED_FOR - Duration::from_secs(1);
        for (n, key) in keys[..CONTENDED_KEYS].iter().enumerate() {
            found.insert(key.clone(), if n == 0 { stale } else { Instant::now() });
        }
        drop(found);
        assert!(!contended.is_contended(&keys[0]), "stale");
        contended.found_taken(&keys[CONTENDED_KEYS]);
        assert!(contended.is_contended(&keys[1]));
        assert_eq!(contended.found.lock().unwrap().len(), CONTENDED_KEYS);
    }
}
