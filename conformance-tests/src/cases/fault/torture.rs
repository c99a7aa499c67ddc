//! `fault::` cases that pile faults up under contention: waiting futures
//! dropped at random points, and the exclusion and permit tortures mixing
//! every fault the harness can inject.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{LockClient, LockError, LockGuard, LockKey, LockOptions, Locker};

use super::{fault_ttl, join, measure, ErrorTally, EXPIRY_SLACK};
use crate::cases::semaphore::every_permit_within;
use crate::cases::support::{background_bound, every_key_free_within, within};
use crate::checker::{ExclusionChecker, SectionHandle};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::FaultPath;
use crate::server::ServerProcess;
use crate::{check, check_eq};

/// The environment variable setting the torture run's length in seconds.
pub const TORTURE_SECS_ENV: &str = "DISTLOCK_TORTURE_SECS";

/// The torture run's length when [`TORTURE_SECS_ENV`] is not set.
pub const DEFAULT_TORTURE_SECS: u64 = 30;

/// Waiting futures are dropped at random points under contention, hundreds
/// of times: afterwards, once every client's background work is done
/// ([`LockClient::idle`]: the waits' leaves, the releases of what they were
/// granted), nothing is held and nobody is in line: a fresh client's single
/// attempt takes the key. (A waiter left in a server's line after its wait
/// ended holds up every later handoff: a fair line waits out its turn.)
pub async fn dropped_waiters_leave_nothing_held(ctx: TestContext) -> CaseResult {
    const ROUNDS: usize = 40;
    const WAITERS: usize = 8;
    let key = ctx.key("fault-cancel");
    let holder = ctx.locker().await?;
    let lockers: Vec<Locker> = crate::cases::support::clients(&ctx, WAITERS)
        .await?
        .into_iter()
        .map(Locker::new)
        .collect();
    let dropped = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let holder_options = LockOptions::new(ctx.long_ttl()).with_wait(background_bound());
    for round in 0..ROUNDS {
        let guard = holder
            .acquire(&key, &holder_options)
            .await?
            .ok_or_else(|| {
                format!("round {round}: the key stayed held (a dropped waiter leaked it?)")
            })?;
        let mut tasks = Vec::new();
        for locker in &lockers {
            let (locker, key) = (locker.clone(), key.clone());
            let (dropped, granted) = (dropped.clone(), granted.clone());
            let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(60));
            let drop_after = Duration::from_millis(rand::random_range(0..60));
            tasks.push(tokio::spawn(async move {
                let result = tokio::select! {
                    result = locker.acquire(&key, &options) => result,
                    _ = tokio::time::sleep(drop_after) => {
                        dropped.fetch_add(1, Ordering::SeqCst);
                        return Ok(());
                    }
                };
                if let Some(guard) = result? {
                    granted.fetch_add(1, Ordering::SeqCst);
                    if rand::random_bool(0.5) {
                        guard.release().await?;
                    } // else dropped: released in the background
                }
                Ok::<_, LockError>(())
            }));
        }
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..60))).await;
        if rand::random_bool(0.5) {
            guard.release().await?;
        } else {
            drop(guard);
        }
        for task in tasks {
            within(Duration::from_secs(90), task, "waiter task")
                .await?
                .map_err(|e| format!("waiter task panicked: {e}"))??;
        }
    }
    let started = Instant::now();
    for locker in lockers.iter().chain([&holder]) {
        within(
            background_bound(),
            locker.client().idle(),
            "a client's background work",
        )
        .await?;
    }
    let idle_after = started.elapsed();
    let fresh = ctx.client().await?;
    let lease = fresh
        .try_acquire(&key, ctx.long_ttl())
        .await?
        .lease()
        .ok_or_else(|| {
            "a fresh client's attempt was refused once every waiter's client was idle: \
             a wait that ended left its place in line (or a lock held)"
                .to_owned()
        })?;
    fresh.release(&lease).await?;
    let dropped = dropped.load(Ordering::SeqCst);
    check!(
        dropped > 0,
        "no waiting future was dropped; the case tested nothing"
    );
    measure(
        &ctx,
        "dropped_waiters_leave_nothing_held",
        format_args!(
            "{} waiting futures: {dropped} dropped, {} granted; clients idle after {idle_after:?}",
            ROUNDS * WAITERS,
            granted.load(Ordering::SeqCst)
        ),
    );
    Ok(())
}

