//! Requests whose outcome is unknown to the client: the request reached the
//! server and was applied, but its reply was held past the client's
//! operation timeout ([`FaultPath::hold`] of [`Direction::ToClient`]).
//!
//! `fault::late_reply_*` hold the reply of every operation in turn — a
//! plain and a renewing acquire, extend, release, the attempts of a waiting
//! acquire, a waiter's queue join and leave, and the same for permits —
//! and check what must hold once the dust settles: no key stays held by
//! nobody for longer than its TTL (another client waiting for it gets it),
//! a waiter that could get the lock gets it before its deadline, and a
//! waiting acquire whose first attempt was applied unseen returns that
//! lock (its retries reuse the owner token, and the backend adopts it)
//! instead of waiting on its own orphan.
//!
//! `lease::same_owner_*` check the backend's side of that rule at the raw
//! level: an acquire by the owner token that already holds the key is
//! granted that same lock (same fencing token) and resets its TTL from
//! now, so the adopted lease's deadline never outlives the server's expiry.
//!
//! Every bound here is a hang detector far above what a conforming backend
//! needs; the checks are causes (who holds what, which call was woken by
//! which release), never durations. A key a waiter must get "before its
//! deadline" is held by a lock whose TTL is far longer than that deadline,
//! so only the event under test can have let it in.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, AcquireReply, AcquireRequest, ErrorKind, FencingToken, Grant, HeldLock,
    HolderId, Lease, LockClient, LockError, LockGuard, LockKey, LockOptions, Locker, OwnerToken,
    PermitReply, PermitRequest, ReleaseReply,
};

use super::lease::server_holds_until_deadline;
use super::support::{
    acquire, background_bound, expect_kind, expiry_bound, holder_of, until_attempts, within,
};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::{Direction, FaultPath};
use crate::{check, check_eq, Call, ObservedLock};

/// Operation (and connect) timeout of the clients whose replies are held:
/// each held call ends with a `Timeout` after it. Long enough for the
/// unheld calls of a loaded machine.
const HELD_TIMEOUT: Duration = Duration::from_secs(2);

/// TTL of a lock a case lets run out after the held request.
const RUN_OUT_TTL: Duration = Duration::from_secs(3);

/// How long a waiter waits where only the event under test can let it in:
/// far below [`TestContext::long_ttl`], the TTL of what it waits for.
const WAITER_WAIT: Duration = Duration::from_secs(20);

/// What a case takes: the lock, or a permit of a semaphore of one (which
/// behaves as the lock, in the semaphore's own key space).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Lock,
    Permit,
}

impl Target {
    fn label(self) -> &'static str {
        match self {
            Target::Lock => "lock",
            Target::Permit => "permit",
        }
    }

    /// One attempt (a permit attempt is never a renewing one at this level).
    async fn attempt(
        self,
        client: &LockClient,
        key: &LockKey,
        ttl: Duration,
        renewing: bool,
    ) -> Result<AcquireAttempt, LockError> {
        match (self, renewing) {
            (Target::Lock, false) => client.try_acquire(key, ttl).await,
            (Target::Lock, true) => client.try_acquire_renewing(key, ttl).await,
            (Target::Permit, _) => client.try_acquire_permit(key, 1, ttl).await,
        }
    }

    /// A waiting acquire until `deadline`.
    async fn wait(
        self,
        client: &LockClient,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<Lease>, LockError> {
        match self {
            Target::Lock => client.acquire(key, ttl, deadline).await,
            Target::Permit => client.acquire_permit(key, 1, ttl, deadline).await,
        }
    }

    /// Guard options for `ttl`, waiting `wait`.
    fn options(self, ttl: Duration, wait: Duration) -> LockOptions {
        let options = LockOptions::new(ttl).with_wait(wait);
        match self {
            Target::Lock => options,
            Target::Permit => options.with_permits(1),
        }
    }

    /// One attempt that must be granted.
    async fn take(
        self,
        client: &LockClient,
        key: &LockKey,
        ttl: Duration,
        what: &str,
    ) -> Result<Lease, CaseError> {
        match self.attempt(client, key, ttl, false).await {
            Ok(AcquireAttempt::Acquired(lease)) => Ok(lease),
            Ok(held) => Err(CaseError(format!(
                "{what}: the {} {key:?} should be free, got {held:?}",
                self.label()
            ))),
            Err(e) => Err(CaseError(format!(
                "{what}: taking the {} {key:?} failed: {e}",
                self.label()
            ))),
        }
    }

    /// One attempt that must be refused (a wrong grant is given back).
    async fn refused(self, client: &LockClient, key: &LockKey, what: &str) -> CaseResult {
        match self
            .attempt(client, key, Duration::from_secs(5), false)
            .await
        {
            Ok(AcquireAttempt::Held { .. }) => Ok(()),
            Ok(AcquireAttempt::Acquired(lease)) => {
                let _ = client.release(&lease).await;
                Err(CaseError(format!(
                    "{what}: the {} {key:?} should be held, but another client got it",
                    self.label()
                )))
            }
            Err(e) => Err(CaseError(format!(
                "{what}: attempt at the {} {key:?} failed: {e}",
                self.label()
            ))),
        }
    }

    /// Waits for the key to come free as a lock of `ttl` nobody renews
    /// runs out: another client waiting for it must get it.
    async fn freed_within(
        self,
        client: &LockClient,
        key: &LockKey,
        ttl: Duration,
        what: &str,
    ) -> Result<Lease, CaseError> {
        let bound = expiry_bound(ttl);
        let deadline = Instant::now() + bound;
        match within(
            bound + background_bound(),
            self.wait(client, key, Duration::from_secs(60), deadline),
            what,
        )
        .await?
        {
            Ok(Some(lease)) => Ok(lease),
            Ok(None) => Err(CaseError(format!(
                "{what}: the {} {key:?} was still held {bound:?} later, although nobody holds it and its TTL is {ttl:?}: a lock the client never learned of outlived its TTL",
                self.label()
            ))),
            Err(e) => Err(CaseError(format!(
                "{what}: waiting for the {} {key:?} failed: {e}",
                self.label()
            ))),
        }
    }
}

