//! The shared waiting loop: subscribe, attempt, sleep until woken, repeat;
//! transient errors are retried with backoff until the deadline.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::lease::later;
use crate::HolderId;
use crate::{
    AcquireAttempt, ErrorKind, Lease, LockClient, LockError, LockKey, LockOptions, OwnerToken,
    ReleaseWatch,
};

/// Extra wait after a holder's predicted expiry, so the retry lands after the
/// server expired it rather than just before.
const EXPIRY_SLACK: Duration = Duration::from_millis(2);

/// First and longest pause between attempts that failed transiently
/// (a failover, a restarting server); also between a resign's resends.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(50);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How long a wait that ended without the lock waits, past its deadline,
/// for its backend to take it out of the server's line
/// ([`ReleaseWatch::close`]): about one request, more only when the server
/// is slow or gone.
const DEPARTURE_MAX: Duration = Duration::from_secs(2);

/// Which acquisition the waiting loop makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Attempt {
    /// A guard will renew it (a backend may attach it to a session).
    pub(crate) renewing: bool,
    /// `Some(limit)`: one permit of a semaphore of `limit`, not the lock.
    pub(crate) permits: Option<u32>,
    /// Only settles an earlier attempt whose outcome is unknown: what it is
    /// granted is given back at once.
    pub(crate) settling: bool,
    /// Stored with the lock for people to read.
    pub(crate) holder: Option<HolderId>,
}

impl Attempt {
    /// A lock nobody will renew.
    pub(crate) const PLAIN: Attempt = Attempt {
        renewing: false,
        permits: None,
        settling: false,
        holder: None,
    };

    /// A lock a guard will renew.
    pub(crate) const RENEWING: Attempt = Attempt {
        renewing: true,
        ..Attempt::PLAIN
    };

    /// One permit of a semaphore of `limit` nobody will renew.
    pub(crate) const fn permit(limit: u32) -> Attempt {
        Attempt {
            permits: Some(limit),
            ..Attempt::PLAIN
        }
    }

    /// The same acquisition, renewed by a guard or not.
    pub(crate) fn renewed(self, renewing: bool) -> Attempt {
        Attempt { renewing, ..self }
    }

    /// The same acquisition, labelled with `holder`.
    pub(crate) fn held_by(self, holder: Option<HolderId>) -> Attempt {
        Attempt { holder, ..self }
    }

    /// The operation, as an error's context names it.
    pub(crate) const fn operation(&self) -> &'static str {
        match self.permits {
            None => "acquire",
            Some(_) => "acquire a permit",
        }
    }

    /// The attempt that settles this one's unknown outcome.
    pub(crate) fn settling(&self) -> Attempt {
        Attempt {
            settling: true,
            ..self.clone()
        }
    }
}

/// A granted lease the loop gives back and tries again for (time
/// permitting): one already expired, or, for a guard, one already inside
/// its stop margin.
fn unusable(lease: &Lease, options: Option<&LockOptions>, now: Instant) -> bool {
    let margin = options.map_or(Duration::ZERO, |o| o.stop_margin_for(lease.ttl()));
    lease
        .valid_until()
        .checked_sub(margin)
        .is_none_or(|stop_at| now >= stop_at)
}

