//! `election::` — leader election ([`Locker::campaign`]): one leader at a
//! time under campaigning, resigning and crashing candidates; observers
//! see every change they are given time to see, in term order, with the
//! right identity; a resign hands over at once, a crash once the TTL runs
//! out; vacancy is reported; bad identities are refused.
//!
//! What hands over is checked by cause, never by a time: a resigning
//! leader holds for the long TTL, so only its resign can explain a
//! handover within [`background_bound`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::{
    ErrorKind, FencingToken, HolderId, Leader, LeaderWatch, Leadership, LockClient, LockError,
    LockKey, LockOptions, Locker, Renewal, MAX_HOLDER_BYTES,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::cases::support::{background_bound, expiry_bound, holder_id, within};
use crate::checker::ExclusionChecker;
use crate::context::{CaseError, CaseResult, TestContext};
use crate::{check, check_eq, ObservedLock};

const CANDIDATES: usize = 8;
const TERMS_EACH: usize = 4;
/// Crashes cost a TTL each: a few are enough.
const MAX_CRASHES: usize = 3;
/// How often observers read where the backend does not notify them.
const OBSERVER_POLL: Duration = Duration::from_millis(100);

/// A leader that stops renewing and never resigns: a crashed process.
fn crash(leadership: Leadership) {
    std::mem::forget(leadership);
}

/// Options of a leader that will crash: short TTL, nobody renews it.
fn crashing(ctx: &TestContext) -> LockOptions {
    LockOptions::new(ctx.short_ttl()).with_renewal(Renewal::Off)
}

/// The next answer of `watch`, failing the case if none comes in `bound`.
async fn next_seen(
    watch: &mut LeaderWatch,
    bound: Duration,
    what: &str,
) -> Result<Option<Leader>, CaseError> {
    Ok(within(bound, watch.changed(), what).await??)
}

/// 8 candidates on their own clients campaign 4 times each; each leader
/// runs the checker's section, then resigns, drops its leadership or
/// crashes (at most 3). No two leaders' sections overlap, terms grow,
/// and an observer following throughout reports terms in increasing
/// order, each with the identity of the candidate that led it.
pub async fn one_leader_at_a_time(ctx: TestContext) -> CaseResult {
    let key = ctx.key("election");
    let checker = ExclusionChecker::new();
    let terms: Arc<Mutex<HashMap<FencingToken, HolderId>>> = Arc::default();
    let crashes = Arc::new(AtomicUsize::new(0));
    let observer = ctx.locker().await?;
    let mut watch = observer.observe(&key).with_poll_interval(OBSERVER_POLL);
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let following = tokio::spawn(async move {
        let mut seen = Vec::new();
        loop {
            tokio::select! {
                _ = &mut stopped => return Ok::<_, CaseError>(seen),
                change = watch.changed() => seen.push(change?),
            }
        }
    });
    let mut tasks = Vec::new();
    for n in 0..CANDIDATES {
        let locker = ctx.locker().await?;
        let identity = holder_id(&format!("candidate-{n}"))?;
        let (key, checker, terms, crashes) =
            (key.clone(), checker.clone(), terms.clone(), crashes.clone());
        let steady = LockOptions::new(ctx.steady_ttl());
        let crash_options = crashing(&ctx);
        let bound = expiry_bound(ctx.steady_ttl()) * (CANDIDATES * TERMS_EACH) as u32;
        tasks.push(tokio::spawn(async move {
            for round in 0..TERMS_EACH {
                let fate = rand::random_range(0..4u8);
                let crashes_now = fate == 0 && crashes.fetch_add(1, Ordering::SeqCst) < MAX_CRASHES;
                let options = if crashes_now { &crash_options } else { &steady };
                let what = format!("candidate {n}, campaign {round}");
                let leading =
                    within(bound, locker.campaign(&key, &identity, options), &what).await??;
                let term = leading.term();
                terms
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(term, identity.clone());
                let mut section = checker.enter(&key, term);
                section.increment().await;
                // A section whose leadership was lost meanwhile is not the
                // leader's to record: its job would have been stopped.
                if !leading.is_lost() {
                    section.exit();
                }
                match fate {
                    _ if crashes_now => crash(leading),
                    1 => drop(leading),
                    _ => match leading.resign().await {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::NotHeld => {}
                        Err(e) => return Err(CaseError(format!("{what}: resign: {e}"))),
                    },
                }
            }
            Ok::<(), CaseError>(())
        }));
    }
    for task in tasks {
        task.await
            .map_err(|e| CaseError(format!("a candidate panicked: {e}")))??;
    }
    let report = checker.verify().map_err(CaseError)?;
    check_eq!(
        report.sections,
        report.counters[&key] as usize,
        "sections and counter"
    );
    // Let the observer see the last change, then stop it.
    let last_term = terms
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .max()
        .copied();
    tokio::time::sleep(OBSERVER_POLL * 3).await;
    let _ = stop.send(());
    let seen = following
        .await
        .map_err(|e| CaseError(format!("the observer panicked: {e}")))??;
    let terms = terms.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut newest: Option<FencingToken> = None;
    let mut leaders_seen = 0;
    for change in &seen {
        let Some(leader) = change else { continue };
        leaders_seen += 1;
        check!(
            newest.is_none_or(|t| leader.term > t),
            "the observer reported term {} after term {newest:?} (terms must only grow): {seen:?}",
            leader.term
        );
        newest = Some(leader.term);
        check_eq!(
            leader.identity.as_ref(),
            terms.get(&leader.term),
            "the identity the observer reported for term {}",
            leader.term
        );
    }
    check!(
        leaders_seen > 0,
        "the observer saw no leader among {} terms (last {last_term:?})",
        terms.len()
    );
    Ok(())
}