/// A client behind a new fault path whose connections (and any session)
/// were set up by one round of every call a case makes, so that holding
/// the path's replies falls on the case's own requests only.
async fn held_client(
    ctx: &TestContext,
    target: Target,
) -> Result<(FaultPath, LockClient), CaseError> {
    let path = ctx.fault_path().await?;
    let client = ctx.client_through_with(&path, HELD_TIMEOUT).await?;
    let scratch = ctx.key("late-reply-warm-up");
    let ttl = ctx.long_ttl();
    let lease = acquire(&client, &scratch, ttl, "warm-up").await?;
    client.extend(&lease, ttl).await?;
    client.release(&lease).await?;
    if let Some(renewing) = client.try_acquire_renewing(&scratch, ttl).await?.lease() {
        client.release(&renewing).await?;
    }
    if target == Target::Permit {
        let permit = target.take(&client, &scratch, ttl, "warm-up").await?;
        client.release(&permit).await?;
    }
    Ok((path, client))
}

/// Awaits a call whose reply is held: it must end (within a hang bound)
/// with a transient error, its outcome unknown to the client.
async fn unknown<T: Debug>(
    call: impl Future<Output = Result<T, LockError>>,
    what: &str,
) -> CaseResult {
    match within(HELD_TIMEOUT + background_bound(), call, what).await? {
        Err(e) if e.is_transient() => Ok(()),
        Err(e) => Err(CaseError(format!(
            "{what}: with its reply held, the call must fail as transient (its outcome unknown), got {:?}: {e}",
            e.kind()
        ))),
        Ok(answer) => Err(CaseError(format!(
            "{what}: answered {answer:?} although its reply was held back: the fault path did not hold it"
        ))),
    }
}

async fn joined<T>(
    task: tokio::task::JoinHandle<T>,
    bound: Duration,
    what: &str,
) -> Result<T, CaseError> {
    within(bound, task, what)
        .await?
        .map_err(|e| CaseError(format!("{what} panicked: {e}")))
}

/// Rounds of a case run at once, each with clients and a fault path of its
/// own: a race a backend loses in one round of several shows.
const ROUNDS: usize = 3;

/// Runs `round` [`ROUNDS`] times at once; the first failure fails the case.
async fn in_rounds<F, Fut>(ctx: TestContext, round: F) -> CaseResult
where
    F: Fn(TestContext) -> Fut,
    Fut: Future<Output = CaseResult> + Send + 'static,
{
    let rounds: Vec<_> = (0..ROUNDS)
        .map(|_| tokio::spawn(round(ctx.clone())))
        .collect();
    for (i, round) in rounds.into_iter().enumerate() {
        let bound = WAITER_WAIT * 2 + background_bound() * 3;
        joined(round, bound, "a round")
            .await?
            .map_err(|e| CaseError(format!("round {i}: {e}")))?;
    }
    Ok(())
}

