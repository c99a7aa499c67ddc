//! `lease::` — a lease's deadline against the server's expiry. Nobody is
//! granted a lock before its holder's own deadline; the holder's deadline
//! (and so its guard's `lost()`) never outlives the server's expiry, even
//! with slow replies; a renewing holder that dies before renewing frees the
//! key within its TTL; release and extend stay atomic when they race an
//! expiry and a re-acquire.
//!
//! Where faults can be injected (a server the harness runs, or a simulated
//! network), the holder talks through a [`FaultPath`] that delays its
//! replies, so a deadline counted from the reply instead of from before
//! the request is off by the whole delay. Every check compares instants
//! the test recorded with the server's answers (an ordering), never a
//! duration against a threshold.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, ErrorKind, Lease, LockClient, LockKey, LockOptions, Locker, LostReason, Renewal,
};

use super::support::{acquire, expiry_bound, holder_of, spin_acquire, still_held_by, within};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::{Direction, FaultPath};
use crate::{check, check_eq};

/// How long replies (and, where it helps, requests) to a holder are held
/// back: far more than the clock-drift allowance of a lease, so a deadline
/// counted from the wrong moment shows.
const SLOW: Duration = Duration::from_millis(250);

/// The operation timeout of clients behind a slowed path (several delayed
/// round trips, a connection handshake included, must fit).
const SLOW_CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Calls a slow client makes at once before its path slows down.
const WARM_UP_CALLS: usize = 4;

/// A holder client: behind a fault path delaying what travels in
/// `directions` by [`SLOW`] where faults can be injected, else direct.
/// Before the delay starts, the client has made a plain and a renewing
/// acquisition of `ttl` (connections and sessions are set up), so the
/// delay falls on the case's own calls only.
async fn slow_client(
    ctx: &TestContext,
    directions: &[Direction],
    ttl: Duration,
) -> Result<(Option<FaultPath>, LockClient), CaseError> {
    if !ctx.can_inject_faults() {
        return Ok((None, ctx.client().await?));
    }
    let path = ctx.fault_path().await?;
    let client = ctx.client_through_with(&path, SLOW_CLIENT_TIMEOUT).await?;
    // As many calls at once as a case makes later (4 rounds), so a client
    // with a connection pool has that many connections open before the
    // path slows down: opening one through it (several round trips) would
    // eat the short TTL.
    let mut warm_ups = Vec::new();
    for i in 0..WARM_UP_CALLS {
        let client = client.clone();
        let scratch = ctx.key(&format!("lease-warm-up-{i}"));
        warm_ups.push(tokio::spawn(async move {
            let plain = acquire(&client, &scratch, ttl, "warm-up").await?;
            client.release(&plain).await?;
            let renewing = granted(client.try_acquire_renewing(&scratch, ttl).await?, "warm-up")?;
            client.release(&renewing).await?;
            Ok::<_, CaseError>(())
        }));
    }
    for warm_up in warm_ups {
        warm_up
            .await
            .map_err(|e| format!("a warm-up panicked: {e}"))??;
    }
    for direction in directions {
        path.delay(*direction, SLOW);
    }
    Ok((Some(path), client))
}

/// A grant of a fresh key to `holder` with at least a quarter of its `ttl`
/// left on arrival, for cases about what happens before a holder's
/// deadline: a grant a loaded machine delivered (nearly) expired tests
/// nothing, so it is given back and another key is tried, a few times.
async fn usable_grant(
    ctx: &TestContext,
    holder: &LockClient,
    renewing: bool,
    ttl: Duration,
    what: &str,
) -> Result<(LockKey, Lease), CaseError> {
    const TRIES: usize = 5;
    let mut late = Vec::new();
    for _ in 0..TRIES {
        let key = ctx.key("lease-usable");
        let attempt = if renewing {
            holder.try_acquire_renewing(&key, ttl).await?
        } else {
            holder.try_acquire(&key, ttl).await?
        };
        let lease = granted(attempt, what)?;
        let left = lease
            .valid_until()
            .saturating_duration_since(Instant::now());
        if left >= ttl / 4 {
            return Ok((key, lease));
        }
        late.push(left);
        // It may have expired already: a refused release is expected.
        let _ = holder.release(&lease).await;
    }
    Err(format!(
        "{what}: {TRIES} grants of a {ttl:?} TTL each arrived with less than a quarter of it left ({late:?}); the machine is too slow for the case to test anything"
    )
    .into())
}