/// Waits for `key` until `deadline`; gives up (`Ok(None)`) when `cancel`
/// fires. Cancellation is only observed between attempts, never while an
/// attempt is in flight, so a lock the server granted is always returned
/// (to a caller that is gone, if it was cancelled: the task releases it).
/// `Unavailable`/`Timeout` errors are retried with backoff while the
/// deadline allows; the last one is returned when it passes.
///
/// Every attempt uses one owner token, so a lock an attempt took although
/// its reply never came (its outcome unknown) is handed back by the next
/// one (the backend adopts it). If the loop ends while the last attempt's
/// outcome is unknown, one more attempt with that token settles it: on the
/// task when cancelled, in the background when an error is returned.
pub(crate) async fn acquire_until_cancelled(
    client: &LockClient,
    key: &LockKey,
    ttl: Duration,
    deadline: Instant,
    attempt: &Attempt,
    guard_options: Option<&LockOptions>,
    cancel: &CancellationToken,
) -> Result<Option<Lease>, LockError> {
    let caps = client.capabilities().clone();
    let mut watch: Option<ReleaseWatch> = None;
    let mut never = ReleaseWatch::never();
    let mut backoff = BACKOFF_MIN;
    let mut attempts = 0u64;
    let mut owner = OwnerToken::random();
    // Whether the last attempt failed after it may have reached the server.
    let mut unknown = false;
    // Where registering costs a request, attempts go unregistered until
    // the first refusal (a free key needs no watch, nor does the retry of
    // an attempt whose outcome is unknown); then the loop registers and
    // attempts again at once.
    let mut unregistered = caps.native_wait && caps.attempt_before_watch;
    loop {
        if cancel.is_cancelled() {
            return Ok(settle(client, key, ttl, attempt, owner, unknown).await);
        }
        // Subscribe before the attempt: a release between a failed attempt
        // and a later subscription would otherwise be missed. The watch
        // names this waiter by its owner token (a server that wakes one
        // waiter per release queues it by that token).
        let mut watch_error = None;
        if watch.is_none() && caps.native_wait && !unregistered && Instant::now() < deadline {
            let subscribed = match attempt.permits {
                None => client.raw().watch(key, owner).await,
                Some(limit) => client.watch_permits(key, limit, owner).await,
            };
            match subscribed {
                Ok(subscribed) => watch = subscribed,
                Err(e) if e.is_transient() => watch_error = Some(e),
                Err(e) => {
                    if unknown {
                        client.settle_in_background(key, ttl, attempt, owner);
                    }
                    return Err(e);
                }
            }
        }
        let result = match watch_error {
            // No subscription: an attempt now could miss the next release.
            Some(e) => Err(e),
            None => {
                attempts += 1;
                let result =
                    attempt_giving_back_on_cancel(client, key, ttl, attempt, owner, cancel).await;
                unknown = matches!(&result, Err(e) if e.is_transient());
                result
            }
        };
        let now = Instant::now();
        let wake_at = match result {
            Ok(AcquireAttempt::Acquired(lease))
                if now < deadline && unusable(&lease, guard_options, now) =>
            {
                // Granted too late to use (a slow reply, a dying session):
                // give it back and try again. Awaited, so that no retry
                // adopts the lock this give-back then deletes; if its
                // outcome is unknown, later attempts use a new token.
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), "lock granted too late to use; releasing it and retrying");
                match client.release(&lease).await {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotHeld => {}
                    Err(e) => {
                        tracing::debug!(key = %key, error = %e, "giving back a late grant failed; it expires after its TTL");
                        owner = OwnerToken::random();
                        // The watch names the waiter by its owner token.
                        watch = None;
                    }
                }
                later(Instant::now(), caps.retry_interval.min(backoff))
            }
            Ok(AcquireAttempt::Acquired(lease)) => {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), attempts, "lock acquired after waiting");
                return Ok(Some(lease));
            }
            Ok(AcquireAttempt::Held { expires_in }) => {
                if now >= deadline {
                    tracing::debug!(key = %key, attempts, "lock still held at deadline");
                    // Out of the line before returning: the caller's next
                    // attempt must not meet this wait's turn.
                    leave_line(watch.take()).await;
                    return Ok(None);
                }
                backoff = BACKOFF_MIN;
                if unregistered {
                    // Refused before registering: register, then attempt
                    // again (a release since is seen by that attempt).
                    unregistered = false;
                    continue;
                }
                let mut wake_at = deadline;
                if let Some(expires_in) = expires_in {
                    wake_at = wake_at.min(later(now, expires_in.saturating_add(EXPIRY_SLACK)));
                }
                if watch.is_none() {
                    wake_at = wake_at.min(later(now, caps.retry_interval));
                }
                tracing::trace!(key = %key, ?expires_in, "waiting for release");
                wake_at
            }
            Err(e) if e.is_transient() && now < deadline => {
                tracing::debug!(key = %key, error = %e, retry_in = ?backoff, "transient error while waiting; retrying");
                let wake_at = deadline.min(later(now, backoff));
                backoff = (backoff * 2).min(BACKOFF_MAX);
                wake_at
            }
            Err(e) => {
                if unknown {
                    client.settle_in_background(key, ttl, attempt, owner);
                }
                return Err(e);
            }
        };
        let watch_ref = watch.as_mut().unwrap_or(&mut never);
        tokio::select! {
            _ = cancel.cancelled() => {
                let settled = settle(client, key, ttl, attempt, owner, unknown).await;
                // Out of the line before the task ends, so that the
                // client's `idle` covers the leave.
                leave_line(watch.take()).await;
                return Ok(settled);
            }
            woke = watch_ref.released() => {
                if let Err(e) = woke {
                    tracing::debug!(key = %key, error = %e, "release subscription failed; subscribing again");
                    watch = None;
                }
            }
            _ = tokio::time::sleep_until(wake_at.into()) => {}
        }
    }
}

/// Closes a wait's watch, if it has one, and waits (at most
/// [`DEPARTURE_MAX`]) until the backend took the wait out of its line.
async fn leave_line(watch: Option<ReleaseWatch>) {
    if let Some(watch) = watch {
        watch.close(DEPARTURE_MAX).await;
    }
}

/// One attempt. If `cancel` fires while it is in flight, a settling attempt
/// with the same owner token runs beside it and gives back what it finds:
/// the caller is gone, and a lock the attempt took should not wait for a
/// reply the server may hold up for the whole operation timeout (a Redis
/// `WAIT` for replicas, say). The attempt still runs to completion, and
/// what it is granted is given back after it (an undo that a late reply
/// cannot outlive: both are conditional on the owner token).
async fn attempt_giving_back_on_cancel(
    client: &LockClient,
    key: &LockKey,
    ttl: Duration,
    attempt: &Attempt,
    owner: OwnerToken,
    cancel: &CancellationToken,
) -> Result<AcquireAttempt, LockError> {
    let in_flight = client.attempt(key, ttl, attempt, owner);
    tokio::pin!(in_flight);
    tokio::select! {
        biased;
        result = &mut in_flight => return result,
        () = cancel.cancelled() => {}
    }
    client.settle_in_background(key, ttl, attempt, owner);
    in_flight.await
}

/// After cancellation: if the last attempt's outcome is unknown, one more
/// attempt under its token finds the lock it may have taken (for the task
/// to release, as its caller is gone).
async fn settle(
    client: &LockClient,
    key: &LockKey,
    ttl: Duration,
    attempt: &Attempt,
    owner: OwnerToken,
    unknown: bool,
) -> Option<Lease> {
    if !unknown {
        return None;
    }
    client.settle(key, ttl, attempt, owner).await
}