/// A plain acquire whose reply is held: the lock the server granted
/// nobody must be free once its TTL ran out.
pub async fn late_reply_acquire(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, move |ctx| late_attempt(ctx, Target::Lock, false)).await
}

/// A renewing acquire (a backend may attach it to a session its client
/// keeps alive) whose reply is held: the lock nobody knows of must be free
/// once its TTL ran out, while the client that sent it lives on.
pub async fn late_reply_renewing_acquire(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, move |ctx| late_attempt(ctx, Target::Lock, true)).await
}

/// A permit attempt whose reply is held: the permit must come back once its
/// TTL ran out.
pub async fn late_reply_permit_acquire(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, move |ctx| late_attempt(ctx, Target::Permit, false)).await
}

async fn late_attempt(ctx: TestContext, target: Target, renewing: bool) -> CaseResult {
    let ttl = ctx.capabilities().effective_ttl(RUN_OUT_TTL)?;
    let (path, held) = held_client(&ctx, target).await?;
    let other = ctx.client().await?;
    let key = ctx.key("late-acquire");
    path.hold(Direction::ToClient);
    unknown(
        target.attempt(&held, &key, ttl, renewing),
        "an attempt whose reply is held",
    )
    .await?;
    path.pass(Direction::ToClient);
    let next = target
        .freed_within(&other, &key, ttl, "another client after the held attempt")
        .await?;
    // The late reply changed nothing, and the client that sent it works on.
    target
        .refused(
            &held,
            &key,
            "the held client, once the other client took the key",
        )
        .await?;
    other.release(&next).await?;
    drop((held, path));
    Ok(())
}

/// An extend whose reply is held: the lock is still its owner's (extending
/// again works, same fencing token), and once the owner stops, the key is
/// free when that last TTL ran out, not when the acquisition's long TTL
/// would have.
pub async fn late_reply_extend(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, move |ctx| late_extend(ctx, Target::Lock)).await
}

/// [`late_reply_extend`] for a permit.
pub async fn late_reply_permit_extend(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, move |ctx| late_extend(ctx, Target::Permit)).await
}

async fn late_extend(ctx: TestContext, target: Target) -> CaseResult {
    // Room for the held extend's timeout before extending again.
    let ttl = ctx.capabilities().effective_ttl(RUN_OUT_TTL * 2)?;
    let (path, held) = held_client(&ctx, target).await?;
    let other = ctx.client().await?;
    let key = ctx.key("late-extend");
    let lease = target
        .take(&held, &key, ctx.long_ttl(), "the owner")
        .await?;
    path.hold(Direction::ToClient);
    unknown(held.extend(&lease, ttl), "an extend whose reply is held").await?;
    path.pass(Direction::ToClient);
    let renewed = held.extend(&lease, ttl).await.map_err(|e| {
        CaseError(format!(
            "extending again after an extend whose reply was held: {e} ({:?}); the late extend must leave the {} its owner's",
            e.kind(),
            target.label()
        ))
    })?;
    check_eq!(
        renewed.fencing_token(),
        lease.fencing_token(),
        "the fencing token after a late extend"
    );
    let next = target
        .freed_within(
            &other,
            &key,
            ttl,
            "another client after the owner stopped extending",
        )
        .await?;
    check!(
        next.fencing_token() > lease.fencing_token(),
        "the next holder's token grows"
    );
    other.release(&next).await?;
    drop((held, path));
    Ok(())
}

/// A release whose reply is held, then (replies flowing again) the same
/// release once more, as an owner that does not know the outcome would
/// send it: the second is `Released` (the first did not get through:
/// a release of more than one round trip stops at its first held reply)
/// or `NotHeld` (it was applied). Either way a waiter gets the lock before
/// its deadline (the released lock's TTL is far longer), and the second
/// release leaves the waiter's lock alone.
pub async fn late_reply_release(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, move |ctx| late_release(ctx, Target::Lock)).await
}

/// [`late_reply_release`] for a permit.
pub async fn late_reply_permit_release(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, move |ctx| late_release(ctx, Target::Permit)).await
}

