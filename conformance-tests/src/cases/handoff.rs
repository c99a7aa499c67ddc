//! `handoff::` — a backend that wakes one waiter per release
//! (`Capabilities::wakes_one_waiter`) keeps its word: a release costs one
//! attempt however many wait, waiters are served in arrival order, a
//! waiter that leaves passes its turn on, a waiter whose client is gone is
//! passed over, and permits returned together wake as many waiters as came
//! back. A backend whose released key goes to the line's first waiter
//! (`Capabilities::fair_handoff`) lets nobody cut in.
//!
//! Every holder here holds for the long TTL, so no waiter's timer fires
//! during a case: what wakes a waiter is a release, or nothing.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockClient, LockKey, LockOptions, Locker};

use super::support::{acquire, background_bound, until_attempts, within};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::Direction;
use crate::Call;
use crate::{check, check_eq, ObservedLock};

/// How many waiters queue in these cases.
const WAITERS: usize = 4;

/// Starts `WAITERS` waiters on `key`, one after another (each only once
/// the previous one's first attempt was refused, so their arrival order
/// is known), each holding what it gets for a moment before releasing it.
/// Returns their observed backends and tasks; `served` records who got it,
/// in order.
async fn queue_waiters(
    ctx: &TestContext,
    key: &LockKey,
    permits: Option<u32>,
    served: &Arc<Mutex<Vec<usize>>>,
) -> Result<Waiters, CaseError> {
    let mut waiters = Waiters::default();
    for _ in 0..WAITERS {
        waiters
            .queue(ctx.client().await?, ctx, key, permits, served)
            .await?;
    }
    Ok(waiters)
}

/// Waiters started by [`queue_waiters`].
#[derive(Default)]
struct Waiters {
    observed: Vec<Arc<ObservedLock>>,
    tasks: Vec<tokio::task::JoinHandle<Result<Result<(), String>, distlock_core::LockError>>>,
}

impl Waiters {
    /// Starts one more waiter on `key`, a client of its own, and waits
    /// until its first attempt was refused (so it queued after every
    /// earlier one). It records its number in `served` when it gets the
    /// key, holds it a moment and releases it.
    async fn queue(
        &mut self,
        client: LockClient,
        ctx: &TestContext,
        key: &LockKey,
        permits: Option<u32>,
        served: &Arc<Mutex<Vec<usize>>>,
    ) -> Result<(), CaseError> {
        let observed = Arc::new(ObservedLock::new(client));
        self.queue_observed(observed, ctx, key, permits, served)
            .await
    }

    /// [`queue`](Self::queue) through `observed` (faults set beforehand).
    async fn queue_observed(
        &mut self,
        observed: Arc<ObservedLock>,
        ctx: &TestContext,
        key: &LockKey,
        permits: Option<u32>,
        served: &Arc<Mutex<Vec<usize>>>,
    ) -> Result<(), CaseError> {
        let i = self.observed.len();
        let locker = Locker::new(observed.clone());
        let mut options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(120));
        if let Some(limit) = permits {
            options = options.with_permits(limit);
        }
        let (key, served) = (key.clone(), served.clone());
        self.tasks.push(tokio::spawn(async move {
            let Some(guard) = locker.acquire(&key, &options).await? else {
                return Ok(Err(format!("waiter {i} gave up")));
            };
            served.lock().unwrap_or_else(|e| e.into_inner()).push(i);
            tokio::time::sleep(Duration::from_millis(10)).await;
            guard.release().await?;
            Ok::<_, distlock_core::LockError>(Ok(()))
        }));
        until_attempts(&observed, 1, &format!("waiter {i}")).await?;
        self.observed.push(observed);
        Ok(())
    }

    /// Waits for every waiter to be served; their attempts in all.
    async fn finish(self) -> Result<Vec<u64>, CaseError> {
        for task in self.tasks {
            within(Duration::from_secs(150), task, "waiter")
                .await?
                .map_err(|e| format!("waiter task panicked: {e}"))???;
        }
        Ok(self.observed.iter().map(|o| o.attempts_in_line()).collect())
    }
}

