//! `semaphore::` — at most N holders of a key, one lease per permit: the
//! limit is never exceeded (and is reached), a crashed holder's permit comes
//! back, waiting is cancel-safe and woken by a release, foreign and stale
//! permits are refused, fencing grows across permits, the limit is agreed,
//! N = 1 behaves as a mutex.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, ErrorKind, Lease, LockClient, LockKey, LockOptions, Locker, LostReason,
};

use super::support::{
    background_bound, expect_kind, expiry_bound, lock_free_key, until_attempts, within,
};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::{check, check_eq, ObservedLock};

/// The limit most cases use.
const N: u32 = 3;

/// A permit of `key`'s semaphore of `limit`, or an error saying what.
async fn permit(
    client: &LockClient,
    key: &LockKey,
    limit: u32,
    ttl: Duration,
    what: &str,
) -> Result<Lease, CaseError> {
    match client.try_acquire_permit(key, limit, ttl).await {
        Ok(AcquireAttempt::Acquired(lease)) => Ok(lease),
        Ok(AcquireAttempt::Held { .. }) => Err(CaseError(format!(
            "{what}: no permit of {key:?} (limit {limit}) although one should be free"
        ))),
        Err(e) => Err(CaseError(format!("{what}: permit of {key:?} failed: {e}"))),
    }
}

/// Asserts every permit of `key` is taken.
async fn full(client: &LockClient, key: &LockKey, limit: u32, what: &str) -> CaseResult {
    match client
        .try_acquire_permit(key, limit, Duration::from_secs(30))
        .await?
    {
        AcquireAttempt::Held { .. } => Ok(()),
        AcquireAttempt::Acquired(lease) => {
            let _ = client.release(&lease).await;
            Err(CaseError(format!(
                "{what}: got permit {} of {key:?} beyond its limit {limit}",
                lease.fencing_token()
            )))
        }
    }
}

/// N permits go to N clients; the next is refused; a release lets it in.
pub async fn at_most_n_holders(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem");
    let mut held = Vec::new();
    for i in 0..N {
        let client = ctx.client().await?;
        let lease = permit(&client, &key, N, ctx.long_ttl(), &format!("holder {i}")).await?;
        check_eq!(lease.permit_limit(), Some(N), "the lease is a permit of N");
        held.push((client, lease));
    }
    let late = ctx.client().await?;
    full(&late, &key, N, "with N permits held").await?;
    let (first, lease) = held.remove(0);
    first.release(&lease).await?;
    let got = permit(&late, &key, N, ctx.long_ttl(), "after one release").await?;
    full(&first, &key, N, "N held again").await?;
    late.release(&got).await?;
    for (client, lease) in held {
        client.release(&lease).await?;
    }
    Ok(())
}

/// 16 clients, N = 3, hundreds of sections through `Locker` with
/// `LockOptions::with_permits`: never more than N inside at once, and N reached.
///
/// Until N holders have been inside at once, a holder stays inside until
/// they are (or the case's patience runs out): a section of 5 ms is short
/// beside a release on a loaded machine, so N short sections seldom overlap
/// even where N permits are held, and "N reached" failed by chance
/// (PostgreSQL over TLS, CI). Holding longer only adds contention to
/// "never more than N".
pub async fn never_more_than_n(ctx: TestContext) -> CaseResult {
    const CLIENTS: usize = 16;
    const SECTIONS: usize = 20;
    // Under the sections' TTL of 30 s, so a lease never runs out inside.
    let patience = Instant::now() + Duration::from_secs(20);
    let key = ctx.key("sem-crowd");
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let options = LockOptions::new(Duration::from_secs(30))
        .with_permits(N)
        .with_wait(Duration::from_secs(120));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let locker = ctx.locker().await?;
        let (key, options, inside, most) =
            (key.clone(), options.clone(), inside.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..SECTIONS {
                let guard = locker
                    .acquire(&key, &options)
                    .await?
                    .ok_or_else(|| format!("section {i}: waited 120 s without getting a permit"))?;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                // Long enough for others to be inside at the same time.
                tokio::time::sleep(Duration::from_millis(5)).await;
                while most.load(Ordering::SeqCst) < N as usize && Instant::now() < patience {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await?;
            }
            Ok::<(), CaseError>(())
        }));
    }
    for task in tasks {
        within(Duration::from_secs(170), task, "semaphore worker")
            .await?
            .map_err(|e| format!("worker panicked: {e}"))??;
    }
    let most = most.load(Ordering::SeqCst);
    check!(
        most <= N as usize,
        "{most} holders were inside at once with a limit of {N}"
    );
    check_eq!(
        most,
        N as usize,
        "the most holders inside at once (limit {N}; holders waited up to 20 s inside for it)"
    );
    Ok(())
}