fn granted(attempt: AcquireAttempt, what: &str) -> Result<Lease, CaseError> {
    match attempt {
        AcquireAttempt::Acquired(lease) => Ok(lease),
        other => Err(CaseError(format!(
            "{what}: a free key must be acquired, got {other:?}"
        ))),
    }
}

/// A holder acquires (plainly and renewing, its replies delayed); another
/// client tries again and again from shortly before the holder's deadline.
/// It must not be granted the lock before that deadline (the instant its
/// grant arrived is recorded and compared with the holder's
/// `valid_until`): a server that expires early (a clock running ahead), or
/// a holder deadline counted from when the reply arrived, both let two
/// clients believe they hold the lock at once.
pub async fn never_granted_before_holder_deadline(ctx: TestContext) -> CaseResult {
    // 2 s: two delayed replies (etcd: lease grant, then transaction) plus a
    // loaded machine's scheduling must leave the grant usable; the check
    // compares instants, so the TTL does not change what it proves.
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(2))?;
    let (path, holder) = slow_client(&ctx, &[Direction::ToClient], ttl).await?;
    let mut rounds = Vec::new();
    for (round, renewing) in [false, true, false, true].into_iter().enumerate() {
        let (ctx, holder) = (ctx.clone(), holder.clone());
        rounds.push(tokio::spawn(async move {
            let other = ctx.client().await?;
            let (key, lease) = usable_grant(&ctx, &holder, renewing, ttl, "holder").await?;
            let deadline = lease.valid_until();
            // Spin from well before the deadline: an early grant is then
            // seen as soon as the server makes it.
            let lead = (ttl / 2).min(Duration::from_millis(300));
            tokio::time::sleep_until(deadline.checked_sub(lead).unwrap_or(deadline).into())
                .await;
            let (next, got_at) = spin_acquire(
                &other,
                &key,
                ctx.long_ttl(),
                expiry_bound(ttl),
                || false,
                "the other client",
            )
            .await?
            .ok_or("the other client gave up")?;
            other.release(&next).await?;
            check!(
                got_at >= deadline,
                "round {round} (renewing: {renewing}): another client was granted the lock {:?} before the holder's own deadline (holder: TTL {ttl:?}, valid_until = sent_at + {:?})",
                deadline - got_at,
                deadline - lease.sent_at()
            );
            check!(
                next.fencing_token() > lease.fencing_token(),
                "the next holder's token grows"
            );
            Ok::<_, CaseError>(())
        }));
    }
    for round in rounds {
        within(expiry_bound(ttl) * 2, round, "a round")
            .await?
            .map_err(|e| format!("a round panicked: {e}"))??;
    }
    drop(path);
    Ok(())
}

