//! `holder::` — a holder's label ([`HolderId`]) is stored with its lock and
//! shown by `inspect` to others, only for the acquisition that holds the
//! lock now (never a label left by an earlier holder), and is never proof
//! of ownership: only the owner token is. For backends that declare
//! `Capabilities::holder_ids`; the same for semaphore permits and
//! `inspect_permits` where `Capabilities::permit_holder_ids` is declared.

use distlock_core::{
    AcquireReply, AcquireRequest, ExtendReply, FencingToken, Grant, HeldLock, HolderId, LockClient,
    LockKey, LockOptions, LockState, OwnerToken, PermitReply, PermitRequest, ReleaseReply, Renewal,
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

/// The live permits `inspect_permits` lists for `key`, as (fencing token,
/// label), checking they come oldest first under `limit`.
async fn permits_listed(
    observer: &LockClient,
    key: &LockKey,
    limit: u32,
) -> Result<Vec<(FencingToken, Option<HolderId>)>, CaseError> {
    let permits = observer.inspect_permits(key).await?;
    check!(
        permits
            .windows(2)
            .all(|w| w[0].fencing_token < w[1].fencing_token),
        "inspect_permits lists permits oldest first: {permits:?}"
    );
    check!(
        permits.iter().all(|p| p.limit == limit),
        "every permit carries the limit {limit}: {permits:?}"
    );
    Ok(permits
        .into_iter()
        .map(|p| (p.fencing_token, p.holder))
        .collect())
}

/// One raw permit attempt of `owner` labelled `holder`, which must be
/// granted.
async fn raw_permit(
    client: &LockClient,
    key: &LockKey,
    owner: OwnerToken,
    ttl: std::time::Duration,
    holder: Option<&HolderId>,
    what: &str,
) -> Result<Grant, CaseError> {
    let semaphore = client
        .semaphore()
        .ok_or_else(|| CaseError("the backend has no semaphores".into()))?;
    let request = PermitRequest {
        key,
        owner,
        ttl,
        limit: PERMITS,
        renewing: false,
        settling: false,
        holder,
    };
    match semaphore.acquire_permit(request).await? {
        PermitReply::Granted(grant) => Ok(grant),
        other => Err(CaseError(format!("{what}: answered {other:?}"))),
    }
}

/// The semaphore's limit in [`permit_labels_round_trip`].
const PERMITS: u32 = 4;

/// Permits carry their holders' labels: `inspect_permits` lists each live
/// permit with its fencing token and its own label (a labelled one, a
/// longest multi-byte one, one without), a released or expired permit is
/// gone with its label, a new owner's permit never shows an earlier
/// holder's label, adoption keeps the label, and a label equal to a
/// holder's proves nothing: another owner token with it cannot release or
/// extend that holder's permit.
pub async fn permit_labels_round_trip(ctx: TestContext) -> CaseResult {
    let (first, second) = (ctx.locker().await?, ctx.locker().await?);
    let (observer, impostor) = (ctx.client().await?, ctx.client().await?);
    let key = ctx.key("permit-holder");
    let ttl = ctx.long_ttl();
    let a = holder_id("worker-a:101 é/ü")?;
    let b = holder_id(&"é".repeat(distlock_core::MAX_HOLDER_BYTES / 2))?;
    let options = LockOptions::new(ttl).with_permits(PERMITS);
    let take = |locker: &distlock_core::Locker, options: LockOptions, what: &'static str| {
        let (locker, key) = (locker.clone(), key.clone());
        async move {
            locker
                .try_lock(&key, &options)
                .await?
                .ok_or_else(|| CaseError(format!("{what}: no permit of a semaphore with room")))
        }
    };
    check_eq!(
        permits_listed(&observer, &key, PERMITS).await?,
        Vec::new(),
        "a semaphore nobody took a permit of"
    );

    // Through the locker: the label given in the options is stored.
    let guard_a = take(&first, options.clone().with_holder(a.clone()), "a").await?;
    let guard_b = take(&second, options.clone().with_holder(b.clone()), "b").await?;
    let guard_none = take(&second, options.clone(), "unlabelled").await?;
    let (token_a, token_none) = (guard_a.fencing_token(), guard_none.fencing_token());
    check_eq!(
        permits_listed(&observer, &key, PERMITS).await?,
        vec![
            (token_a, Some(a.clone())),
            (guard_b.fencing_token(), Some(b.clone())),
            (token_none, None),
        ],
        "each permit with its own label (the longest multi-byte one unchanged)"
    );

    // Released: gone, label and all.
    guard_b.release().await?;
    check_eq!(
        permits_listed(&observer, &key, PERMITS).await?,
        vec![(token_a, Some(a.clone())), (token_none, None)],
        "after b's release"
    );

    // Another owner with a's label: a permit of its own, never a's.
    let impostor_ttl = ctx.capabilities().effective_ttl(ttl)?;
    let other = OwnerToken::random();
    let theirs = raw_permit(&impostor, &key, other, impostor_ttl, Some(&a), "impostor").await?;
    check!(
        theirs.fencing != token_a,
        "another owner with a's label was handed a's permit (token {token_a})"
    );
    let semaphore = impostor
        .semaphore()
        .ok_or_else(|| CaseError("the backend has no semaphores".into()))?;
    for owner in [other, OwnerToken::random()] {
        let forged = HeldLock {
            key: &key,
            owner,
            fencing: token_a,
            handle: theirs.handle,
        };
        check!(
            matches!(
                semaphore.extend_permit(forged, impostor_ttl).await?,
                ExtendReply::NotHeld
            ),
            "an extension of a's permit by another owner token with a's label is refused"
        );
        check_eq!(
            semaphore.release_permit(forged).await?,
            ReleaseReply::NotHeld,
            "a release of a's permit by another owner token with a's label"
        );
    }
    // Adoption (the impostor's reply lost, the attempt made again): its
    // own permit and label, not a second permit.
    let again = raw_permit(&impostor, &key, other, impostor_ttl, Some(&a), "adoption").await?;
    check_eq!(again.fencing, theirs.fencing, "adoption keeps the token");
    check_eq!(
        permits_listed(&observer, &key, PERMITS).await?,
        vec![
            (token_a, Some(a.clone())),
            (token_none, None),
            (theirs.fencing, Some(a.clone())),
        ],
        "a's permit still a's, the impostor's its own"
    );

    // a's permit released: a new unlabelled permit never shows a's label.
    guard_a.release().await?;
    let fresh_owner = OwnerToken::random();
    let fresh = raw_permit(&impostor, &key, fresh_owner, impostor_ttl, None, "fresh").await?;
    check_eq!(
        permits_listed(&observer, &key, PERMITS).await?,
        vec![
            (token_none, None),
            (theirs.fencing, Some(a.clone())),
            (fresh.fencing, None),
        ],
        "after a's release, with a new unlabelled permit"
    );
    let own = |owner, grant: &Grant| HeldLock {
        key: &key,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    };
    check_eq!(
        semaphore.release_permit(own(other, &theirs)).await?,
        ReleaseReply::Released,
        "the impostor releasing its own permit"
    );
    guard_none.release().await?;

    // Expired (nobody renews it): gone from the list with its label.
    let short = ctx.capabilities().effective_ttl(ctx.short_ttl())?;
    let stale = raw_permit(
        &impostor,
        &key,
        OwnerToken::random(),
        short,
        Some(&a),
        "short",
    )
    .await?;
    let gone = async {
        loop {
            let listed = permits_listed(&observer, &key, PERMITS).await?;
            if listed.iter().all(|(token, _)| *token != stale.fencing) {
                return Ok::<_, CaseError>(listed);
            }
            tokio::time::sleep(short / 4).await;
        }
    };
    let listed = within(expiry_bound(short), gone, "the unrenewed permit's expiry").await??;
    check_eq!(
        listed,
        vec![(fresh.fencing, None)],
        "after the labelled permit expired"
    );
    let last_owner = OwnerToken::random();
    let last = raw_permit(&impostor, &key, last_owner, impostor_ttl, None, "last").await?;
    check_eq!(
        permits_listed(&observer, &key, PERMITS).await?,
        vec![(fresh.fencing, None), (last.fencing, None)],
        "a new unlabelled permit after the labelled one expired"
    );
    for (owner, grant) in [(fresh_owner, &fresh), (last_owner, &last)] {
        semaphore.release_permit(own(owner, grant)).await?;
    }
    Ok(())
}