async fn late_release(ctx: TestContext, target: Target) -> CaseResult {
    let (path, held) = held_client(&ctx, target).await?;
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let waiter = LockClient::new(observed.clone());
    let key = ctx.key("late-release");
    let lease = target
        .take(&held, &key, ctx.long_ttl(), "the owner")
        .await?;
    let waiting = {
        let (waiter, key, ttl) = (waiter.clone(), key.clone(), ctx.long_ttl());
        tokio::spawn(async move {
            target
                .wait(&waiter, &key, ttl, Instant::now() + WAITER_WAIT)
                .await
        })
    };
    // Subscribed and refused once: it is waiting.
    until_attempts(&observed, 1, "the waiter").await?;
    path.hold(Direction::ToClient);
    unknown(held.release(&lease), "a release whose reply is held").await?;
    path.pass(Direction::ToClient);
    match held.release(&lease).await {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotHeld => {}
        Err(e) => {
            return Err(CaseError(format!(
                "releasing again after a release whose reply was held: {e} ({:?}); expected success or NotHeld",
                e.kind()
            )))
        }
    }
    let theirs = match joined(waiting, WAITER_WAIT + background_bound(), "the waiter").await? {
        Ok(Some(theirs)) => theirs,
        Ok(None) => {
            return Err(CaseError(format!(
                "a waiter did not get the {} before its deadline ({WAITER_WAIT:?}) although its owner released it (once with the reply held, once more after)",
                target.label()
            )))
        }
        Err(e) => return Err(CaseError(format!("the waiter failed: {e}"))),
    };
    expect_kind(
        held.release(&lease).await,
        ErrorKind::NotHeld,
        "the old owner's release once the waiter holds the key",
    )?;
    target
        .refused(&held, &key, "the old owner, while the waiter holds the key")
        .await?;
    waiter.release(&theirs).await?;
    drop((held, path));
    Ok(())
}

/// What a waiting acquire handed back: a lease, or a guard.
enum Taken {
    Lease(Lease),
    Guard(LockGuard),
}

impl Taken {
    fn fencing_token(&self) -> FencingToken {
        match self {
            Taken::Lease(lease) => lease.fencing_token(),
            Taken::Guard(guard) => guard.fencing_token(),
        }
    }

    async fn release(self, client: &LockClient) -> Result<(), LockError> {
        match self {
            Taken::Lease(lease) => client.release(&lease).await,
            Taken::Guard(guard) => guard.release().await,
        }
    }
}

/// A waiting acquire of a free key whose first attempt is applied while
/// its reply is held, and whose retries are held too: once replies flow
/// again it must return the lock before its deadline — the very lock its
/// first attempt took, since its retries reuse the owner token and the
/// backend adopts it (or a new one, where the backend gave the first back
/// once its outcome was known) — and the server must show that lock.
/// Giving up at the deadline instead (`Ok(None)`: it waited on its own
/// orphan) fails. Then nothing is left behind: released, the key is free
/// at once. As a plain waiting
/// acquire and as a renewing guard; an attempt of more than one round trip
/// may not get past its first held reply, but the server must have applied
/// one in at least one of the two.
pub async fn late_reply_waiting_acquire(ctx: TestContext) -> CaseResult {
    late_waiting(ctx, Target::Lock).await
}

/// [`late_reply_waiting_acquire`] for a permit of a semaphore of one.
pub async fn late_reply_permit_waiting_acquire(ctx: TestContext) -> CaseResult {
    late_waiting(ctx, Target::Permit).await
}

async fn late_waiting(ctx: TestContext, target: Target) -> CaseResult {
    let mut rounds = Vec::new();
    for guard in [false, true] {
        let ctx = ctx.clone();
        rounds.push(tokio::spawn(async move {
            late_waiting_round(ctx, target, guard).await
        }));
    }
    let mut applied = 0;
    for round in rounds {
        if joined(round, WAITER_WAIT + background_bound() * 3, "a round").await?? {
            applied += 1;
        }
    }
    check!(
        applied > 0,
        "in no round did the server apply an attempt whose reply was held (the key stayed free): the case tested nothing"
    );
    Ok(())
}

