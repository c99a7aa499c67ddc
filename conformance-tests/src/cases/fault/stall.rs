//! `fault::stalled_server_waiters_recover`: the server frozen (SIGSTOP,
//! or a black hole on the simulated network) while holders hold and
//! waiters wait.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{LockClient, LockOptions, Locker, LostReason};

use super::{fault_ttl, join, measure, ErrorTally, EXPIRY_SLACK};
use crate::cases::support::{background_bound, within};
use crate::checker::ExclusionChecker;
use crate::context::{CaseError, CaseResult, TestContext};
use crate::{check, check_eq};

/// How a case freezes "the server": SIGSTOP on a dedicated server process,
/// or a black hole on the simulated network every client shares.
enum Stall {
    Process(Arc<crate::server::ServerProcess>, String),
    Network(crate::fault::FaultPath),
}

impl Stall {
    async fn new(ctx: &TestContext) -> Result<Stall, CaseError> {
        if ctx.controls_servers() {
            let server = ctx.start_server().await?;
            let url = ctx.fault_url(server.addr())?;
            Ok(Stall::Process(server, url))
        } else {
            Ok(Stall::Network(ctx.fault_path().await?))
        }
    }

    async fn client(&self, ctx: &TestContext) -> Result<LockClient, CaseError> {
        match self {
            Stall::Process(_, url) => ctx.client_at(url).await,
            Stall::Network(path) => ctx.client_through(path).await,
        }
    }

    /// Freezes (`true`) or thaws (`false`) the server.
    async fn set_frozen(&self, frozen: bool) -> Result<(), CaseError> {
        match self {
            Stall::Process(server, _) => {
                let server = server.clone();
                tokio::task::spawn_blocking(move || {
                    if frozen {
                        server.pause()
                    } else {
                        server.resume()
                    }
                })
                .await
                .map_err(|e| format!("pause/resume panicked: {e}"))?
                .map_err(|e| CaseError(format!("cannot SIGSTOP/SIGCONT the server: {e}")))
            }
            Stall::Network(path) if frozen => {
                path.black_hole();
                Ok(())
            }
            Stall::Network(path) => {
                path.heal();
                Ok(())
            }
        }
    }
}

/// The server stalls (SIGSTOP on a dedicated server; a black hole for an
/// in-process backend) while two holders hold and four waiters wait (each
/// seen blocked first: its attempt was counted). One holder has a long TTL
/// and keeps its lock through the stall; the other's TTL is shorter than
/// the stall, so its guard's `lost()` fires while the server is frozen.
/// After the server resumes, the long holder releases: its waiters must be
/// woken by that release, i.e. granted the lock before the holder's first
/// lease could have run out (its `valid_until`), not by a timer; the short
/// holder's waiters get its lock once the server expired it. Every waiter
/// gets its lock, and the checker sees no overlap (a holder's section ends
/// when its `lost()` fires).
pub async fn stalled_server_waiters_recover(ctx: TestContext) -> CaseResult {
    let stall = Stall::new(&ctx).await?;
    let long_ttl = fault_ttl(&ctx, Duration::from_secs(20))?;
    let short_ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let keep = ctx.key("fault-stall-keep");
    let lose = ctx.key("fault-stall-lose");
    let checker = ExclusionChecker::new();
    let errors = Arc::new(ErrorTally::default());
    let keeper = Locker::new(stall.client(&ctx).await?)
        .try_lock(&keep, &LockOptions::new(long_ttl))
        .await?
        .ok_or("the key should be free")?;
    let keeper_first_deadline = keeper.lease().valid_until();
    let loser = Locker::new(stall.client(&ctx).await?)
        .try_lock(&lose, &LockOptions::new(short_ttl))
        .await?
        .ok_or("the key should be free")?;
    let keeper_section = checker.enter(&keep, keeper.fencing_token());
    let loser_section = {
        let (checker, lose, lost) = (checker.clone(), lose.clone(), loser.lost());
        let token = loser.fencing_token();
        tokio::spawn(async move {
            let section = checker.enter(&lose, token);
            let reason = lost.await;
            section.exit();
            reason
        })
    };
    let mut waiters = Vec::new();
    let mut observed = Vec::new();
    for key in [&keep, &keep, &lose, &lose] {
        let client = Arc::new(crate::ObservedLock::new(stall.client(&ctx).await?));
        observed.push(client.clone());
        let locker = Locker::new(client);
        let (key, checker, errors) = (key.clone(), checker.clone(), errors.clone());
        waiters.push(tokio::spawn(async move {
            let give_up = Instant::now() + Duration::from_secs(90);
            loop {
                let wait = give_up.saturating_duration_since(Instant::now());
                match locker
                    .acquire(&key, &LockOptions::new(short_ttl).with_wait(wait))
                    .await
                {
                    Ok(Some(guard)) => {
                        let granted_at = Instant::now();
                        let mut section = checker.enter(&key, guard.fencing_token());
                        section.increment().await;
                        section.exit();
                        if let Err(e) = guard.release().await {
                            errors.record("waiter release", e)?;
                        }
                        return Ok::<_, CaseError>(granted_at);
                    }
                    Ok(None) => {
                        return Err(CaseError(format!(
                            "a waiter for {key} never got the lock after the stall"
                        )))
                    }
                    // The waiting loop gives up on a timeout with the
                    // server frozen; wait again.
                    Err(e) => errors.record("waiter acquire", e)?,
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }
    for (i, client) in observed.iter().enumerate() {
        crate::cases::support::until_attempts(client, 1, &format!("waiter {i}")).await?;
    }
    stall.set_frozen(true).await?;
    let frozen_at = Instant::now();
    let lost = within(
        short_ttl + EXPIRY_SLACK,
        loser.lost(),
        "the short holder's lost() with the server frozen",
    )
    .await;
    // Let the frozen server's clock run past the short lock's expiry.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stall.set_frozen(false).await?;
    let frozen_for = frozen_at.elapsed();
    check_eq!(
        lost?,
        LostReason::Expired,
        "why the short holder lost its lock"
    );
    check!(
        !keeper.is_lost(),
        "the long holder (TTL {long_ttl:?}) lost its lock in a stall of {frozen_for:?}"
    );
    keeper_section.exit();
    keeper.release().await?;
    let mut granted = Vec::new();
    for waiter in waiters {
        granted.push(join(waiter, Duration::from_secs(120), "a waiter").await?);
    }
    within(
        background_bound(),
        loser_section,
        "the short holder's section",
    )
    .await?
    .map_err(|e| format!("the short holder's section panicked: {e}"))?;
    for (i, at) in granted[..2].iter().enumerate() {
        check!(
            *at < keeper_first_deadline,
            "waiter {i} of the long holder's key got it only {:?} after the holder's first lease ran out: it was not woken by the release after the stall",
            at.saturating_duration_since(keeper_first_deadline)
        );
    }
    let report = checker.verify()?;
    check_eq!(report.sections, 6, "sections: 2 holders and 4 waiters");
    measure(
        &ctx,
        "stalled_server_waiters_recover",
        format_args!(
            "frozen {frozen_for:?}; errors meanwhile {}",
            errors.summary()
        ),
    );
    drop(loser);
    Ok(())
}