/// Step by step, an observer reports: vacant; a's leadership with a's
/// identity and term; vacant after a resigns; b's newer term; vacant once
/// b crashed and its TTL ran out. A late observer first reports the
/// present (vacant).
pub async fn observers_see_each_change(ctx: TestContext) -> CaseResult {
    let key = ctx.key("election");
    let (a, b, observer) = (
        ctx.locker().await?,
        ctx.locker().await?,
        ctx.locker().await?,
    );
    let (id_a, id_b) = (holder_id("observed-a")?, holder_id("observed-b")?);
    let mut watch = observer.observe(&key).with_poll_interval(OBSERVER_POLL);
    let bound = background_bound();
    check_eq!(
        next_seen(&mut watch, bound, "first answer").await?,
        None,
        "an unused election is vacant"
    );

    let leading = a
        .campaign(&key, &id_a, &LockOptions::new(ctx.long_ttl()))
        .await?;
    let seen = next_seen(&mut watch, bound, "a's leadership").await?;
    check_eq!(
        seen,
        Some(Leader {
            identity: Some(id_a.clone()),
            term: leading.term()
        }),
        "a leads"
    );
    let term_a = leading.term();
    leading.resign().await?;
    check_eq!(
        next_seen(&mut watch, bound, "a's resign").await?,
        None,
        "vacant after a resigned"
    );

    let leading = b.campaign(&key, &id_b, &crashing(&ctx)).await?;
    let term_b = leading.term();
    check!(
        term_b > term_a,
        "b's term {term_b} is newer than a's {term_a}"
    );
    let seen = next_seen(&mut watch, bound, "b's leadership").await?;
    check_eq!(
        seen,
        Some(Leader {
            identity: Some(id_b),
            term: term_b
        }),
        "b leads"
    );
    crash(leading);
    let expiry = expiry_bound(ctx.short_ttl()) + bound;
    check_eq!(
        next_seen(&mut watch, expiry, "b's crash").await?,
        None,
        "vacant once b's TTL ran out"
    );

    let mut late = observer.observe(&key);
    check_eq!(
        next_seen(&mut late, bound, "a late observer").await?,
        None,
        "a late observer's first answer"
    );
    Ok(())
}

/// An observer on a task of its own that never reads by the clock (a poll
/// interval of an hour), through a client that counts its reads: a change
/// made once its read after its last answer returned can only reach it by
/// the server's word.
struct Follower {
    reads: Arc<ObservedLock>,
    answers: mpsc::UnboundedReceiver<(Result<Option<Leader>, LockError>, u64)>,
    /// Reads done when it gave its last answer.
    reads_then: u64,
    task: JoinHandle<()>,
}

