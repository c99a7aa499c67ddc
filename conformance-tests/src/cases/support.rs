//! Helpers shared by the cases (free functions over the public contract).

use std::future::Future;
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, ErrorKind, FencingToken, Lease, LockClient, LockError, LockGuard, LockKey,
    LockOptions, LockState, Locker, LostReason, RunOutcome,
};

use crate::context::{CaseError, TestContext};
use crate::ObservedLock;

/// How often a case re-checks something that becomes true "eventually"
/// (a TTL ran out on the server, a background release landed).
pub const POLL: Duration = Duration::from_millis(25);

/// A generous bound for a lock of `ttl` to be freed by the server after its
/// TTL: the TTL twice over plus 5 s for servers that expire in batches
/// (etcd revokes expired leases periodically). Not a timing assertion: a
/// conforming backend frees the key long before; this only stops a broken
/// one from hanging the case.
pub fn expiry_bound(ttl: Duration) -> Duration {
    ttl * 2 + Duration::from_secs(5)
}

/// A bound for things that should happen "at once" but go through a
/// background task and a network round trip (a dropped guard's release).
/// Far below [`TestContext::long_ttl`], so expiry cannot be what happened.
pub fn background_bound() -> Duration {
    Duration::from_secs(10)
}

/// A holder label, failing the case (naming the label) if it is invalid.
pub fn holder_id(label: &str) -> Result<distlock_core::HolderId, CaseError> {
    distlock_core::HolderId::new(label).map_err(|e| CaseError(format!("holder id {label:?}: {e}")))
}

/// A key `"{stem}{suffix}"`, failing the case if it is invalid.
pub fn key_with(stem: &str, suffix: &str) -> Result<LockKey, CaseError> {
    LockKey::new(format!("{stem}{suffix}"))
        .map_err(|e| CaseError(format!("test key {stem:?}+{suffix:?} refused: {e}")))
}

/// A random stem for a family of keys built with [`key_with`].
pub fn stem(label: &str) -> String {
    format!("{label}-{}-", crate::naming::random_hex())
}

/// `try_acquire` that must succeed.
pub async fn acquire(
    lock: &LockClient,
    key: &LockKey,
    ttl: Duration,
    what: &str,
) -> Result<Lease, CaseError> {
    match lock.try_acquire(key, ttl).await {
        Ok(AcquireAttempt::Acquired(lease)) => Ok(lease),
        Ok(AcquireAttempt::Held { expires_in }) => Err(CaseError(format!(
            "{what}: key {key:?} should be free but is held (expires_in {expires_in:?})"
        ))),
        Err(e) => Err(CaseError(format!(
            "{what}: try_acquire of {key:?} failed: {e}"
        ))),
    }
}