/// Polls the server (`inspect`, or a probe) for `key` while `believed()`
/// says the holder believes it holds the lock: every answer that arrived
/// before the holder's deadline (`valid_until()`) must show the holder
/// (`token`). The answer's arrival bounds when the server was asked, so a
/// lock the server expired before the holder's deadline is caught, while a
/// conforming backend (whose deadline is counted from before the request
/// was sent, minus a drift allowance) never is.
pub(super) async fn server_holds_until_deadline(
    observer: &LockClient,
    key: &LockKey,
    token: distlock_core::FencingToken,
    valid_until: impl Fn() -> Instant,
    believed: impl Fn() -> bool,
    what: &str,
) -> Result<usize, CaseError> {
    let mut answers = 0;
    loop {
        let deadline = valid_until();
        if Instant::now() >= deadline || !believed() {
            return Ok(answers);
        }
        let held = still_held_by(observer, key, token).await?;
        let answered = Instant::now();
        if answered < valid_until() && believed() {
            answers += 1;
            check!(
                held,
                "{what}: the server had already let the lock go {:?} before the holder's deadline (its guard or lease still believed it held the lock)",
                valid_until() - answered
            );
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
}

/// How long a slow client waits for a free key: a grant its delayed
/// replies bring inside the stop margin is given back and tried again.
const SLOW_GRANT_WAIT: Duration = Duration::from_secs(20);

/// The holder's deadline never outlives the server's expiry: requests and
/// replies of the holder are delayed; a guard without renewal, a raw
/// renewing lease nobody renews, and a renewing guard whose connection is
/// then black-holed each believe they hold the lock until their deadline
/// (`lost()` fires then), and the server, asked throughout, must hold it
/// for them at every answer that arrived before that deadline. Each guard's
/// `lost()` must fire (Expired).
pub async fn holder_deadline_within_server_expiry(ctx: TestContext) -> CaseResult {
    // Two delayed round trips (etcd: lease grant, then transaction) must
    // leave the lease valid on arrival.
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(2))?;
    let both = [Direction::ToServer, Direction::ToClient];
    let observer = ctx.client().await?;
    let mut checks = Vec::new();

    // A guard that never renews.
    {
        let (ctx, observer) = (ctx.clone(), observer.clone());
        checks.push(tokio::spawn(async move {
            let (path, holder) = slow_client(&ctx, &both, ttl).await?;
            let key = ctx.key("lease-deadline");
            let guard = Locker::new(holder)
                // Waiting: a grant that a loaded machine delays into its stop
                // margin is given back and tried again.
                .acquire(
                    &key,
                    &LockOptions::new(ttl)
                        .with_renewal(Renewal::Off)
                        .with_wait(SLOW_GRANT_WAIT),
                )
                .await?
                .ok_or("the key should be free")?;
            let token = guard.fencing_token();
            let answers = server_holds_until_deadline(
                &observer,
                &key,
                token,
                || guard.lease().valid_until(),
                || !guard.is_lost(),
                "guard without renewal",
            )
            .await?;
            let reason = within(expiry_bound(ttl), guard.lost(), "the guard's lost()").await?;
            check_eq!(reason, LostReason::Expired, "why the guard lost its lock");
            drop(path);
            Ok::<_, CaseError>(answers)
        }));
    }
    // A raw renewing acquisition nobody renews.
    {
        let (ctx, observer) = (ctx.clone(), observer.clone());
        checks.push(tokio::spawn(async move {
            let (path, holder) = slow_client(&ctx, &both, ttl).await?;
            let (key, lease) = usable_grant(&ctx, &holder, true, ttl, "renewing acquire").await?;
            let answers = server_holds_until_deadline(
                &observer,
                &key,
                lease.fencing_token(),
                || lease.valid_until(),
                || true,
                "raw renewing lease",
            )
            .await?;
            drop(path);
            Ok(answers)
        }));
    }
    // A renewing guard cut off after it was granted the lock.
    if ctx.can_inject_faults() {
        let (ctx, observer) = (ctx.clone(), observer.clone());
        checks.push(tokio::spawn(async move {
            let (path, holder) = slow_client(&ctx, &both, ttl).await?;
            let path = path.ok_or("no fault path")?;
            let key = ctx.key("lease-deadline");
            let guard = Locker::new(holder)
                .acquire(&key, &LockOptions::new(ttl).with_wait(SLOW_GRANT_WAIT))
                .await?
                .ok_or("the key should be free")?;
            path.black_hole();
            let answers = server_holds_until_deadline(
                &observer,
                &key,
                guard.fencing_token(),
                || guard.lease().valid_until(),
                || !guard.is_lost(),
                "renewing guard cut off",
            )
            .await?;
            let reason = within(expiry_bound(ttl), guard.lost(), "the guard's lost()").await?;
            check_eq!(
                reason,
                LostReason::Expired,
                "why the cut-off guard lost its lock"
            );
            path.heal();
            Ok(answers)
        }));
    }
    let mut answers = Vec::new();
    for check in checks {
        answers.push(
            within(expiry_bound(ttl) * 3, check, "a holder")
                .await?
                .map_err(|e| format!("a holder panicked: {e}"))??,
        );
    }
    check!(
        answers.iter().all(|n| *n > 0),
        "the server was never asked before a holder's deadline ({answers:?} answers); the case tested nothing"
    );
    Ok(())
}

/// A renewing acquisition whose holder stops before its first renewal
/// (its client dropped, or alive and silent) frees the key within its TTL:
/// a plain lock of three times that TTL, taken right after, must still be
/// held when the renewing one is found free. A backend that attaches such
/// locks to a session much longer than the TTL keeps them far longer.
pub async fn renewing_holder_death_frees_key(ctx: TestContext) -> CaseResult {
    let ttl = ctx.short_ttl();
    let reference_ttl = ctx.capabilities().effective_ttl(ttl * 3)?;
    let mut runs = Vec::new();
    for drop_client in [true, false] {
        let ctx = ctx.clone();
        runs.push(tokio::spawn(async move {
            let holder = ctx.client().await?;
            let reference = ctx.client().await?;
            let other = ctx.client().await?;
            let key = ctx.key("lease-renewing");
            let reference_key = ctx.key("lease-reference");
            let lease = granted(
                holder.try_acquire_renewing(&key, ttl).await?,
                "renewing acquire",
            )?;
            let reference_lease =
                acquire(&reference, &reference_key, reference_ttl, "reference lock").await?;
            if drop_client {
                drop(holder);
            }
            let next = super::support::eventually_acquire(
                &other,
                &key,
                ctx.long_ttl(),
                expiry_bound(reference_ttl),
                "the renewing lock of a holder that stopped",
            )
            .await?;
            check!(
                still_held_by(&other, &reference_key, reference_lease.fencing_token()).await?,
                "the renewing lock (TTL {ttl:?}) of a holder that {} outlived a plain lock of {reference_ttl:?} taken after it",
                if drop_client { "was dropped" } else { "stopped renewing" }
            );
            check!(
                next.fencing_token() > lease.fencing_token(),
                "the token grows past the dead holder's"
            );
            other.release(&next).await?;
            reference.release(&reference_lease).await?;
            Ok::<_, CaseError>(())
        }));
    }
    for run in runs {
        within(expiry_bound(reference_ttl) * 2, run, "a holder")
            .await?
            .map_err(|e| format!("a holder panicked: {e}"))??;
    }
    Ok(())
}

/// What the holder does as its lease runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RaceOp {
    Release,
    Extend,
}

