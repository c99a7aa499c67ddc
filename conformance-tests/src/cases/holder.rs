//! `holder::` — a holder's label ([`HolderId`]) is stored with its lock and
//! shown by `inspect` to others, only for the acquisition that holds the
//! lock now (never a label left by an earlier holder), and is never proof
//! of ownership: only the owner token is. For backends that declare
//! `Capabilities::holder_ids`.

use distlock_core::{
    AcquireReply, AcquireRequest, HeldLock, HolderId, LockClient, LockKey, LockOptions, LockState,
    OwnerToken, ReleaseReply, Renewal,
};

use crate::cases::support::{acquire, expiry_bound, holder_id, lock_free_key, within};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::{check, check_eq};

/// The label `inspect` shows for `key`, failing the case if the key is free.
async fn shown(
    observer: &LockClient,
    key: &LockKey,
    what: &str,
) -> Result<Option<HolderId>, CaseError> {
    match observer.inspect(key).await? {
        LockState::Held { holder, .. } => Ok(holder),
        LockState::Free => Err(CaseError(format!(
            "{what}: inspect says free while the key is held"
        ))),
    }
}

/// A label is shown while its lock is held, and only then: after a
/// release, a force-release and an expiry, the next holder's label (or
/// none) is shown, never the earlier one. Multi-byte and longest labels
/// round-trip unchanged.
pub async fn label_round_trips(ctx: TestContext) -> CaseResult {
    let (first, second) = (ctx.locker().await?, ctx.locker().await?);
    let observer = ctx.client().await?;
    let key = ctx.key("holder");
    let ttl = ctx.long_ttl();
    let labelled = |label: &HolderId| LockOptions::new(ttl).with_holder(label.clone());
    let a = holder_id("worker-a:101 é/ü")?;
    let longest = holder_id(&"é".repeat(distlock_core::MAX_HOLDER_BYTES / 2))?;

    let guard = lock_free_key(&first, &key, &labelled(&a)).await?;
    check_eq!(
        shown(&observer, &key, "held by a").await?,
        Some(a.clone()),
        "the holder's label"
    );
    guard.release().await?;
    check_eq!(
        observer.inspect(&key).await?,
        LockState::Free,
        "after release"
    );

    // Released, then taken without a label: no label, not the old one.
    let guard = lock_free_key(&second, &key, &LockOptions::new(ttl)).await?;
    check_eq!(
        shown(&observer, &key, "taken without a label").await?,
        None,
        "a holder without a label after a's release"
    );
    guard.release().await?;

    // Force-released, then taken with another label.
    let guard = lock_free_key(&first, &key, &labelled(&a)).await?;
    check!(
        observer.force_release(&key).await?,
        "force_release of a held key reports it was held"
    );
    let next = lock_free_key(&second, &key, &labelled(&longest)).await?;
    check_eq!(
        shown(&observer, &key, "after a force-release").await?,
        Some(longest.clone()),
        "the new holder's label, unchanged (longest, multi-byte)"
    );
    next.release().await?;
    drop(guard);

    // Expired (nobody renews it), then taken without a label.
    let short = ctx.short_ttl();
    let expiring = LockOptions::new(short)
        .with_renewal(Renewal::Off)
        .with_holder(a.clone());
    let stale = lock_free_key(&first, &key, &expiring).await?;
    let free = async {
        loop {
            if observer.inspect(&key).await? == LockState::Free {
                return Ok::<_, CaseError>(());
            }
            tokio::time::sleep(short / 4).await;
        }
    };
    within(expiry_bound(short), free, "the unrenewed lock's expiry").await??;
    let lease = acquire(&observer, &key, ttl, "after expiry").await?;
    check_eq!(
        shown(&observer, &key, "after expiry").await?,
        None,
        "a holder without a label after a's lock expired"
    );
    observer.release(&lease).await?;
    drop(stale);
    Ok(())
}

/// An attempt whose reply was lost and is made again (adoption) keeps the
/// label; a label equal to the holder's proves nothing: another owner
/// token with the same label is refused the lock, its release and its
/// extension.
pub async fn label_is_not_ownership(ctx: TestContext) -> CaseResult {
    let (holder, impostor) = (ctx.client().await?, ctx.client().await?);
    let key = ctx.key("holder");
    let ttl = ctx.capabilities().effective_ttl(ctx.long_ttl())?;
    let label = holder_id("same-label:1")?;
    let owner = OwnerToken::random();
    let request = |owner| AcquireRequest {
        key: &key,
        owner,
        ttl,
        renewing: false,
        settling: false,
        holder: Some(&label),
    };
    let granted = match holder.backend().acquire(request(owner)).await? {
        AcquireReply::Granted(grant) => grant,
        other => return Err(CaseError(format!("a free key: {other:?}"))),
    };
    // The same owner again (its first reply lost): adopted, label kept.
    match holder.backend().acquire(request(owner)).await? {
        AcquireReply::Granted(again) => {
            check_eq!(again.fencing, granted.fencing, "adoption keeps the token");
        }
        other => {
            return Err(CaseError(format!(
                "the same owner's second attempt: {other:?}"
            )))
        }
    }
    check_eq!(
        shown(&impostor, &key, "adopted").await?,
        Some(label.clone()),
        "the label after adoption"
    );
    // Another owner with the same label.
    match impostor
        .backend()
        .acquire(request(OwnerToken::random()))
        .await?
    {
        AcquireReply::Held { .. } => {}
        other => {
            return Err(CaseError(format!(
                "another owner with the holder's label was answered {other:?}"
            )))
        }
    }
    let forged = HeldLock {
        key: &key,
        owner: OwnerToken::random(),
        fencing: granted.fencing,
        handle: granted.handle,
    };
    check_eq!(
        impostor.backend().release(forged).await?,
        ReleaseReply::NotHeld,
        "a release by another owner token with the same label"
    );
    check!(
        matches!(
            impostor.backend().extend(forged, ttl).await?,
            distlock_core::ExtendReply::NotHeld
        ),
        "an extension by another owner token with the same label is refused"
    );
    let own = HeldLock { owner, ..forged };
    check_eq!(
        holder.backend().release(own).await?,
        ReleaseReply::Released,
        "the real owner still holds it"
    );
    Ok(())
}