/// `WAITERS` waiters queue behind a holder, which then releases: each
/// waiter's attempts, and the order they were served in.
async fn served_behind_a_holder(ctx: &TestContext) -> Result<(Vec<u64>, Vec<usize>), CaseError> {
    let key = ctx.key("handoff");
    let holder = ctx.client().await?;
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let served = Arc::new(Mutex::new(Vec::new()));
    let waiters = queue_waiters(ctx, &key, None, &served).await?;
    holder.release(&lease).await?;
    let attempts = waiters.finish().await?;
    let order = served.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Ok((attempts, order))
}

/// One release, one attempt: `WAITERS` waiters queue behind a holder;
/// each is served once with two attempts in all (the refused first one and
/// the one its wake-up started), not one more for each release it slept
/// through. A backend that wakes every waiter makes 4 + 4 + 3 + 2 + 1.
pub async fn one_attempt_per_release(ctx: TestContext) -> CaseResult {
    let (attempts, _) = served_behind_a_holder(&ctx).await?;
    let total: u64 = attempts.iter().sum();
    check!(
        total <= 2 * WAITERS as u64,
        "one attempt per release: {WAITERS} waiters made {total} attempts (per waiter {attempts:?}), at most {} expected",
        2 * WAITERS
    );
    Ok(())
}

/// Waiters are served in the order they arrived.
pub async fn arrival_order(ctx: TestContext) -> CaseResult {
    let (_, order) = served_behind_a_holder(&ctx).await?;
    check_eq!(order, (0..WAITERS).collect::<Vec<_>>(), "order served");
    Ok(())
}

/// A released key goes to the line's first waiter, not to whoever asks
/// first (`Capabilities::fair_handoff`): while the woken waiter's attempt
/// is on its way, a newcomer's `try_acquire` and the releasing holder's
/// own are refused, and a newcomer that waits is served after everyone
/// who queued before it. A backend that gives a free key to the first
/// attempt lets the holder take it straight back.
pub async fn no_cut_in(ctx: TestContext) -> CaseResult {
    let key = ctx.key("handoff");
    let holder = ctx.client().await?;
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = queue_waiters(&ctx, &key, None, &served).await?;
    // The first waiter's next attempt (the one its wake-up starts) waits
    // before the server until the others have tried to cut in.
    let first = waiters.observed[0].clone();
    first.hold_requests(Call::Acquire);
    // Connected beforehand: while the first waiter is held, only a few
    // requests go by, far inside any backend's turn.
    let (newcomer, late) = (ctx.client().await?, ctx.client().await?);
    holder.release(&lease).await?;
    within(
        background_bound(),
        first.until_waiting(Call::Acquire, 1),
        "the first waiter woken by the release",
    )
    .await?;
    for (who, client) in [
        ("a newcomer", &newcomer),
        ("the holder that released it", &holder),
    ] {
        if let Some(taken) = client.try_acquire(&key, ctx.long_ttl()).await?.lease() {
            client.release(&taken).await?;
            return Err(format!(
                "{who} took the key while the waiter it was released to was on its way"
            )
            .into());
        }
    }
    waiters.queue(late, &ctx, &key, None, &served).await?;
    first.open(Call::Acquire);
    waiters.finish().await?;
    check_eq!(
        served.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        (0..=WAITERS).collect::<Vec<_>>(),
        "order served (the last came after the release, while the first was on its way)"
    );
    Ok(())
}