impl Follower {
    fn new(client: &LockClient, key: &LockKey) -> Self {
        let reads = Arc::new(ObservedLock::new(client.clone()));
        let mut watch = Locker::new(LockClient::new(reads.clone()))
            .observe(key)
            .with_poll_interval(Duration::from_secs(3600));
        let (tx, answers) = mpsc::unbounded_channel();
        let counted = reads.clone();
        let task = tokio::spawn(async move {
            loop {
                let answer = watch.changed().await;
                if tx.send((answer, counted.inspects())).is_err() {
                    return;
                }
            }
        });
        Self {
            reads,
            answers,
            reads_then: 0,
            task,
        }
    }

    /// Returns once the observer read again after its last answer and found
    /// nothing new: it now waits for a wake-up.
    async fn waiting(&self, bound: Duration, what: &str) -> Result<(), CaseError> {
        let read_again = async {
            while self.reads.inspects() <= self.reads_then {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        within(bound, read_again, what).await
    }

    async fn next(&mut self, bound: Duration, what: &str) -> Result<Option<Leader>, CaseError> {
        let (answer, reads) = within(bound, self.answers.recv(), what)
            .await?
            .ok_or_else(|| CaseError(format!("{what}: the observer's task ended")))?;
        self.reads_then = reads;
        Ok(answer?)
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Observers that never read by the clock (a poll interval of an hour,
/// and leaders on the long TTL, so no expiry falls inside the case) still
/// report each change: a's leadership, the vacancy after a resigns, b's
/// leadership, the vacancy after an operator force-releases b. Each change
/// is made only once both observers read and wait (see [`Follower`]). One
/// observer is on a client of its own, one on the client a campaigns with;
/// only the server's word can wake either.
pub async fn observers_woken_by_the_server(ctx: TestContext) -> CaseResult {
    let key = ctx.key("election");
    let (a, b, apart, operator) = (
        ctx.locker().await?,
        ctx.locker().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let mut followers = [Follower::new(&apart, &key), Follower::new(a.client(), &key)];
    let bound = background_bound();
    for follower in &mut followers {
        check_eq!(
            follower.next(bound, "first answer").await?,
            None,
            "an unused election is vacant"
        );
    }
    let parked = async |followers: &[Follower], before: &str| {
        for follower in followers {
            follower
                .waiting(
                    bound,
                    &format!("the observer reading again before {before}"),
                )
                .await?;
        }
        Ok::<_, CaseError>(())
    };
    let options = LockOptions::new(ctx.long_ttl());
    let (id_a, id_b) = (holder_id("woken-a")?, holder_id("woken-b")?);
    parked(&followers, "a campaigns").await?;
    let leading = a.campaign(&key, &id_a, &options).await?;
    let led_by_a = Some(Leader {
        identity: Some(id_a),
        term: leading.term(),
    });
    for follower in &mut followers {
        let seen = follower
            .next(bound, "a's leadership, woken by the server")
            .await?;
        check_eq!(seen, led_by_a, "a leads");
    }
    parked(&followers, "a resigns").await?;
    leading.resign().await?;
    for follower in &mut followers {
        let seen = follower
            .next(bound, "a's resign, woken by the server")
            .await?;
        check_eq!(seen, None, "vacant after a resigned");
    }
    parked(&followers, "b campaigns").await?;
    let leading = b.campaign(&key, &id_b, &options).await?;
    let led_by_b = Some(Leader {
        identity: Some(id_b),
        term: leading.term(),
    });
    for follower in &mut followers {
        let seen = follower
            .next(bound, "b's leadership, woken by the server")
            .await?;
        check_eq!(seen, led_by_b, "b leads");
    }
    parked(&followers, "the force release").await?;
    check!(
        operator.force_release(&key).await?,
        "b's leadership was there to force-release"
    );
    for follower in &mut followers {
        let seen = follower
            .next(bound, "the force release, woken by the server")
            .await?;
        check_eq!(seen, None, "vacant after the force release");
    }
    drop(leading);
    Ok(())
}

/// A standby candidate leads as soon as the leader resigns, also while an
/// observer follows (an observer never takes the standby's wake-up): the
/// leader holds for the long TTL, so expiry cannot be what handed over.
pub async fn resign_hands_over(ctx: TestContext) -> CaseResult {
    let key = ctx.key("election");
    let (a, b) = (ctx.locker().await?, ctx.locker().await?);
    let options = LockOptions::new(ctx.long_ttl());
    let leading = a.campaign(&key, &holder_id("resigning")?, &options).await?;
    let observer = ctx.locker().await?;
    let mut watch = observer.observe(&key).with_poll_interval(OBSERVER_POLL);
    let first = next_seen(
        &mut watch,
        background_bound(),
        "the observer's first answer",
    )
    .await?;
    check_eq!(
        first.map(|l| l.term),
        Some(leading.term()),
        "the observer sees the leader"
    );
    // Follows until `_stop_following` is dropped (also on an early return).
    let (_stop_following, mut stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                change = watch.changed() => if change.is_err() {
                    tokio::time::sleep(OBSERVER_POLL).await;
                },
            }
        }
    });
    let standby = {
        let (key, options, identity) = (key.clone(), options.clone(), holder_id("standby")?);
        tokio::spawn(async move { b.campaign(&key, &identity, &options).await })
    };
    // Give the standby time to campaign (if it has not, it still must
    // lead once it does: the key is free).
    tokio::time::sleep(Duration::from_millis(100)).await;
    check!(
        !standby.is_finished(),
        "the standby led while the leader held"
    );
    let term = leading.term();
    leading.resign().await?;
    let next = within(
        background_bound(),
        standby,
        "the standby's leadership after the resign",
    )
    .await?
    .map_err(|e| CaseError(format!("the standby panicked: {e}")))??;
    check!(
        next.term() > term,
        "the new term {} is newer than {term}",
        next.term()
    );
    next.resign().await?;
    Ok(())
}

/// A crashed leader (no renewal, no resign) is replaced once its TTL runs
/// out, by a candidate that was waiting, with a newer term.
pub async fn crash_hands_over_after_ttl(ctx: TestContext) -> CaseResult {
    let key = ctx.key("election");
    let (a, b) = (ctx.locker().await?, ctx.locker().await?);
    let leading = a
        .campaign(&key, &holder_id("crashing")?, &crashing(&ctx))
        .await?;
    let term = leading.term();
    crash(leading);
    let options = LockOptions::new(ctx.steady_ttl());
    let bound = expiry_bound(ctx.short_ttl()) + background_bound();
    let next = within(
        bound,
        b.campaign(&key, &holder_id("successor")?, &options),
        "the successor's leadership",
    )
    .await??;
    check!(
        next.term() > term,
        "the successor's term {} is newer than {term}",
        next.term()
    );
    check_eq!(
        b.leader(&key).await?,
        Some(Leader {
            identity: Some(holder_id("successor")?),
            term: next.term()
        }),
        "leader() names the successor"
    );
    next.resign().await?;
    Ok(())
}

/// `leader()` is `None` before anyone leads and after the leader resigns,
/// and names the leader between; a dropped leadership resigns; identities
/// that are empty, too long or hold control characters are refused.
pub async fn vacancy_reported(ctx: TestContext) -> CaseResult {
    let key = ctx.key("election");
    let (a, b) = (ctx.locker().await?, ctx.locker().await?);
    check_eq!(
        b.leader(&key).await?,
        None,
        "nobody leads an unused election"
    );
    let identity = holder_id("vacancy")?;
    let leading = a
        .campaign(&key, &identity, &LockOptions::new(ctx.long_ttl()))
        .await?;
    check_eq!(
        b.leader(&key).await?,
        Some(Leader {
            identity: Some(identity.clone()),
            term: leading.term()
        }),
        "leader() while a leads"
    );
    leading.resign().await?;
    check_eq!(b.leader(&key).await?, None, "nobody leads after the resign");
    // Dropping a leadership resigns (in the background).
    let leading = a
        .campaign(&key, &identity, &LockOptions::new(ctx.long_ttl()))
        .await?;
    drop(leading);
    let vacant = async {
        while b.leader(&key).await?.is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok::<_, CaseError>(())
    };
    within(
        background_bound(),
        vacant,
        "vacancy after a dropped leadership",
    )
    .await??;
    for bad in [
        "".to_owned(),
        "x".repeat(MAX_HOLDER_BYTES + 1),
        "line\nbreak".into(),
    ] {
        match HolderId::new(&bad) {
            Err(e) => check!(
                e.kind() == ErrorKind::InvalidInput,
                "the error for identity {bad:?}: {e}"
            ),
            Ok(_) => return Err(CaseError(format!("identity {bad:?} was accepted"))),
        }
    }
    Ok(())
}