/// One round; `true` if the held attempts took the lock on the server
/// (always assumed for permits, which the server cannot show).
async fn late_waiting_round(
    ctx: TestContext,
    target: Target,
    guard: bool,
) -> Result<bool, CaseError> {
    let (path, client) = held_client(&ctx, target).await?;
    let observed = Arc::new(ObservedLock::new(client));
    let locker = Locker::new(observed.clone());
    let other = ctx.client().await?;
    let key = ctx.key("late-waiting");
    let what = if guard {
        "a guard's waiting acquire"
    } else {
        "a waiting acquire"
    };
    // The first attempt waits at the wrapper (after the subscription, or
    // before it where the backend declares `attempt_before_watch`).
    observed.hold_requests(Call::Acquire);
    let waiting = {
        let (locker, key) = (locker.clone(), key.clone());
        let ttl = ctx.long_ttl();
        tokio::spawn(async move {
            if guard {
                let options = target.options(ttl, WAITER_WAIT);
                locker
                    .acquire(&key, &options)
                    .await
                    .map(|g| g.map(Taken::Guard))
            } else {
                let deadline = Instant::now() + WAITER_WAIT;
                target
                    .wait(locker.client(), &key, ttl, deadline)
                    .await
                    .map(|l| l.map(Taken::Lease))
            }
        })
    };
    within(
        background_bound(),
        observed.until_waiting(Call::Acquire, 1),
        &format!("{what}: its first attempt"),
    )
    .await?;
    path.hold(Direction::ToClient);
    observed.open(Call::Acquire);
    // Two attempts timed out: the first was applied (the key is free), and
    // the retry after it was sent (and applied) too.
    within(
        HELD_TIMEOUT * 2 + background_bound(),
        async {
            while observed.attempts() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        },
        &format!("{what}: two attempts with held replies"),
    )
    .await?;
    // What the held attempts did on the server: the lock they took (its
    // token, where the backend can show it), or nothing, where an attempt
    // takes more than one round trip (etcd: a lease grant, then a
    // transaction) and so never got past its first held reply.
    let applied = match target {
        Target::Lock => holder_of(&other, &key).await?,
        Target::Permit => Some(None),
    };
    path.pass(Direction::ToClient);
    let taken = match joined(waiting, WAITER_WAIT + background_bound(), what).await? {
        Ok(Some(taken)) => taken,
        Ok(None) => {
            return Err(CaseError(format!(
                "{what} gave up at its deadline (Ok(None)), although the {} it waited for was held by its own first attempt, applied while the reply was held: its retries must reuse the owner token, and the backend must grant that {} to its owner (adoption)",
                target.label(),
                target.label()
            )))
        }
        Err(e) => return Err(CaseError(format!("{what} failed: {e} ({:?})", e.kind()))),
    };
    // The lock it returned is the one the server holds (the adopted one,
    // or a new one if the backend gave the first back once it knew), and
    // nobody else gets it; once released, nothing is left behind.
    if let Some(Some(token)) = holder_of(&other, &key).await? {
        check_eq!(
            taken.fencing_token(),
            token,
            "{what}: the lock it returned must be the one the server holds"
        );
    }
    target
        .refused(
            &other,
            &key,
            &format!("{what}: another client, while it holds the key"),
        )
        .await?;
    taken.release(locker.client()).await?;
    let next = target
        .take(
            &other,
            &key,
            ctx.long_ttl(),
            &format!("{what}: right after it released"),
        )
        .await?;
    other.release(&next).await?;
    drop((locker, observed, path));
    Ok(applied.is_some())
}

/// Waiting calls whose replies are held join and leave the key's waiters
/// (a backend may keep a queue on the server): one that was waiting when
/// the hold began gives up at its deadline, one more starts and gives up
/// while replies are held. Once replies flow, a later waiter queues and
/// the holder releases: it must get the lock before its deadline (the
/// holder's TTL is far longer), so nothing the held calls left on the
/// server stands in its way, while the client that sent them lives on.
pub async fn late_reply_waiter_queue(ctx: TestContext) -> CaseResult {
    in_rounds(ctx, waiter_queue_round).await
}