/// Keys raced at once, and rounds per key.
const RACE_KEYS: usize = 8;
const RACE_ROUNDS: usize = 4;

/// Races `op` by a holder against its own lease's expiry while another
/// client tries to take the key every millisecond, `RACE_KEYS` x
/// `RACE_ROUNDS` times, with the holder's call landing at random points
/// around the expiry.
async fn race_against_expiry(ctx: TestContext, op: RaceOp) -> CaseResult {
    let ttl = ctx.short_ttl();
    let caps = ctx.capabilities().clone();
    // Where the server expires the lock is known to within its granularity
    // (etcd: whole seconds, revoked in batches).
    let spread = (caps.ttl_granularity / 2).max(Duration::from_millis(15));
    let holder = ctx.client().await?;
    let other = ctx.client().await?;
    let mut tasks = Vec::new();
    for _ in 0..RACE_KEYS {
        let (ctx, holder, other) = (ctx.clone(), holder.clone(), other.clone());
        tasks.push(tokio::spawn(async move {
            let mut raced = 0usize;
            for round in 0..RACE_ROUNDS {
                let key = ctx.key("lease-race");
                let lease = acquire(&holder, &key, ttl, "holder").await?;
                let expiry = lease.sent_at() + lease.ttl();
                let offset = Duration::from_micros(rand::random_range(
                    0..spread.as_micros() as u64 + 10_000,
                ));
                let op_at = expiry.checked_sub(Duration::from_millis(10)).unwrap_or(expiry) + offset;
                let done = Arc::new(AtomicBool::new(false));
                let call = {
                    let (holder, lease, done) = (holder.clone(), lease.clone(), done.clone());
                    let long = ctx.long_ttl();
                    tokio::spawn(async move {
                        tokio::time::sleep_until(op_at.into()).await;
                        let result = match op {
                            RaceOp::Release => holder.release(&lease).await.map(|()| None),
                            RaceOp::Extend => holder.extend(&lease, long).await.map(Some),
                        };
                        done.store(true, Ordering::SeqCst);
                        result
                    })
                };
                tokio::time::sleep_until(
                    lease
                        .valid_until()
                        .checked_sub(Duration::from_millis(20))
                        .unwrap_or(lease.valid_until())
                        .into(),
                )
                .await;
                // Once the holder's call returned, one more refused attempt
                // settles it: the holder kept the lock.
                let mut seen_done = false;
                let taken = spin_acquire(
                    &other,
                    &key,
                    ctx.long_ttl(),
                    expiry_bound(ttl) + spread,
                    || std::mem::replace(&mut seen_done, done.load(Ordering::SeqCst)),
                    "the other client",
                )
                .await?;
                let result = within(expiry_bound(ttl), call, "the holder's call")
                    .await?
                    .map_err(|e| format!("the holder's call panicked: {e}"))?;
                if let Err(e) = &result {
                    check!(
                        e.kind() == ErrorKind::NotHeld,
                        "round {round}: {op:?} racing the expiry failed with {:?}: {e}",
                        e.kind()
                    );
                }
                match (op, result, taken) {
                    (RaceOp::Release, result, Some((theirs, _))) => {
                        raced += 1;
                        check!(
                            still_held_by(&other, &key, theirs.fencing_token()).await?,
                            "round {round}: the holder's release (answered {result:?}) racing its lease's expiry deleted the lock another client had taken since: release is not atomic"
                        );
                        other.release(&theirs).await?;
                    }
                    (RaceOp::Extend, Ok(Some(extended)), Some((theirs, _))) => {
                        let now_holder = holder_of(&other, &key).await?;
                        return Err(CaseError(format!(
                            "round {round}: the holder's extend succeeded (token {}) although another client was granted the lock (token {}) as it ran out; the server now says {now_holder:?}: extend is not atomic",
                            extended.fencing_token(),
                            theirs.fencing_token()
                        )));
                    }
                    (RaceOp::Extend, Ok(Some(extended)), None) => {
                        check!(
                            still_held_by(&other, &key, extended.fencing_token()).await?,
                            "round {round}: the holder's extend succeeded but the server does not show its lock"
                        );
                        holder.release(&extended).await?;
                    }
                    (RaceOp::Extend, _, Some((theirs, _))) => {
                        raced += 1;
                        other.release(&theirs).await?;
                    }
                    (_, _, None) => {}
                }
            }
            Ok::<_, CaseError>(raced)
        }));
    }
    let mut raced = 0;
    for task in tasks {
        raced += within(Duration::from_secs(120), task, "a racing key")
            .await?
            .map_err(|e| format!("a racing key panicked: {e}"))??;
    }
    check!(
        raced > 0,
        "the other client never got a key in the race; the case tested nothing"
    );
    Ok(())
}