/// A holder that stops (never releases, never renews) gives its permit
/// back when its TTL runs out, never before.
pub async fn crashed_holder_returns_permit(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem-crash");
    let ttl = ctx.short_ttl();
    // Every client is open, and the long permit taken, before the short
    // one: only the crash falls between its grant and the check that it is
    // still held (a TLS connect on a loaded machine outlasted its TTL).
    let crashed = ctx.client().await?;
    let other = ctx.client().await?;
    let waiter = ctx.client().await?;
    let kept = permit(&other, &key, 2, ctx.long_ttl(), "the other holder").await?;
    let lost = permit(&crashed, &key, 2, ttl, "the holder that crashes").await?;
    drop(crashed);
    full(&waiter, &key, 2, "right after the crash").await?;
    let deadline = Instant::now() + expiry_bound(ttl);
    let got = loop {
        if let AcquireAttempt::Acquired(lease) =
            waiter.try_acquire_permit(&key, 2, ctx.long_ttl()).await?
        {
            break lease;
        }
        check!(
            Instant::now() < deadline,
            "the crashed holder's permit (TTL {ttl:?}) did not come back within {:?}",
            expiry_bound(ttl)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    check!(
        Instant::now() >= lost.valid_until(),
        "the crashed holder's permit was handed out before its own deadline"
    );
    waiter.release(&got).await?;
    other.release(&kept).await?;
    Ok(())
}

/// A waiter blocked on a full semaphore is granted a permit when one is
/// released — before the released permit's lease could have run out.
pub async fn waiter_woken_by_release(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem-wait");
    let holder = ctx.client().await?;
    let lease = permit(&holder, &key, 1, ctx.long_ttl(), "the holder").await?;
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let waiter = LockClient::new(observed.clone());
    let task = {
        let (key, ttl) = (key.clone(), ctx.long_ttl());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            waiter
                .acquire_permit(&key, 1, ttl, deadline)
                .await
                .map(|got| got.map(|l| (waiter, l, Instant::now())))
        })
    };
    until_attempts(&observed, 1, "the permit waiter").await?;
    holder.release(&lease).await?;
    let (waiter, got, at) = within(background_bound(), task, "the waiter woken by the release")
        .await?
        .map_err(|e| format!("waiter panicked: {e}"))??
        .ok_or("the waiter gave up although a permit was released")?;
    check!(
        at < lease.valid_until(),
        "the waiter got the permit only after the released one would have expired"
    );
    waiter.release(&got).await?;
    Ok(())
}

/// Waiting futures dropped at random points leave no permit held: N fresh
/// permits are free right after.
pub async fn cancelled_waiters_leave_nothing_held(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem-cancel");
    let holder = ctx.client().await?;
    let mut held = Vec::new();
    for i in 0..N {
        held.push(permit(&holder, &key, N, ctx.long_ttl(), &format!("holder {i}")).await?);
    }
    let waiters = super::support::clients(&ctx, 4).await?;
    let mut tasks = Vec::new();
    for (i, waiter) in waiters.iter().enumerate() {
        let (waiter, key, ttl) = (waiter.clone(), key.clone(), ctx.long_ttl());
        tasks.push(tokio::spawn(async move {
            for round in 0..10u64 {
                let cut = Duration::from_millis((round * 7 + i as u64 * 3) % 40);
                let deadline = Instant::now() + Duration::from_secs(30);
                let waited =
                    tokio::time::timeout(cut, waiter.acquire_permit(&key, N, ttl, deadline)).await;
                // Got one before the cut: give it back (only dropped waits
                // are under test).
                if let Ok(Ok(Some(lease))) = waited {
                    let _ = waiter.release(&lease).await;
                }
            }
        }));
    }
    // Permits come and go while waiters are dropped.
    for lease in held.drain(..) {
        tokio::time::sleep(Duration::from_millis(30)).await;
        holder.release(&lease).await?;
    }
    for task in tasks {
        within(Duration::from_secs(60), task, "a dropping waiter")
            .await?
            .map_err(|e| format!("a dropping waiter panicked: {e}"))?;
    }
    // Anything a dropped waiter was granted is released in the background.
    let fresh = ctx.client().await?;
    every_permit_within(
        &fresh,
        &key,
        N,
        ctx.long_ttl(),
        background_bound(),
        "after the dropped waiters: a dropped waiter left one held",
    )
    .await
}