async fn waiter_queue_round(ctx: TestContext) -> CaseResult {
    let (path, client) = held_client(&ctx, Target::Lock).await?;
    let observed = Arc::new(ObservedLock::new(client));
    let queued = LockClient::new(observed.clone());
    let holder = ctx.client().await?;
    let late_observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let late = LockClient::new(late_observed.clone());
    let key = ctx.key("late-queue");
    let ttl = ctx.long_ttl();
    let holder_lease = acquire(&holder, &key, ttl, "the holder").await?;
    let short_wait = HELD_TIMEOUT * 3;
    let gives_up = |result: Result<Option<Lease>, LockError>, what: &str| match result {
        Ok(None) => Ok(()),
        Err(e) if e.is_transient() => Ok(()),
        Ok(Some(lease)) => Err(CaseError(format!(
            "{what} was granted the lock (token {}) that another client holds",
            lease.fencing_token()
        ))),
        Err(e) => Err(CaseError(format!("{what} failed: {e} ({:?})", e.kind()))),
    };
    let first = {
        let (queued, key) = (queued.clone(), key.clone());
        tokio::spawn(async move { queued.acquire(&key, ttl, Instant::now() + short_wait).await })
    };
    until_attempts(&observed, 1, "the first waiter").await?;
    path.hold(Direction::ToClient);
    let result = joined(first, short_wait + background_bound(), "the first waiter").await?;
    gives_up(result, "the waiter whose replies were held")?;
    let result = within(
        short_wait + background_bound(),
        queued.acquire(&key, ttl, Instant::now() + short_wait),
        "a waiter started while replies are held",
    )
    .await?;
    gives_up(result, "the waiter started while replies were held")?;
    path.pass(Direction::ToClient);
    let later = {
        let (late, key) = (late.clone(), key.clone());
        tokio::spawn(async move { late.acquire(&key, ttl, Instant::now() + WAITER_WAIT).await })
    };
    until_attempts(&late_observed, 1, "the later waiter").await?;
    holder.release(&holder_lease).await?;
    let got = match joined(later, WAITER_WAIT + background_bound(), "the later waiter").await? {
        Ok(Some(got)) => got,
        Ok(None) => {
            return Err(CaseError(format!(
                "a waiter did not get the released lock before its deadline ({WAITER_WAIT:?}): what earlier waiting calls left on the server while their replies were held (a queue entry joined or left unseen) stood in its way"
            )))
        }
        Err(e) => return Err(CaseError(format!("the later waiter failed: {e}"))),
    };
    check!(
        got.fencing_token() > holder_lease.fencing_token(),
        "the token grows past the holder's"
    );
    late.release(&got).await?;
    drop((queued, observed, path));
    Ok(())
}

/// Clock-drift allowance of the adoption checks: generous, since an
/// adoption that did not reset the TTL is off by half the TTL.
fn drift(ttl: Duration) -> Duration {
    ttl / 10
}

/// Attempts at catching the adopting acquire before the first lock ran out
/// (a loaded machine may oversleep the pause between them).
const ADOPTION_TRIES: usize = 5;

/// The raw backend's side of the unknown-outcome rule: acquiring a key
/// again with the owner token that holds it (a retry whose earlier attempt
/// was applied unseen) is granted that same lock — same fencing token, no
/// second lock — and resets its TTL from now by the server's clock: asked
/// throughout, the server must still hold it at every answer that arrived
/// before the second send plus the TTL (less a drift allowance), long
/// after the first acquisition's TTL ran out. Plain and renewing. A
/// backend that refuses its own owner (`Held`), grants a second lock, or
/// adopts without resetting the TTL fails.
pub async fn same_owner_acquire_adopts(ctx: TestContext) -> CaseResult {
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(3))?;
    let client = ctx.client().await?;
    let observer = ctx.client().await?;
    for renewing in [false, true] {
        let mut answers = 0;
        for _ in 0..ADOPTION_TRIES {
            let key = ctx.key("adopt");
            let owner = OwnerToken::random();
            let request = AcquireRequest {
                key: &key,
                owner,
                ttl,
                renewing,
                settling: false,
                holder: None,
            };
            let raw = client.backend();
            let first_sent = Instant::now();
            let first = granted(raw.acquire(request).await?, "the first acquire")?;
            let first_valid = valid_from(first_sent, &first) + first.ttl - drift(first.ttl);
            tokio::time::sleep(ttl / 2).await;
            let second_sent = Instant::now();
            if second_sent >= first_valid {
                // Overslept: the first lock may be gone; try again.
                release_raw(&client, &key, owner, &first).await?;
                continue;
            }
            let second = match raw.acquire(request).await? {
                AcquireReply::Granted(grant) => grant,
                AcquireReply::Held { expires_in } => {
                    return Err(CaseError(format!(
                        "(renewing: {renewing}) an acquire by the owner token that holds the key was refused as held (expires_in {expires_in:?}): a retry whose earlier attempt was applied unseen must be granted that lock (adoption)"
                    )))
                }
            };
            check_eq!(
                second.fencing,
                first.fencing,
                "(renewing: {renewing}) the fencing token of an acquire by the owner that holds the key: it must adopt that lock, not grant a second one"
            );
            let deadline = valid_from(second_sent, &second) + ttl.max(second.ttl) - drift(ttl);
            answers = server_holds_until_deadline(
                &observer,
                &key,
                first.fencing,
                || deadline,
                || true,
                &format!("(renewing: {renewing}) a lock adopted by its owner's second acquire (the adoption must reset its TTL from then)"),
            )
            .await?;
            release_raw(&client, &key, owner, &second).await?;
            break;
        }
        check!(
            answers > 0,
            "(renewing: {renewing}) the second acquire never came before the first lock's deadline; the case tested nothing"
        );
    }
    Ok(())
}