/// A holder releases just as its lease runs out while another client keeps
/// trying to take the key: whatever the holder's release answers, a lock
/// the other client was granted must still be there afterwards (a release
/// that checks the owner and then deletes in a second step deletes it).
pub async fn release_atomic_against_expiry(ctx: TestContext) -> CaseResult {
    race_against_expiry(ctx, RaceOp::Release).await
}

/// A holder extends just as its lease runs out while another client keeps
/// trying to take the key: the extend may succeed (and then nobody else
/// gets the key) or be refused, never both.
pub async fn extend_atomic_against_expiry(ctx: TestContext) -> CaseResult {
    race_against_expiry(ctx, RaceOp::Extend).await
}

/// How far before a lease's reported end `reported_ttl_within_server_expiry`
/// starts asking for the key, at most.
const REPORTED_LEAD: Duration = Duration::from_millis(25);

/// The TTL a backend reports is the one the server applied: the moment the
/// holder's lease says the server lets the lock go (`sent_at + ttl`, before
/// any drift allowance) is never later than the server's own expiry, after
/// acquire (plain and renewing) and after extend, twice each.
///
/// Two readings of the server's expiry, neither waiting for a coarse
/// deadline: `inspect` right after the grant (where the backend has it: the
/// expiry is at most the answer's arrival plus the time left it reports,
/// plus the TTL granularity), and another client asking for the key without
/// pause from shortly before the reported end (a grant arriving is after
/// the server expired the lock). One-sided, with 0.1% of the TTL for clock
/// rates: a conservative backend passes on any machine, one that reports a
/// few milliseconds more than it set fails.
pub async fn reported_ttl_within_server_expiry(ctx: TestContext) -> CaseResult {
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(1))?;
    let holder = ctx.client().await?;
    let other = ctx.client().await?;
    let mut rounds = Vec::new();
    for round in 0..8 {
        let (extend, renewing) = (round % 4 >= 2, round % 2 == 1);
        let (ctx, holder, other) = (ctx.clone(), holder.clone(), other.clone());
        rounds.push(tokio::spawn(async move {
            let what = format!(
                "round {round} ({}, renewing: {renewing})",
                if extend { "extend" } else { "acquire" }
            );
            let key = ctx.key("lease-reported");
            let attempt = if renewing {
                holder.try_acquire_renewing(&key, ttl).await?
            } else {
                holder.try_acquire(&key, ttl).await?
            };
            let mut lease = granted(attempt, &what)?;
            if extend {
                tokio::time::sleep(ttl / 4).await;
                lease = holder.extend(&lease, ttl).await?;
            }
            reported_end_within_expiry(&ctx, &other, &lease, &what).await
        }));
    }
    for round in rounds {
        within(expiry_bound(ttl) * 2, round, "a round")
            .await?
            .map_err(|e| format!("a round panicked: {e}"))??;
    }
    Ok(())
}