/// Takes every permit of `key`'s semaphore of `limit`, trying for up to
/// `bound`, then gives them back; an error saying how many were free
/// `when` otherwise. Each permit is taken for `ttl + bound` (at most the
/// backend's maximum TTL), so the first ones taken are still held when
/// the last comes free: with `ttl` alone, a permit left taken until its
/// TTL ran out let the first ones expire too, and their release failed as
/// not held (a flaky `fault::permit_torture` on a loaded machine).
pub(crate) async fn every_permit_within(
    client: &LockClient,
    key: &LockKey,
    limit: u32,
    ttl: Duration,
    bound: Duration,
    when: &str,
) -> CaseResult {
    let deadline = Instant::now() + bound;
    let held_for = (ttl + bound).min(client.capabilities().max_ttl);
    let mut got = Vec::new();
    while got.len() < limit as usize {
        match client.try_acquire_permit(key, limit, held_for).await? {
            AcquireAttempt::Acquired(lease) => got.push(lease),
            AcquireAttempt::Held { .. } => {
                check!(
                    Instant::now() < deadline,
                    "only {} of {limit} permits free within {bound:?} {when}",
                    got.len()
                );
                tokio::time::sleep(super::support::POLL).await;
            }
        }
    }
    for lease in got {
        client.release(&lease).await?;
    }
    Ok(())
}

/// Release and extend with another client's permit are invalid input; a
/// released or stale permit is not held, and another holder's permit stays.
pub async fn foreign_and_stale_permits_refused(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem-foreign");
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let mine = permit(&a, &key, N, ctx.long_ttl(), "a's permit").await?;
    expect_kind(
        b.release(&mine).await,
        ErrorKind::InvalidInput,
        "b releasing a's permit",
    )?;
    expect_kind(
        b.extend(&mine, ctx.long_ttl()).await,
        ErrorKind::InvalidInput,
        "b extending a's permit",
    )?;
    let short = permit(&b, &key, N, ctx.short_ttl(), "b's short permit").await?;
    a.release(&mine).await?;
    expect_kind(
        a.release(&mine).await,
        ErrorKind::NotHeld,
        "a releasing twice",
    )?;
    expect_kind(
        a.extend(&mine, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "a extending a released permit",
    )?;
    tokio::time::sleep(expiry_bound(ctx.short_ttl())).await;
    expect_kind(
        b.extend(&short, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "extending an expired permit",
    )?;
    // The expired permit was not resurrected: all N are free.
    let mut got = Vec::new();
    for i in 0..N {
        got.push(permit(&a, &key, N, ctx.long_ttl(), &format!("free permit {i}")).await?);
    }
    for lease in got {
        a.release(&lease).await?;
    }
    Ok(())
}

/// Fencing tokens grow strictly across every permit of a key, held at once
/// or one after another; extending keeps a permit's token.
pub async fn fencing_grows_across_permits(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem-fencing");
    let client = ctx.client().await?;
    let mut last = None;
    for round in 0..3 {
        let mut held = Vec::new();
        for i in 0..N {
            let lease = permit(
                &client,
                &key,
                N,
                ctx.long_ttl(),
                &format!("round {round}, permit {i}"),
            )
            .await?;
            if let Some(prev) = last {
                check!(
                    lease.fencing_token() > prev,
                    "permit token {} after {prev}",
                    lease.fencing_token()
                );
            }
            last = Some(lease.fencing_token());
            held.push(lease);
        }
        let extended = client.extend(&held[0], ctx.long_ttl()).await?;
        check_eq!(
            extended.fencing_token(),
            held[0].fencing_token(),
            "a permit's token after extend"
        );
        for lease in held {
            client.release(&lease).await?;
        }
    }
    Ok(())
}

/// A client asking with another limit while permits are held gets an
/// invalid-input error naming both numbers; once none is held, the new
/// limit applies.
pub async fn limit_disagreement(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem-limit");
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let held = permit(&a, &key, N, ctx.long_ttl(), "a permit of 3").await?;
    let err = match b.try_acquire_permit(&key, 5, ctx.long_ttl()).await {
        Err(e) => e,
        Ok(other) => {
            return Err(CaseError(format!(
                "asking for limit 5 while permits of limit 3 are held: expected an error, got {other:?}"
            )))
        }
    };
    check_eq!(
        err.kind(),
        ErrorKind::InvalidInput,
        "the disagreement's kind"
    );
    check!(
        err.message().contains('3') && err.message().contains('5'),
        "the error names both limits: {err}"
    );
    expect_kind(
        b.try_acquire_permit(&key, 0, ctx.long_ttl()).await,
        ErrorKind::InvalidInput,
        "a limit of 0",
    )?;
    a.release(&held).await?;
    let mut got = Vec::new();
    for i in 0..5 {
        got.push(
            permit(
                &b,
                &key,
                5,
                ctx.long_ttl(),
                &format!("permit {i} of the new limit 5"),
            )
            .await?,
        );
    }
    full(&a, &key, 5, "the new limit 5 reached").await?;
    for lease in got {
        b.release(&lease).await?;
    }
    Ok(())
}

/// N = 1 behaves as a mutex: one holder, the next refused, and a guarded
/// non-atomic counter stays exact.
pub async fn one_permit_is_a_mutex(ctx: TestContext) -> CaseResult {
    let key = ctx.key("sem-mutex");
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let held = permit(&a, &key, 1, ctx.long_ttl(), "the only permit").await?;
    full(&b, &key, 1, "a second holder").await?;
    a.release(&held).await?;
    let checker = crate::checker::ExclusionChecker::new();
    let options = LockOptions::new(Duration::from_secs(30))
        .with_permits(1)
        .with_wait(Duration::from_secs(60));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let locker = ctx.locker().await?;
        let (key, options, checker) = (key.clone(), options.clone(), checker.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let guard = locker
                    .acquire(&key, &options)
                    .await?
                    .ok_or_else(|| format!("iteration {i}: no permit within 60 s"))?;
                checker.critical_section(&key, guard.fencing_token()).await;
                guard.release().await?;
            }
            Ok::<(), CaseError>(())
        }));
    }
    for task in tasks {
        within(Duration::from_secs(120), task, "mutex worker")
            .await?
            .map_err(|e| format!("worker panicked: {e}"))??;
    }
    let report = checker.verify()?;
    check_eq!(
        report.counters.get(&key).copied(),
        Some(100),
        "the guarded counter"
    );
    Ok(())
}