/// Counts of what the torture did.
#[derive(Debug, Default)]
struct TortureStats {
    sections: AtomicU64,
    lost: AtomicU64,
    gave_up: AtomicU64,
    cancelled: AtomicU64,
    resets: AtomicU64,
    black_holes: AtomicU64,
    restarts: AtomicU64,
}

/// The torture run's length: `DISTLOCK_TORTURE_SECS`, or the default.
fn torture_secs() -> Result<u64, CaseError> {
    match std::env::var(TORTURE_SECS_ENV) {
        Ok(v) => v.trim().parse::<u64>().map_err(|e| {
            CaseError(format!(
                "{TORTURE_SECS_ENV}={v:?} is not a number of seconds: {e}"
            ))
        }),
        Err(_) => Ok(DEFAULT_TORTURE_SECS),
    }
}

/// What a torture run shares between its workers and its fault injector:
/// one client per worker, each behind its own fault path where faults can
/// be injected (the harness's own server, restarted only if durable, or
/// the simulated network), and which workers hold right now.
struct Torture {
    secs: u64,
    ttl: Duration,
    end: Instant,
    server: Option<Arc<ServerProcess>>,
    restarts_allowed: bool,
    proxies: Vec<Arc<FaultPath>>,
    stats: Arc<TortureStats>,
    errors: Arc<ErrorTally>,
    // Partitions aim at holders half the time, so guards really lose
    // their locks mid-section.
    holding: Arc<Vec<AtomicBool>>,
}

/// One worker's end of a [`Torture`].
#[derive(Clone)]
struct Worker {
    index: usize,
    ttl: Duration,
    end: Instant,
    stats: Arc<TortureStats>,
    errors: Arc<ErrorTally>,
    holding: Arc<Vec<AtomicBool>>,
}

impl Torture {
    /// Starts the server (if the harness runs them) and opens `clients`
    /// lockers; the run lasts `DISTLOCK_TORTURE_SECS` from here.
    async fn start(ctx: &TestContext, clients: usize) -> Result<(Self, Vec<Locker>), CaseError> {
        let secs = torture_secs()?;
        let ttl = fault_ttl(ctx, Duration::from_secs(2))?;
        let server = if ctx.controls_servers() {
            Some(ctx.start_server().await?)
        } else {
            None
        };
        let restarts_allowed = server.is_some() && ctx.capabilities().durable;
        let mut proxies: Vec<Arc<FaultPath>> = Vec::new();
        let mut lockers = Vec::new();
        for _ in 0..clients {
            let client: LockClient = match &server {
                Some(server) => {
                    let (proxy, client) = ctx.client_via_proxy(server.addr()).await?;
                    proxies.push(Arc::new(FaultPath::Proxy(proxy)));
                    client
                }
                None if ctx.can_inject_faults() => {
                    let path = ctx.fault_path().await?;
                    let client = ctx.client_through(&path).await?;
                    proxies.push(Arc::new(path));
                    client
                }
                None => ctx.client().await?,
            };
            lockers.push(Locker::new(client));
        }
        let torture = Self {
            secs,
            ttl,
            end: Instant::now() + Duration::from_secs(secs),
            server,
            restarts_allowed,
            proxies,
            stats: Arc::new(TortureStats::default()),
            errors: Arc::new(ErrorTally::default()),
            holding: Arc::new((0..clients).map(|_| AtomicBool::new(false)).collect()),
        };
        Ok((torture, lockers))
    }

    fn worker(&self, index: usize) -> Worker {
        Worker {
            index,
            ttl: self.ttl,
            end: self.end,
            stats: self.stats.clone(),
            errors: self.errors.clone(),
            holding: self.holding.clone(),
        }
    }

