//! `admin::` — the operator calls `inspect` and `force_release`, for
//! backends whose `LockBackend::admin` returns a `LockAdmin`.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockOptions, LockState, Locker};

use crate::cases::support::{
    acquire, background_bound, eventually_acquire, expiry_bound, lock_free_key, until_attempts,
    within,
};
use crate::context::{CaseResult, TestContext};
use crate::{check, check_eq, ObservedLock};

/// `inspect` reports free, then the holder's fencing token, then free again,
/// and changes nothing.
pub async fn inspect_reports_holder(ctx: TestContext) -> CaseResult {
    let lock = ctx.client().await?;
    let observer = ctx.client().await?;
    let key = ctx.key("admin");
    check_eq!(
        observer.inspect(&key).await?,
        LockState::Free,
        "a never-used key"
    );
    let lease = acquire(&lock, &key, ctx.long_ttl(), "first acquire").await?;
    match observer.inspect(&key).await? {
        LockState::Held {
            fencing_token,
            expires_in,
            ..
        } => {
            check_eq!(
                fencing_token,
                lease.fencing_token(),
                "inspect shows the holder's fencing token"
            );
            if let Some(left) = expires_in {
                check!(
                    left <= lease.ttl() + Duration::from_secs(1),
                    "time left {left:?} is within the lease's TTL {:?}",
                    lease.ttl()
                );
            }
        }
        LockState::Free => return Err("inspect says free while the key is held".into()),
    }
    // Inspecting did not take or change the lock: its holder still owns it.
    lock.extend(&lease, ctx.long_ttl()).await?;
    lock.release(&lease).await?;
    check_eq!(
        observer.inspect(&key).await?,
        LockState::Free,
        "after release"
    );
    Ok(())
}

/// `force_release` frees a held key (an operator clearing a stuck lock):
/// the next holder gets a greater fencing token, the old holder's guard
/// learns it lost the lock, and a free key reports `false`.
pub async fn force_release_frees_key(ctx: TestContext) -> CaseResult {
    let holder = ctx.locker().await?;
    let operator = ctx.client().await?;
    let next = ctx.client().await?;
    let key = ctx.key("admin");
    let ttl = ctx.short_ttl();
    let options = LockOptions::new(ttl);
    let guard = lock_free_key(&holder, &key, &options).await?;
    check!(
        operator.force_release(&key).await?,
        "force_release of a held key reports it was held"
    );
    let lease = eventually_acquire(
        &next,
        &key,
        ctx.long_ttl(),
        background_bound(),
        "acquire after force release",
    )
    .await?;
    check!(
        lease.fencing_token() > guard.fencing_token(),
        "fencing grows across a force release"
    );
    let lost = within(
        expiry_bound(ttl),
        guard.lost(),
        "the old holder's lost signal",
    )
    .await?;
    check!(
        guard.is_lost(),
        "the old holder's guard knows it lost the lock ({lost})"
    );
    next.release(&lease).await?;
    check!(
        !operator.force_release(&key).await?,
        "force_release of a free key reports false"
    );
    Ok(())
}

/// A waiter is woken by a force release as by a release.
pub async fn force_release_wakes_waiter(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let operator = ctx.client().await?;
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let waiter = Locker::new(observed.clone());
    let key = ctx.key("admin");
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let options = LockOptions::new(ctx.long_ttl()).with_wait(ctx.long_ttl());
    let waiting = tokio::spawn({
        let key = key.clone();
        async move { waiter.acquire(&key, &options).await }
    });
    until_attempts(&observed, 1, "the waiter").await?;
    check!(
        operator.force_release(&key).await?,
        "force release of the held key"
    );
    let guard = within(
        background_bound(),
        waiting,
        "the waiter after a force release",
    )
    .await?
    .map_err(|e| format!("waiter task failed: {e}"))??
    .ok_or("the waiter gave up although the key was force-released")?;
    check!(
        guard.fencing_token() > lease.fencing_token(),
        "the waiter's token is greater"
    );
    guard.release().await?;
    Ok(())
}