/// A permit guard renews itself past its TTL, and run_exclusive runs under
/// a permit (`LockOptions::with_permits`), skipping when all are taken.
pub async fn guards_and_run_exclusive(ctx: TestContext) -> CaseResult {
    // Renewal past the TTL, not expiry, is what is tested: a TTL a loaded
    // machine renews in time (an etcd permit renewal is a request or two),
    // and a round whose renewal still came too late (lost as `Expired`) is
    // tried again on a new key; a refused renewal fails at once.
    let ttl = ctx.steady_ttl();
    let locker = ctx.locker().await?;
    let options = LockOptions::new(ttl).with_permits(2);
    let mut rounds = 0;
    let (key, first, second) = loop {
        rounds += 1;
        let key = ctx.key("sem-guard");
        let first = lock_free_key(&locker, &key, &options).await?;
        let second = lock_free_key(&locker, &key, &options).await?;
        tokio::time::sleep(ttl * 3).await;
        let reasons = [first.lost_signal().reason(), second.lost_signal().reason()];
        if reasons == [None, None] {
            break (key, first, second);
        }
        check!(
            reasons.iter().flatten().all(|r| *r == LostReason::Expired) && rounds < 5,
            "a renewing permit guard lost its permit (round {rounds}: {reasons:?})"
        );
        drop((first, second));
        within(
            Duration::from_secs(30),
            locker.client().idle(),
            "the permits' release",
        )
        .await?;
    };
    let other = Locker::new(ctx.client().await?);
    let outcome = other
        .run_exclusive(
            &key,
            &distlock_core::RunOptions::new(options.clone()),
            |_| async { 1 },
        )
        .await?;
    check!(
        outcome.is_skipped(),
        "run_exclusive ran with both permits taken: {outcome:?}"
    );
    drop(first);
    let deadline = Instant::now() + background_bound();
    loop {
        let outcome = other
            .run_exclusive(
                &key,
                &distlock_core::RunOptions::new(options.clone()),
                |ctx| async move { ctx.fencing_token },
            )
            .await?;
        if outcome.is_completed() {
            break;
        }
        check!(
            Instant::now() < deadline,
            "a dropped permit guard did not give its permit back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    second.release().await?;
    Ok(())
}

/// A lock and a semaphore of the same name share nothing: while the lock is
/// held, every permit of the semaphore is granted (and no more); releasing
/// the lock leaves the permits held, the lock can be taken again while they
/// are, and returning the permits leaves the lock held. `inspect` shows the
/// lock's own holder throughout. For a limit of 1 and of 3.
pub async fn lock_and_semaphore_of_one_name_independent(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    for limit in [1, N] {
        let key = ctx.key("sem-vs-lock");
        let lock = super::support::acquire(&a, &key, ctx.long_ttl(), "the lock").await?;
        let mut permits = Vec::new();
        for i in 0..limit {
            let what = format!("permit {i} of {limit} of the semaphore named like a held lock");
            permits.push(permit(&b, &key, limit, ctx.long_ttl(), &what).await?);
        }
        full(
            &a,
            &key,
            limit,
            "every permit held (the lock is not one of them)",
        )
        .await?;
        super::support::refused(&b, &key, "the lock, with the permits taken").await?;
        a.release(&lock).await?;
        full(
            &a,
            &key,
            limit,
            "after the lock of the same name was released",
        )
        .await?;
        let again = super::support::acquire(
            &a,
            &key,
            ctx.long_ttl(),
            "the lock while every permit is held",
        )
        .await?;
        if a.admin().is_some() {
            match a.inspect(&key).await? {
                distlock_core::LockState::Held { fencing_token, .. } => {
                    check_eq!(
                        fencing_token,
                        again.fencing_token(),
                        "the lock's holder per inspect"
                    );
                }
                state => return Err(format!("inspect shows {state:?} for a held lock").into()),
            }
        }
        for lease in permits {
            b.release(&lease).await?;
        }
        super::support::refused(&b, &key, "the lock after every permit was returned").await?;
        let back = permit(
            &b,
            &key,
            limit,
            ctx.long_ttl(),
            "a permit once all came back",
        )
        .await?;
        b.release(&back).await?;
        a.release(&again).await?;
    }
    Ok(())
}

/// A renewing permit (what a permit guard takes, `renewing` set) whose
/// holder stops before its first renewal (its client dropped, or alive and
/// silent) comes back within its TTL: a plain lock of three times that TTL,
/// taken right after, must still be held when the permit is granted to
/// another client. A backend that attaches such permits to a session much
/// longer than the TTL keeps them far longer. The permit is taken through
/// the backend's raw `SemaphoreBackend`, as the guard's first attempt is,
/// and never renewed.
pub async fn renewing_permit_holder_death_frees_permit(ctx: TestContext) -> CaseResult {
    let ttl = ctx.short_ttl();
    let reference_ttl = ctx.capabilities().effective_ttl(ttl * 3)?;
    let mut runs = Vec::new();
    for drop_client in [true, false] {
        let ctx = ctx.clone();
        runs.push(tokio::spawn(async move {
            let holder = ctx.client().await?;
            let reference = ctx.client().await?;
            let other = ctx.client().await?;
            let key = ctx.key("sem-renewing");
            let reference_key = ctx.key("sem-reference");
            let semaphore = holder
                .semaphore()
                .ok_or("the holder's client has no semaphores")?;
            let request = distlock_core::PermitRequest {
                key: &key,
                owner: distlock_core::OwnerToken::random(),
                ttl,
                limit: 1,
                renewing: true,
                settling: false,
                holder: None,
            };
            let fencing = match semaphore.acquire_permit(request).await? {
                distlock_core::PermitReply::Granted(grant) => grant.fencing,
                reply => return Err(CaseError(format!("a renewing permit of a free semaphore: {reply:?}"))),
            };
            let reference_lease =
                super::support::acquire(&reference, &reference_key, reference_ttl, "reference lock")
                    .await?;
            if drop_client {
                drop(holder);
            }
            let deadline = Instant::now() + expiry_bound(reference_ttl);
            let next = loop {
                if let AcquireAttempt::Acquired(lease) =
                    other.try_acquire_permit(&key, 1, ctx.long_ttl()).await?
                {
                    break lease;
                }
                check!(
                    Instant::now() < deadline,
                    "the renewing permit (TTL {ttl:?}) did not come back within {:?}",
                    expiry_bound(reference_ttl)
                );
                tokio::time::sleep(super::support::POLL).await;
            };
            check!(
                super::support::still_held_by(&other, &reference_key, reference_lease.fencing_token())
                    .await?,
                "the renewing permit (TTL {ttl:?}) of a holder that {} outlived a plain lock of {reference_ttl:?} taken after it",
                if drop_client { "was dropped" } else { "stopped renewing" }
            );
            check!(
                next.fencing_token() > fencing,
                "the next permit's token grows past the dead holder's"
            );
            other.release(&next).await?;
            reference.release(&reference_lease).await?;
            Ok::<_, CaseError>(())
        }));
    }
    for run in runs {
        within(expiry_bound(reference_ttl) * 2, run, "a permit holder")
            .await?
            .map_err(|e| format!("a permit holder panicked: {e}"))??;
    }
    Ok(())
}
