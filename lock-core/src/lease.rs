//! What an acquisition hands back: the lease, its owner token and fencing token.

use std::fmt;
use std::time::{Duration, Instant};

use rand::RngCore;

use crate::LockKey;

/// A number that grows with every acquisition of a key.
///
/// Every acquisition returns a token strictly greater than every earlier token
/// for that key (while the server keeps its data); extending does not change
/// it. Pass it to the resource you protect so it can reject writes from a
/// holder that lost the lock without knowing (a paused process, a partition).
///
/// ```
/// use distlock_core::FencingToken;
/// assert!(FencingToken::new(2) > FencingToken::new(1));
/// assert_eq!(FencingToken::new(7).get(), 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The random 128-bit identity of one acquisition.
///
/// Release and extend compare it on the server, so nobody can release or
/// extend a lock they do not hold. It is never a host name or thread id
/// (tokio tasks move between threads), and it is never logged: `Debug`
/// redacts it.
///
/// ```
/// use distlock_core::OwnerToken;
/// let token = OwnerToken::random();
/// assert_eq!(OwnerToken::from_hex(&token.to_hex()), Some(token));
/// assert_ne!(OwnerToken::random(), token);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(u128);

impl OwnerToken {
    /// A fresh token from the operating system's random source.
    pub fn random() -> Self {
        Self(rand::rng().next_u64() as u128 | ((rand::rng().next_u64() as u128) << 64))
    }

    /// The token as 32 lowercase hex characters, the form backends store.
    pub fn to_hex(&self) -> String {
        // By hand: every request sends one or two of these, and `{:032x}`
        // takes the formatter's padding path.
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = String::with_capacity(32);
        for byte in self.0.to_be_bytes() {
            hex.push(char::from(DIGITS[usize::from(byte >> 4)]));
            hex.push(char::from(DIGITS[usize::from(byte & 0xf)]));
        }
        hex
    }

    /// Parses the 32-hex-character form; `None` for anything else (so a
    /// foreign value found on a server is recognised as such).
    pub fn from_hex(text: &str) -> Option<Self> {
        if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(text, 16).ok().map(Self)
    }

    /// The 16 raw bytes, big-endian.
    pub fn to_bytes(&self) -> [u8; 16] {
        self.0.to_be_bytes()
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OwnerToken(<redacted>)")
    }
}

/// Identifies the client that issued a lease, so a lease handed to another
/// client or backend is refused with a clear error instead of acting on the
/// wrong server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct LeaseIssuer(u64);

impl LeaseIssuer {
    /// A fresh random issuer id; a client makes one when it is created.
    pub(crate) fn random() -> Self {
        Self(rand::rng().next_u64())
    }
}

/// How much of a TTL the client does not trust: clocks of client and server
/// may run at slightly different rates (1%) and timers fire late (2 ms).
pub(crate) fn clock_drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// `at + duration`, saturating far in the future instead of panicking: a
/// huge duration from user input or a server's reply means "never".
pub(crate) fn later(at: Instant, duration: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    at.checked_add(duration)
        .or_else(|| at.checked_add(CENTURY))
        .unwrap_or(at)
}

/// One successful acquisition of a key.
///
/// Holds the key, the owner token the server checks, the fencing token, and a
/// conservative local deadline: computed from the moment *before* the request
/// was sent, minus an allowance for clock drift, so the holder never believes
/// it holds a lock the server may already have expired.
#[derive(Clone, PartialEq, Eq)]
pub struct Lease {
    key: LockKey,
    owner: OwnerToken,
    fencing: FencingToken,
    ttl: Duration,
    sent_at: Instant,
    valid_until: Instant,
    issuer: LeaseIssuer,
    handle: u64,
    permit_limit: Option<u32>,
}

impl Lease {
    /// Builds a lease after the server granted `key` to `owner` for `ttl`,
    /// with `sent_at` taken *before* the request was sent.
    pub(crate) fn new(
        key: LockKey,
        owner: OwnerToken,
        fencing: FencingToken,
        sent_at: Instant,
        ttl: Duration,
        issuer: LeaseIssuer,
    ) -> Self {
        let valid_until = later(sent_at, ttl.saturating_sub(clock_drift(ttl)));
        Self {
            key,
            owner,
            fencing,
            ttl,
            sent_at,
            valid_until,
            issuer,
            handle: 0,
            permit_limit: None,
        }
    }

    /// Attaches a backend-defined number (an etcd lease id, say).
    pub(crate) fn with_handle(mut self, handle: u64) -> Self {
        self.handle = handle;
        self
    }

    /// The same lease, renewed: a new TTL counted from `sent_at`. Owner and
    /// fencing token stay.
    pub(crate) fn renewed(&self, sent_at: Instant, ttl: Duration) -> Self {
        let mut lease = Self::new(
            self.key.clone(),
            self.owner,
            self.fencing,
            sent_at,
            ttl,
            self.issuer,
        );
        lease.handle = self.handle;
        lease.permit_limit = self.permit_limit;
        lease
    }

    /// Marks the lease as one permit of a semaphore of `limit`.
    pub(crate) fn into_permit(mut self, limit: u32) -> Self {
        self.permit_limit = Some(limit);
        self
    }

    /// `Some(limit)` if this lease is a semaphore permit, `None` for a lock.
    pub fn permit_limit(&self) -> Option<u32> {
        self.permit_limit
    }

    /// The key this lease holds.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The owner token the server checks on release and extend.
    pub fn owner(&self) -> OwnerToken {
        self.owner
    }

    /// The fencing token of this acquisition.
    pub fn fencing_token(&self) -> FencingToken {
        self.fencing
    }

    /// The TTL last granted by the server (after rounding to its granularity).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// When the request that granted or last renewed this lease was sent.
    pub fn sent_at(&self) -> Instant {
        self.sent_at
    }

    /// Until when the holder may assume it holds the lock. Conservative: the
    /// server keeps it at least this long unless someone deletes it.
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// Whether the conservative local deadline has passed.
    pub fn is_expired(&self) -> bool {
        Instant::now() >= self.valid_until
    }

    /// The client that issued this lease.
    pub(crate) fn issuer(&self) -> LeaseIssuer {
        self.issuer
    }

    /// The lock as the raw backend sees it (for tests and wrappers that act
    /// below the client).
    pub fn held(&self) -> crate::HeldLock<'_> {
        crate::HeldLock {
            key: &self.key,
            owner: self.owner,
            fencing: self.fencing,
            handle: self.handle,
        }
    }

    /// The backend-defined number the server's grant carried
    /// ([`Grant::handle`](crate::Grant::handle)).
    pub fn handle(&self) -> u64 {
        self.handle
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("fencing", &self.fencing)
            .field("ttl", &self.ttl)
            .field("valid_until", &self.valid_until)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::OwnerToken;

    /// The hand-written hex is `{:032x}`'s: 32 lowercase digits, leading
    /// zeros kept (servers store and compare it as text).
    #[test]
    fn owner_hex_is_32_lowercase_digits() {
        for n in [0, 1, 0xabc, u128::from(u64::MAX), u128::MAX, 0x0f << 120] {
            let hex = OwnerToken(n).to_hex();
            assert_eq!(hex, format!("{n:032x}"));
            assert_eq!(OwnerToken::from_hex(&hex), Some(OwnerToken(n)));
        }
        let token = OwnerToken::random();
        assert_eq!(token.to_hex(), format!("{:032x}", token.0));
    }
}