    /// Injects faults until shortly before the end: connection resets,
    /// black holes (those aimed at a holder outlast its lease) and, where
    /// allowed, server restarts.
    fn spawn_injector(&self, ctx: &TestContext) -> tokio::task::JoinHandle<Result<(), CaseError>> {
        let (proxies, stats, ctx, server, holding) = (
            self.proxies.clone(),
            self.stats.clone(),
            ctx.clone(),
            self.server.clone(),
            self.holding.clone(),
        );
        let (ttl, end, restarts_allowed) = (self.ttl, self.end, self.restarts_allowed);
        tokio::spawn(async move {
            if proxies.is_empty() {
                return Ok(());
            }
            let mut partitions = Vec::new();
            while Instant::now() + Duration::from_secs(2) < end {
                tokio::time::sleep(Duration::from_millis(rand::random_range(50..400))).await;
                let holders: Vec<usize> = (0..proxies.len())
                    .filter(|&i| holding[i].load(Ordering::SeqCst))
                    .collect();
                let aim_at_holder = !holders.is_empty() && rand::random_bool(0.5);
                let target = if aim_at_holder {
                    holders[rand::random_range(0..holders.len())]
                } else {
                    rand::random_range(0..proxies.len())
                };
                let proxy = proxies[target].clone();
                let roll = rand::random_range(0..100);
                if roll < 45 {
                    proxy.drop_all();
                    stats.resets.fetch_add(1, Ordering::SeqCst);
                } else if roll < 90 || !restarts_allowed {
                    // A partition aimed at a holder outlasts its lease (its guard
                    // must lose the lock); others are random, sometimes
                    // shorter than a renewal period.
                    let ttl_ms = ttl.as_millis() as u64;
                    let length = Duration::from_millis(if aim_at_holder {
                        rand::random_range(ttl_ms..ttl_ms * 5 / 2)
                    } else {
                        rand::random_range(100..ttl_ms * 2)
                    });
                    stats.black_holes.fetch_add(1, Ordering::SeqCst);
                    proxy.black_hole();
                    partitions.push(tokio::spawn(async move {
                        tokio::time::sleep(length).await;
                        if rand::random_bool(0.5) {
                            proxy.drop_all();
                        }
                        proxy.heal();
                    }));
                } else if let Some(server) = &server {
                    ctx.restart_server(server).await?;
                    stats.restarts.fetch_add(1, Ordering::SeqCst);
                }
            }
            for partition in partitions {
                let _ = partition.await;
            }
            Ok::<_, CaseError>(())
        })
    }

    /// Runs one worker per locker until the end, beside the fault
    /// injector: each waits for the key `pick` names, with its options,
    /// and holds what it gets through a section of `checker` (incrementing
    /// its counter if `increment`). Then heals every path and waits for
    /// them all.
    async fn run(
        &self,
        ctx: &TestContext,
        lockers: Vec<Locker>,
        checker: &Arc<ExclusionChecker>,
        increment: bool,
        pick: impl Fn() -> (LockKey, LockOptions) + Clone + Send + 'static,
    ) -> CaseResult {
        let mut workers = Vec::new();
        for (index, locker) in lockers.into_iter().enumerate() {
            let (checker, worker, pick) = (checker.clone(), self.worker(index), pick.clone());
            workers.push(tokio::spawn(async move {
                while worker.running() {
                    let (key, options) = pick();
                    let Some(guard) = worker.acquire(&locker, &key, options).await? else {
                        continue;
                    };
                    let section = checker.enter(&key, guard.fencing_token());
                    worker.hold(guard, section, increment).await?;
                }
                Ok(())
            }));
        }
        let injector = self.spawn_injector(ctx);
        let bound = Duration::from_secs(self.secs + 60);
        join(injector, bound, "the fault injector").await?;
        for proxy in &self.proxies {
            proxy.heal();
        }
        for worker in workers {
            join(worker, bound, "a torture worker").await?;
        }
        Ok(())
    }