/// [`same_owner_acquire_adopts`] for permits, in a semaphore of two: the
/// owner's second attempt is granted its permit (same fencing token), so
/// another owner still gets the second permit and a third is refused until
/// the adopted permit's TTL, reset by the second attempt, runs out.
pub async fn same_owner_permit_adopts(ctx: TestContext) -> CaseResult {
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(3))?;
    let client = ctx.client().await?;
    let semaphore = client
        .semaphore()
        .ok_or("the backend declared semaphores but has none")?;
    let mut probes = 0;
    for _ in 0..ADOPTION_TRIES {
        let key = ctx.key("adopt-permit");
        let owner = OwnerToken::random();
        let first_sent = Instant::now();
        let first = granted_permit(
            semaphore.acquire_permit(permit(&key, owner, ttl)).await?,
            "the first permit",
        )?;
        let first_valid = valid_from(first_sent, &first) + first.ttl - drift(first.ttl);
        tokio::time::sleep(ttl / 2).await;
        let second_sent = Instant::now();
        if second_sent >= first_valid {
            semaphore.release_permit(held(&key, owner, &first)).await?;
            continue;
        }
        let second = match semaphore.acquire_permit(permit(&key, owner, ttl)).await? {
            PermitReply::Granted(grant) => grant,
            other => {
                return Err(CaseError(format!(
                    "a permit attempt by the owner token that holds a permit was answered {other:?}: a retry whose earlier attempt was applied unseen must be granted that permit (adoption)"
                )))
            }
        };
        check_eq!(
            second.fencing,
            first.fencing,
            "the fencing token of a permit attempt by the owner that holds a permit: it must adopt that permit, not take a second one"
        );
        let other_owner = OwnerToken::random();
        let other = match semaphore
            .acquire_permit(permit(&key, other_owner, ctx.long_ttl()))
            .await?
        {
            PermitReply::Granted(grant) => grant,
            answer => {
                return Err(CaseError(format!(
                    "another owner was refused the second permit of two ({answer:?}): the owner's second attempt took a second permit instead of adopting its own"
                )))
            }
        };
        let deadline = valid_from(second_sent, &second) + ttl.max(second.ttl) - drift(ttl);
        loop {
            if Instant::now() >= deadline {
                break;
            }
            let probe_owner = OwnerToken::random();
            let answer = semaphore
                .acquire_permit(permit(&key, probe_owner, ttl))
                .await?;
            let answered = Instant::now();
            if let PermitReply::Granted(grant) = answer {
                semaphore
                    .release_permit(held(&key, probe_owner, &grant))
                    .await?;
                check!(
                    answered >= deadline,
                    "a third owner got a permit of two {:?} before the deadline of a permit adopted by its owner's second attempt: the adoption did not reset its TTL",
                    deadline - answered
                );
            } else if answered < deadline {
                probes += 1;
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        semaphore
            .release_permit(held(&key, other_owner, &other))
            .await?;
        let _ = semaphore.release_permit(held(&key, owner, &second)).await?;
        break;
    }
    check!(
        probes > 0,
        "the second permit attempt never came before the first permit's deadline; the case tested nothing"
    );
    Ok(())
}

/// A raw request for one permit of a semaphore of two.
fn permit(key: &LockKey, owner: OwnerToken, ttl: Duration) -> PermitRequest<'_> {
    PermitRequest {
        key,
        owner,
        ttl,
        limit: 2,
        renewing: false,
        settling: false,
        holder: None,
    }
}

fn granted(reply: AcquireReply, what: &str) -> Result<Grant, CaseError> {
    match reply {
        AcquireReply::Granted(grant) => Ok(grant),
        other => Err(CaseError(format!(
            "{what}: a free key must be granted, got {other:?}"
        ))),
    }
}