/// A wait that ended at its deadline gave its place in line up before it
/// returned. After the waiter's first refused attempt, everything it sends
/// takes 300 ms to reach the server, so the request that takes it out of
/// the server's line (sent as the wait ends) arrives late; the holder
/// releases as soon as the wait returns, and another client's
/// `try_acquire` must get the key. A backend whose wait returns before its
/// leave is done lets the release hand the freed key to the ended wait's
/// turn, and the try is refused (the Python bindings' `campaign(timeout=0)`
/// after a timed-out campaign failed this way).
pub async fn a_timed_out_wait_gives_up_its_place(ctx: TestContext) -> CaseResult {
    let key = ctx.key("handoff");
    let holder = ctx.client().await?;
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let path = ctx.fault_path().await?;
    // Far longer than the delay: no delayed request times out.
    let observed = Arc::new(ObservedLock::new(
        ctx.client_through_with(&path, Duration::from_secs(5))
            .await?,
    ));
    let waiter = LockClient::new(observed.clone());
    let deadline = Instant::now() + Duration::from_millis(300);
    let waiting = {
        let (key, ttl) = (key.clone(), ctx.long_ttl());
        tokio::spawn(async move { waiter.acquire(&key, ttl, deadline).await })
    };
    // Subscribed, refused once: in line.
    until_attempts(&observed, 1, "the waiter").await?;
    path.delay(Direction::ToServer, Duration::from_millis(300));
    let waited = within(background_bound(), waiting, "the waiter's deadline")
        .await?
        .map_err(|e| CaseError(format!("the waiter panicked: {e}")))??;
    if waited.is_some() {
        return Err("a waiter took a key its holder still held".into());
    }
    holder.release(&lease).await?;
    let other = ctx.client().await?;
    let tried = other.try_acquire(&key, ctx.long_ttl()).await?;
    path.delay(Direction::ToServer, Duration::ZERO);
    match tried.lease() {
        Some(taken) => {
            other.release(&taken).await?;
            Ok(())
        }
        None => Err(
            "refused a free key right after a wait on it ended: the ended wait's place in line outlived the call"
                .into(),
        ),
    }
}

/// Applied, reply held: a waiter's refused first attempt joined the line,
/// but its reply is held (it does not know it is queued); a second waiter
/// queues behind it, and the holder releases while the reply is still
/// held, so the release's wake-up reaches the first waiter while its
/// attempt is in flight. It keeps the place the server gave it and is
/// served first: its wake-up is not lost because it came before the
/// attempt's answer, and its late answer does not put it in line again
/// behind the second. A backend that drops such a wake-up leaves the
/// first waiter asleep until the holder's TTL, and the second is served
/// once the first's turn is over.
pub async fn wake_up_during_a_held_reply_is_kept(ctx: TestContext) -> CaseResult {
    let key = ctx.key("handoff");
    let holder = ctx.client().await?;
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Waiters::default();
    let first = Arc::new(ObservedLock::new(ctx.client().await?));
    first.hold_replies_in_line();
    waiters
        .queue_observed(first.clone(), &ctx, &key, None, &served)
        .await?;
    within(
        background_bound(),
        first.until_waiting(Call::Acquire, 1),
        "the first waiter's refusal held",
    )
    .await?;
    waiters
        .queue(ctx.client().await?, &ctx, &key, None, &served)
        .await?;
    holder.release(&lease).await?;
    // Not a synchronisation: time for the wake-up to reach the first
    // waiter's client before its answer does (either order must work;
    // this makes the harder one likely).
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.open(Call::Acquire);
    waiters.finish().await?;
    check_eq!(
        served.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        vec![0, 1],
        "order served (the first waiter's refusal came back after the release)"
    );
    Ok(())
}

/// A waiter that leaves — cancelled before the release, or failing after
/// the release woke it — passes its turn on: the next waiter is
/// served long before the holder's TTL could have run out.
pub async fn cancelled_waiter_passes_the_turn_on(ctx: TestContext) -> CaseResult {
    for woken_first in [false, true] {
        let when = if woken_first {
            "after its wake-up"
        } else {
            "before the release"
        };
        let key = ctx.key("handoff");
        let holder = ctx.client().await?;
        let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
        let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(120));
        let first = Arc::new(ObservedLock::new(ctx.client().await?));
        let leaving = {
            let (locker, key, options) = (Locker::new(first.clone()), key.clone(), options.clone());
            tokio::spawn(async move { locker.acquire(&key, &options).await })
        };
        until_attempts(&first, 1, "the waiter that leaves").await?;
        let second = Arc::new(ObservedLock::new(ctx.client().await?));
        let next = {
            let (locker, key) = (Locker::new(second.clone()), key.clone());
            tokio::spawn(async move { locker.acquire(&key, &options).await })
        };
        until_attempts(&second, 1, "the next waiter").await?;
        if woken_first {
            // Woken, the first waiter gives up: its attempt fails before it
            // reaches the server, and its wait ends with that error.
            first.fail_next(Call::Acquire, &key, ErrorKind::Config);
            holder.release(&lease).await?;
            let ended = within(
                background_bound(),
                leaving,
                "the first waiter woken by the release",
            )
            .await?
            .map_err(|e| format!("waiter panicked: {e}"))?;
            check!(
                ended.is_err(),
                "the first waiter ended with the injected error"
            );
        } else {
            leaving.abort();
            let _ = leaving.await;
            holder.release(&lease).await?;
        }
        let started = Instant::now();
        let guard = within(
            background_bound(),
            next,
            &format!("the next waiter served (the first left {when})"),
        )
        .await?
        .map_err(|e| format!("waiter panicked: {e}"))??
        .ok_or_else(|| format!("the next waiter gave up (the first left {when})"))?;
        check!(
            started.elapsed() < ctx.long_ttl() / 2,
            "served by the turn passed on, not by an expiry"
        );
        guard.release().await?;
    }
    Ok(())
}