    /// A client with no faults in its way, to check nothing stays held.
    async fn fresh_client(&self, ctx: &TestContext) -> Result<LockClient, CaseError> {
        match &self.server {
            Some(server) => ctx.client_at(&ctx.fault_url(server.addr())?).await,
            None => ctx.client().await,
        }
    }

    /// The measured line's tail: what the workers and the injector did.
    fn summary(&self) -> String {
        let stats = &self.stats;
        format!(
            "{} ended by lost(), {} waits gave up, {} waits dropped; faults: {} resets, {} black holes, {} restarts; errors {}",
            stats.lost.load(Ordering::SeqCst),
            stats.gave_up.load(Ordering::SeqCst),
            stats.cancelled.load(Ordering::SeqCst),
            stats.resets.load(Ordering::SeqCst),
            stats.black_holes.load(Ordering::SeqCst),
            stats.restarts.load(Ordering::SeqCst),
            self.errors.summary()
        )
    }
}

impl Worker {
    fn running(&self) -> bool {
        Instant::now() < self.end
    }

    /// One wait of up to 1.5 s for `key` (15% of them dropped at a random
    /// point): the guard, or `None` if the wait gave up, was dropped or
    /// failed with a fault.
    async fn acquire(
        &self,
        locker: &Locker,
        key: &LockKey,
        options: LockOptions,
    ) -> Result<Option<LockGuard>, CaseError> {
        let options = options.with_wait(Duration::from_millis(rand::random_range(0..1500)));
        let attempt = locker.acquire(key, &options);
        let result = if rand::random_bool(0.15) {
            let drop_after = Duration::from_millis(rand::random_range(0..200));
            tokio::select! {
                result = attempt => result,
                _ = tokio::time::sleep(drop_after) => {
                    self.stats.cancelled.fetch_add(1, Ordering::SeqCst);
                    return Ok(None);
                }
            }
        } else {
            attempt.await
        };
        match result {
            Ok(Some(guard)) => Ok(Some(guard)),
            Ok(None) => {
                self.stats.gave_up.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
            Err(e) => {
                self.errors.record("acquire", e)?;
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(None)
            }
        }
    }

    /// Holds `guard` through a checker section: runs `work`, then holds
    /// mostly briefly, sometimes past the TTL (renewal must work); the
    /// section ends as soon as `lost()` fires. Then releases or drops the
    /// guard.
    async fn hold(
        &self,
        guard: LockGuard,
        mut section: SectionHandle<'_>,
        increment: bool,
    ) -> CaseResult {
        self.holding[self.index].store(true, Ordering::SeqCst);
        let lost = guard.lost();
        let hold = if rand::random_bool(0.3) {
            Duration::from_millis(rand::random_range(400..(self.ttl.as_millis() as u64 * 2)))
        } else {
            Duration::from_millis(rand::random_range(0..400))
        };
        tokio::select! {
            biased;
            _ = lost => { self.stats.lost.fetch_add(1, Ordering::SeqCst); }
            _ = async {
                if increment {
                    section.increment().await;
                }
                tokio::time::sleep(hold).await;
            } => {}
        }
        // By the stop moment at the latest: a task starved past it records
        // its exit late, but its job was told to stop then.
        section.exit_by(guard.stop_moment());
        self.holding[self.index].store(false, Ordering::SeqCst);
        self.stats.sections.fetch_add(1, Ordering::SeqCst);
        if rand::random_bool(0.7) {
            if let Err(e) = guard.release().await {
                self.errors.record("release", e)?;
            }
        } else {
            drop(guard);
        }
        Ok(())
    }
}

/// Exclusion torture: 16 clients contend for 4 keys for
/// `DISTLOCK_TORTURE_SECS` seconds (default 30), each critical section
/// ended as soon as its guard's `lost()` fires, while faults are injected
/// throughout: waiting futures dropped at random, guards released or
/// dropped, and, where faults can be injected, each client behind its own
/// proxy (or simulated link) with random connection resets and black holes
/// (some longer than the TTL, so guards lose their locks) and, on durable
/// backends the harness runs, server restarts. The checker then proves no overlap, no lost increment
/// of the guarded counter, and fencing tokens growing in the order the
/// sections ran.
///
/// No restarts on a backend that is not durable (Redis without
/// persistence): a restart there loses every lock and resets the fencing
/// counter, which legitimately lets two holders overlap (a guard only
/// learns at its next renewal) with tokens going backwards — the documented
/// limit that fencing at the resource, with a durable token source, exists
/// for. `fault::server_restart_with_holders_and_waiters` covers restarts
/// there with an outage longer than the TTL.
pub async fn exclusion_torture(ctx: TestContext) -> CaseResult {
    const CLIENTS: usize = 16;
    const KEYS: usize = 4;
    let (torture, lockers) = Torture::start(&ctx, CLIENTS).await?;
    let ttl = torture.ttl;
    let keys: Arc<Vec<LockKey>> = Arc::new((0..KEYS).map(|_| ctx.key("fault-torture")).collect());
    let checker = ExclusionChecker::new();
    let pick = {
        let keys = keys.clone();
        move || {
            (
                keys[rand::random_range(0..keys.len())].clone(),
                LockOptions::new(ttl),
            )
        }
    };
    torture.run(&ctx, lockers, &checker, true, pick).await?;
    let report = checker.verify()?;
    check!(report.sections > 0, "no critical section ran at all");
    // Nothing stays held for good after the faults.
    let fresh = torture.fresh_client(&ctx).await?;
    every_key_free_within(
        &fresh,
        &keys,
        ttl,
        ttl + EXPIRY_SLACK,
        "a fresh client after the torture",
    )
    .await?;
    let per_key: Vec<usize> = keys
        .iter()
        .map(|k| report.sections_per_key.get(k).copied().unwrap_or(0))
        .collect();
    measure(
        &ctx,
        "exclusion_torture",
        format_args!(
            "{} s, TTL {ttl:?}: {} sections {per_key:?} per key, {}",
            torture.secs,
            report.sections,
            torture.summary()
        ),
    );
    Ok(())
}

/// Permit torture: 12 clients take permits of one semaphore of 3 through
/// renewing guards for `DISTLOCK_TORTURE_SECS` seconds, under the faults of
/// [`exclusion_torture`] (resets, black holes longer than the TTL aimed at
/// holders, restarts of a durable server, dropped waits, dropped guards).
/// A section ends as soon as its guard's `lost()` fires; the checker then
/// proves that never more than 3 holders believed they held a permit at
/// once, each under a token of its own, and that the limit was reached.
/// Afterwards a fresh client takes all 3 permits within the TTL plus
/// slack: no permit stays held for good.
pub async fn permit_torture(ctx: TestContext) -> CaseResult {
    const CLIENTS: usize = 12;
    const LIMIT: u32 = 3;
    let (torture, lockers) = Torture::start(&ctx, CLIENTS).await?;
    let ttl = torture.ttl;
    let key = ctx.key("fault-permits");
    let checker = ExclusionChecker::new();
    let pick = {
        let key = key.clone();
        move || (key.clone(), LockOptions::new(ttl).with_permits(LIMIT))
    };
    torture.run(&ctx, lockers, &checker, false, pick).await?;
    let report = checker.verify_at_most(LIMIT as usize)?;
    let most = report.most_at_once.get(&key).copied().unwrap_or(0);
    check_eq!(
        most,
        LIMIT as usize,
        "the most permit holders at once (limit {LIMIT}, {} sections)",
        report.sections
    );
    // Every permit comes back after the faults.
    let fresh = torture.fresh_client(&ctx).await?;
    every_permit_within(
        &fresh,
        &key,
        LIMIT,
        ttl,
        ttl + EXPIRY_SLACK,
        "after the torture: a permit stayed held",
    )
    .await?;
    measure(
        &ctx,
        "permit_torture",
        format_args!(
            "{} s, TTL {ttl:?}, limit {LIMIT}: {} sections, {}",
            torture.secs,
            report.sections,
            torture.summary()
        ),
    );
    Ok(())
}