/// Checks `lease`'s reported end against the server's expiry, read through
/// `other` (see [`reported_ttl_within_server_expiry`]).
async fn reported_end_within_expiry(
    ctx: &TestContext,
    other: &LockClient,
    lease: &Lease,
    what: &str,
) -> CaseResult {
    let reported_end = lease.sent_at() + lease.ttl();
    let rate = lease.ttl() / 1000;
    let granularity = ctx.capabilities().ttl_granularity;
    if other.admin().is_some() {
        for _ in 0..3 {
            let state = other.inspect(lease.key()).await?;
            let answered = Instant::now();
            match state {
                distlock_core::LockState::Held {
                    expires_in: Some(left),
                    fencing_token,
                    ..
                } if fencing_token == lease.fencing_token() => {
                    let expiry = answered + left + granularity + rate;
                    check!(
                        reported_end <= expiry,
                        "{what}: the lease reports the lock lasts {:?} past the server's own expiry (inspect: {left:?} left; reported TTL {:?} from before the request was sent)",
                        reported_end - expiry,
                        lease.ttl()
                    );
                }
                distlock_core::LockState::Held {
                    expires_in: None,
                    fencing_token,
                    ..
                } if fencing_token == lease.fencing_token() => {}
                state if answered < lease.valid_until() => {
                    return Err(CaseError(format!(
                    "{what}: inspect shows {state:?} while the holder's lease (token {}) is valid",
                    lease.fencing_token()
                )))
                }
                _ => break,
            }
        }
    }
    let lead = (lease.ttl() / 4).min(REPORTED_LEAD);
    tokio::time::sleep_until(
        reported_end
            .checked_sub(lead)
            .unwrap_or(reported_end)
            .into(),
    )
    .await;
    loop {
        let asked = Instant::now();
        match other.try_acquire(lease.key(), ctx.long_ttl()).await? {
            AcquireAttempt::Acquired(next) => {
                let got = Instant::now();
                other.release(&next).await?;
                check!(
                    reported_end <= got + rate,
                    "{what}: another client was granted the lock {:?} before the holder's lease ends by the TTL the backend reported ({:?} from before the request was sent)",
                    reported_end - got,
                    lease.ttl()
                );
                return Ok(());
            }
            // Asked after the reported end and still refused: nobody can
            // be granted the lock before it any more.
            AcquireAttempt::Held { .. } if asked >= reported_end => return Ok(()),
            AcquireAttempt::Held { .. } => tokio::task::yield_now().await,
        }
    }
}