/// Two permits returned back to back wake two waiters: both are served
/// while the holders' TTLs are far from over.
pub async fn permits_returned_together_wake_as_many(ctx: TestContext) -> CaseResult {
    const LIMIT: u32 = 2;
    let key = ctx.key("handoff");
    let holders: Vec<LockClient> = super::support::clients(&ctx, LIMIT as usize).await?;
    let mut leases = Vec::new();
    for (i, holder) in holders.iter().enumerate() {
        let attempt = holder
            .try_acquire_permit(&key, LIMIT, ctx.long_ttl())
            .await?;
        leases.push(
            attempt
                .lease()
                .ok_or_else(|| format!("holder {i}: a permit should be free"))?,
        );
    }
    let served = Arc::new(Mutex::new(Vec::new()));
    let waiters = queue_waiters(&ctx, &key, Some(LIMIT), &served).await?;
    let (a, b) = (&holders[0], &holders[1]);
    let (ra, rb) = tokio::join!(a.release(&leases[0]), b.release(&leases[1]));
    ra?;
    rb?;
    // The four are served two at a time; each holds a moment and releases,
    // which wakes the next. Only wake-ups can serve them this soon.
    within(background_bound(), waiters.finish(), "every waiter served").await??;
    check_eq!(
        served.lock().unwrap_or_else(|e| e.into_inner()).len(),
        WAITERS,
        "waiters served"
    );
    Ok(())
}

/// A waiter whose client is cut off for good (as a killed process's
/// connections end) does not keep the turn: the release passes over it
/// to the next waiter, long before the holder's TTL could have run out.
pub async fn gone_waiter_is_passed_over(ctx: TestContext) -> CaseResult {
    let key = ctx.key("handoff");
    let holder = ctx.client().await?;
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(120));
    let path = ctx.fault_path().await?;
    let cut_off = Arc::new(ObservedLock::new(ctx.client_through(&path).await?));
    let gone = {
        let (locker, key, options) = (Locker::new(cut_off.clone()), key.clone(), options.clone());
        tokio::spawn(async move { locker.acquire(&key, &options).await })
    };
    until_attempts(&cut_off, 1, "the waiter that will be cut off").await?;
    let second = Arc::new(ObservedLock::new(ctx.client().await?));
    let next = {
        let (locker, key) = (Locker::new(second.clone()), key.clone());
        tokio::spawn(async move { locker.acquire(&key, &options).await })
    };
    until_attempts(&second, 1, "the next waiter").await?;
    // Its connections end and it cannot reach the server again; the
    // release comes once they are closed (a killed process's connections
    // close before anyone else's next request, as the kernel closes them).
    path.down();
    path.until_cut_off().await;
    // The server notices a closed connection on its own schedule (a
    // PostgreSQL backend exits when it next runs): a few round trips of
    // another client give it that chance on a loaded machine too, without
    // a clock.
    let side = ctx.key("handoff-side");
    for _ in 0..5 {
        if let Some(lease) = holder.try_acquire(&side, ctx.long_ttl()).await?.lease() {
            holder.release(&lease).await?;
        }
    }
    holder.release(&lease).await?;
    let result = within(
        background_bound(),
        next,
        "the next waiter served past the gone one",
    )
    .await;
    gone.abort();
    let guard = result?
        .map_err(|e| format!("waiter panicked: {e}"))??
        .ok_or("the next waiter gave up")?;
    guard.release().await?;
    drop(path);
    Ok(())
}