/// `Locker::try_lock` of a key nobody holds, for cases about what a guard
/// does once it holds a lock (not about how fast a grant arrives). A grant
/// that came back too late to use for its short TTL (a loaded machine:
/// the client gives it back and says `Timeout`) is tried again, a few
/// times, after the client has given back what it took; any other error,
/// or a refusal, ends the case.
pub async fn lock_free_key(
    locker: &Locker,
    key: &LockKey,
    options: &LockOptions,
) -> Result<LockGuard, CaseError> {
    let mut tries = 0;
    loop {
        tries += 1;
        match locker.try_lock(key, options).await {
            Ok(Some(guard)) => return Ok(guard),
            Ok(None) => return Err(format!("free key {:?} refused", key.as_str()).into()),
            Err(e) if e.kind() == ErrorKind::Timeout && tries < 5 => {
                within(
                    Duration::from_secs(30),
                    locker.client().idle(),
                    "the give-back of a late grant",
                )
                .await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// `try_acquire` that must be refused; a wrongly granted lease is released
/// before failing.
pub async fn refused(lock: &LockClient, key: &LockKey, what: &str) -> Result<(), CaseError> {
    match lock.try_acquire(key, Duration::from_secs(5)).await {
        Ok(AcquireAttempt::Held { .. }) => Ok(()),
        Ok(AcquireAttempt::Acquired(lease)) => {
            let _ = lock.release(&lease).await;
            Err(CaseError(format!(
                "{what}: key {key:?} should be held by someone else, but another client acquired it"
            )))
        }
        Err(e) => Err(CaseError(format!(
            "{what}: try_acquire of {key:?} failed: {e}"
        ))),
    }
}

/// Polls `try_acquire` until it succeeds or `bound` passes.
pub async fn eventually_acquire(
    lock: &LockClient,
    key: &LockKey,
    ttl: Duration,
    bound: Duration,
    what: &str,
) -> Result<Lease, CaseError> {
    let give_up = tokio::time::Instant::now() + bound;
    loop {
        match lock.try_acquire(key, ttl).await {
            Ok(AcquireAttempt::Acquired(lease)) => return Ok(lease),
            Ok(AcquireAttempt::Held { .. }) => {}
            Err(e) => {
                return Err(CaseError(format!(
                    "{what}: try_acquire of {key:?} failed: {e}"
                )))
            }
        }
        if tokio::time::Instant::now() >= give_up {
            return Err(CaseError(format!(
                "{what}: key {key:?} was still held after {bound:?}"
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A fresh client takes every key of `keys` (for `ttl`), each within
/// `bound` (nothing a fault left behind stays held past its TTL), and gives
/// each back.
pub async fn every_key_free_within(
    fresh: &LockClient,
    keys: &[LockKey],
    ttl: Duration,
    bound: Duration,
    what: &str,
) -> Result<(), CaseError> {
    for key in keys {
        let lease = eventually_acquire(fresh, key, ttl, bound, what).await?;
        fresh.release(&lease).await?;
    }
    Ok(())
}

/// The fencing token of a job that `run_exclusive` stopped because its
/// lock was lost for `reason` (a stopped job has no output); an error for
/// any other outcome.
pub fn expect_stopped<T: std::fmt::Debug>(
    outcome: RunOutcome<T>,
    reason: LostReason,
) -> Result<FencingToken, CaseError> {
    match outcome {
        RunOutcome::Lost {
            output,
            fencing_token,
            reason: got,
        } => {
            crate::check!(output.is_none(), "a stopped job has no output: {output:?}");
            crate::check_eq!(got, reason, "why the lock was lost");
            Ok(fencing_token)
        }
        other => Err(format!("expected Lost ({reason}), got {other:?}").into()),
    }
}

/// Fails unless `result` is an error of `kind`.
pub fn expect_kind<T: std::fmt::Debug>(
    result: Result<T, LockError>,
    kind: ErrorKind,
    what: &str,
) -> Result<(), CaseError> {
    match result {
        Err(e) if e.kind() == kind => Ok(()),
        Err(e) => Err(CaseError(format!(
            "{what}: expected a {kind:?} error, got {:?}: {e}",
            e.kind()
        ))),
        Ok(v) => Err(CaseError(format!(
            "{what}: expected a {kind:?} error, got success: {v:?}"
        ))),
    }
}

/// Awaits `future`, failing the case if it takes longer than `bound` (a
/// liveness bound against hangs, never a performance assertion).
pub async fn within<F: Future>(
    bound: Duration,
    future: F,
    what: &str,
) -> Result<F::Output, CaseError> {
    tokio::time::timeout(bound, future)
        .await
        .map_err(|_| CaseError(format!("{what}: did not happen within {bound:?}")))
}

/// A fresh client, for cases that open many.
pub async fn clients(ctx: &TestContext, n: usize) -> Result<Vec<LockClient>, CaseError> {
    let mut all = Vec::with_capacity(n);
    for _ in 0..n {
        all.push(ctx.client().await?);
    }
    Ok(all)
}

/// Waits until `observed` has made at least `n` acquisition attempts in
/// line ([`ObservedLock::attempts_in_line`]): a waiter counted there
/// subscribed to release notifications before that attempt, so once it
/// was refused the waiter is in line and blocked, and a release now must
/// wake it. Polls; `background_bound` is the hang bound.
pub async fn until_attempts(observed: &ObservedLock, n: u64, what: &str) -> Result<(), CaseError> {
    within(
        background_bound(),
        async {
            while observed.attempts_in_line() < n {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        },
        &format!("{what}: {n} acquisition attempt(s)"),
    )
    .await
}

/// What the server says about `key` right now, through `observer`: its
/// holder's fencing token, or `None` if free. Uses `inspect` where the
/// backend has it; otherwise a `try_acquire` probe (a key it gets is
/// released at once, and a holder's token is then unknown: `Some(None)`).
pub async fn holder_of(
    observer: &LockClient,
    key: &LockKey,
) -> Result<Option<Option<FencingToken>>, CaseError> {
    if observer.admin().is_some() {
        return match observer.inspect(key).await {
            Ok(LockState::Held { fencing_token, .. }) => Ok(Some(Some(fencing_token))),
            Ok(LockState::Free) => Ok(None),
            Err(e) => Err(CaseError(format!("inspect of {key:?} failed: {e}"))),
        };
    }
    match observer.try_acquire(key, Duration::from_secs(5)).await {
        Ok(AcquireAttempt::Held { .. }) => Ok(Some(None)),
        Ok(AcquireAttempt::Acquired(lease)) => {
            let _ = observer.release(&lease).await;
            Ok(None)
        }
        Err(e) => Err(CaseError(format!("probe of {key:?} failed: {e}"))),
    }
}

/// Whether `holder` (a fencing token) still holds `key` per the server.
pub async fn still_held_by(
    observer: &LockClient,
    key: &LockKey,
    holder: FencingToken,
) -> Result<bool, CaseError> {
    Ok(match holder_of(observer, key).await? {
        Some(Some(token)) => token == holder,
        Some(None) => true,
        None => false,
    })
}

/// Calls `try_acquire` on `key` every millisecond until it is granted
/// (`Some(lease, instant the reply arrived)`) or `give_up` returns true
/// after a refused attempt (`None`); fails after `bound`.
pub async fn spin_acquire(
    lock: &LockClient,
    key: &LockKey,
    ttl: Duration,
    bound: Duration,
    mut give_up: impl FnMut() -> bool,
    what: &str,
) -> Result<Option<(Lease, Instant)>, CaseError> {
    let hang = Instant::now() + bound;
    loop {
        match lock.try_acquire(key, ttl).await {
            Ok(AcquireAttempt::Acquired(lease)) => return Ok(Some((lease, Instant::now()))),
            Ok(AcquireAttempt::Held { .. }) => {}
            Err(e) => {
                return Err(CaseError(format!(
                    "{what}: try_acquire of {key:?} failed: {e}"
                )))
            }
        }
        if give_up() {
            return Ok(None);
        }
        if Instant::now() >= hang {
            return Err(CaseError(format!(
                "{what}: key {key:?} was still held after {bound:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