fn granted_permit(reply: PermitReply, what: &str) -> Result<Grant, CaseError> {
    match reply {
        PermitReply::Granted(grant) => Ok(grant),
        other => Err(CaseError(format!(
            "{what}: a permit of an empty semaphore must be granted, got {other:?}"
        ))),
    }
}

/// The instant a grant's TTL started at the latest, as the client dates it.
fn valid_from(sent_at: Instant, grant: &Grant) -> Instant {
    grant.clock_started.map_or(sent_at, |at| at.min(sent_at))
}

fn held<'a>(key: &'a LockKey, owner: OwnerToken, grant: &Grant) -> HeldLock<'a> {
    HeldLock {
        key,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    }
}

/// Releases a raw lock; `NotHeld` is fine (it may have run out).
async fn release_raw(
    client: &LockClient,
    key: &LockKey,
    owner: OwnerToken,
    grant: &Grant,
) -> Result<(), CaseError> {
    match client.backend().release(held(key, owner, grant)).await? {
        ReleaseReply::Released | ReleaseReply::NotHeld | ReleaseReply::NotHeldAfterResend => Ok(()),
    }
}

/// Election: a campaign whose grant is applied while its reply is held
/// leads once replies flow, under the term the server shows for it (the
/// applied grant adopted, or given back first: never a second term held
/// beside it); then a resign whose reply is held is an unknown outcome,
/// and a standby still leads long before the leader's TTL could run out
/// (the resign is sent again once the server answers), with a newer term.
pub async fn late_reply_campaign_and_resign(ctx: TestContext) -> CaseResult {
    let (path, held) = held_client(&ctx, Target::Lock).await?;
    let observed = Arc::new(ObservedLock::new(held));
    let candidate = Locker::new(observed.clone());
    let (observer, standby) = (ctx.locker().await?, ctx.locker().await?);
    let key = ctx.key("late-campaign");
    let identity = HolderId::new("late-candidate")?;
    let options = LockOptions::new(ctx.long_ttl());
    // The first attempt waits at the wrapper (after the subscription, or
    // before it where the backend declares `attempt_before_watch`).
    observed.hold_requests(Call::Acquire);
    let campaign = {
        let (candidate, key, identity, options) = (
            candidate.clone(),
            key.clone(),
            identity.clone(),
            options.clone(),
        );
        tokio::spawn(async move { candidate.campaign(&key, &identity, &options).await })
    };
    let first = observed.until_waiting(Call::Acquire, 1);
    within(background_bound(), first, "the campaign's first attempt").await?;
    path.hold(Direction::ToClient);
    observed.open(Call::Acquire);
    let two = async {
        while observed.attempts() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let bound = HELD_TIMEOUT * 2 + background_bound();
    within(bound, two, "two campaign attempts with held replies").await?;
    // What the held attempts did: a grant the server shows (none where an
    // attempt takes more than one round trip and never got past its first
    // held reply).
    let applied = observer.leader(&key).await?;
    if let Some(applied) = &applied {
        check_eq!(
            applied.identity.as_ref(),
            Some(&identity),
            "who the server shows leading"
        );
    }
    path.pass(Direction::ToClient);
    let leading = joined(campaign, WAITER_WAIT + background_bound(), "the campaign")
        .await?
        .map_err(|e| CaseError(format!("the campaign failed: {e}")))?;
    if let Some(applied) = &applied {
        check!(
            leading.term() >= applied.term,
            "the campaign's term {} is the applied grant's {} or newer",
            leading.term(),
            applied.term
        );
    }
    check_eq!(
        observer.leader(&key).await?.map(|l| l.term),
        Some(leading.term()),
        "the server shows the campaign's own term"
    );
    let term = leading.term();
    let waiting = {
        let (key, identity) = (key.clone(), HolderId::new("standby")?);
        tokio::spawn(async move { standby.campaign(&key, &identity, &options).await })
    };
    path.hold(Direction::ToClient);
    unknown(leading.resign(), "a resign whose reply is held").await?;
    path.pass(Direction::ToClient);
    let next = joined(waiting, HELD_TIMEOUT + background_bound(), "the standby")
        .await?
        .map_err(|e| CaseError(format!("the standby failed: {e}")))?;
    check!(
        next.term() > term,
        "the standby's term {} is newer than {term}",
        next.term()
    );
    next.resign().await?;
    drop((candidate, observed, path));
    Ok(())
}
