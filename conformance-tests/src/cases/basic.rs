//! `basic::` — acquire, refuse, release, extend, expire, owner checks.

use std::time::{Duration, Instant};

use distlock_core::{AcquireAttempt, ErrorKind, Lease, LockClient, LockError, LockKey, LockState};

use super::support::{
    acquire, eventually_acquire, expect_kind, expiry_bound, key_with, refused, stem,
};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::{check, check_eq};

pub async fn acquire_then_release(ctx: TestContext) -> CaseResult {
    let lock = ctx.client().await?;
    let key = ctx.key("basic");
    let lease = lock.try_acquire(&key, ctx.long_ttl()).await?.lease();
    check!(lease.is_some(), "a free key must be acquired");
    let lease = lease.unwrap();
    check_eq!(lease.key(), &key, "the lease names its key");
    lock.release(&lease).await?;
    let again = lock.try_acquire(&key, ctx.long_ttl()).await?.lease();
    check!(again.is_some(), "a released key must be free again");
    lock.release(&again.unwrap()).await?;
    Ok(())
}

pub async fn held_key_is_refused(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let lease = a.try_acquire(&key, ctx.long_ttl()).await?.lease();
    check!(lease.is_some(), "first acquire succeeds");
    let second = b.try_acquire(&key, ctx.long_ttl()).await?;
    check!(
        second.lease().is_none(),
        "a held key must be refused to another client"
    );
    a.release(&lease.unwrap()).await?;
    Ok(())
}

/// The same client cannot take a key it already holds a second time.
pub async fn held_key_is_refused_to_same_client(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("basic");
    let lease = acquire(&a, &key, ctx.long_ttl(), "first acquire").await?;
    refused(&a, &key, "second acquire by the same client").await?;
    a.release(&lease).await?;
    Ok(())
}

/// A refusal's `expires_in`, when given, is within the holder's TTL.
pub async fn held_reports_remaining_ttl(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let ttl = Duration::from_secs(30);
    let lease = acquire(&a, &key, ttl, "holder").await?;
    match b.try_acquire(&key, ttl).await? {
        AcquireAttempt::Held {
            expires_in: Some(left),
        } => check!(
            left <= lease.ttl(),
            "expires_in {left:?} exceeds the holder's TTL {:?}",
            lease.ttl()
        ),
        AcquireAttempt::Held { expires_in: None } => {}
        AcquireAttempt::Acquired(_) => {
            return Err("a held key was granted to another client".into())
        }
    }
    a.release(&lease).await?;
    Ok(())
}

pub async fn release_frees_key_for_other_client(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let lease = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    refused(&b, &key, "while held").await?;
    a.release(&lease).await?;
    let lease_b = acquire(&b, &key, ctx.long_ttl(), "after release").await?;
    refused(&a, &key, "held by the second client").await?;
    b.release(&lease_b).await?;
    Ok(())
}

pub async fn release_twice_is_not_held(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("basic");
    let lease = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    a.release(&lease).await?;
    let second = a.release(&lease).await;
    // The client names what failed, once, whatever the backend words.
    if let Err(e) = &second {
        check_eq!(
            (e.backend(), e.operation(), e.key()),
            (Some(a.name()), Some("release"), Some(key.as_str())),
            "the error's context"
        );
        let text = e.to_string();
        check!(
            text.matches(key.as_str()).count() == 1,
            "the error names the key once: {text}"
        );
    }
    expect_kind(second, ErrorKind::NotHeld, "second release")?;
    Ok(())
}

/// Extending keeps the lock, its key and fencing token.
pub async fn extend_keeps_lock(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let lease = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    let renewed = a.extend(&lease, ctx.long_ttl()).await?;
    check_eq!(renewed.key(), &key, "extended lease key");
    check_eq!(
        renewed.fencing_token(),
        lease.fencing_token(),
        "extend keeps the fencing token"
    );
    check_eq!(
        renewed.owner(),
        lease.owner(),
        "extend keeps the owner token"
    );
    refused(&b, &key, "after extend").await?;
    // Both the original and the renewed lease name the same acquisition.
    a.release(&renewed).await?;
    expect_kind(
        a.release(&lease).await,
        ErrorKind::NotHeld,
        "release of the pre-extend lease after release",
    )?;
    acquire(&b, &key, ctx.long_ttl(), "after release").await?;
    Ok(())
}

/// Extending pushes the expiry out: a short lock extended to a long TTL
/// survives its original TTL.
pub async fn extend_pushes_expiry(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let short = ctx.short_ttl();
    let lease = acquire(&a, &key, short, "holder").await?;
    let renewed = a.extend(&lease, ctx.long_ttl()).await?;
    check!(
        renewed.ttl() >= ctx.long_ttl(),
        "renewed TTL {:?} shorter than asked",
        renewed.ttl()
    );
    tokio::time::sleep(short * 2).await;
    refused(&b, &key, "after the original TTL, extended").await?;
    a.release(&renewed).await?;
    Ok(())
}

/// A lock nobody renews is free after its TTL.
pub async fn ttl_expiry_frees_key(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let ttl = ctx.short_ttl();
    let lease = acquire(&a, &key, ttl, "holder").await?;
    refused(&b, &key, "right after acquire").await?;
    tokio::time::sleep(ttl).await;
    let next = eventually_acquire(&b, &key, ctx.long_ttl(), expiry_bound(ttl), "after TTL").await?;
    check!(
        next.fencing_token() > lease.fencing_token(),
        "token grows across expiry"
    );
    b.release(&next).await?;
    Ok(())
}

/// A lock taken with `try_acquire_renewing` (for a guard that will renew it)
/// still expires after its TTL when nobody renews it, while the client that
/// took it stays alive; and it is released, extended and fenced like any
/// other.
pub async fn renewing_acquire_expires_without_renewal(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let ttl = ctx.short_ttl();
    // Each step must happen within the short TTL; on a loaded machine one
    // may come too late, and the lease is rightly gone by then. Such a
    // round proves nothing and is tried again (a few times) on a new key;
    // a refusal while the lease is still valid is a failure.
    let mut round = 0;
    loop {
        round += 1;
        let key = ctx.key("basic");
        match renewing_lock_round(&ctx, &a, &b, &key, ttl).await {
            Ok(()) => return Ok(()),
            Err(RoundError::TooSlow(_)) if round < 5 => {}
            Err(RoundError::TooSlow(e)) | Err(RoundError::Failed(e)) => return Err(e),
        }
    }
}

/// How one round of [`renewing_acquire_expires_without_renewal`] ended.
enum RoundError {
    /// A lease ran out before a step that needed it could be sent.
    TooSlow(CaseError),
    Failed(CaseError),
}

impl<E: Into<CaseError>> From<E> for RoundError {
    fn from(e: E) -> Self {
        RoundError::Failed(e.into())
    }
}

/// `step` on `lease`: a `NotHeld` once the lease's own deadline has passed
/// is the machine being slow, not a failure.
fn too_slow<T>(lease: &Lease, step: Result<T, LockError>) -> Result<T, RoundError> {
    match step {
        Err(e) if e.kind() == ErrorKind::NotHeld && lease.is_expired() => {
            Err(RoundError::TooSlow(e.into()))
        }
        other => Ok(other?),
    }
}

async fn renewing_lock_round(
    ctx: &TestContext,
    a: &LockClient,
    b: &LockClient,
    key: &LockKey,
    ttl: Duration,
) -> Result<(), RoundError> {
    let lease = match a.try_acquire_renewing(key, ttl).await? {
        distlock_core::AcquireAttempt::Acquired(lease) => lease,
        other => return Err(format!("a free key must be acquired, got {other:?}").into()),
    };
    refused(b, key, "right after the renewing acquire").await?;
    let extended = too_slow(&lease, a.extend(&lease, ttl).await)?;
    if extended.fencing_token() != lease.fencing_token() {
        return Err(format!(
            "extend keeps the token: {:?} became {:?}",
            lease.fencing_token(),
            extended.fencing_token()
        )
        .into());
    }
    tokio::time::sleep(ttl).await;
    let next = eventually_acquire(
        b,
        key,
        ctx.long_ttl(),
        expiry_bound(ttl),
        "after the TTL, with the first client still alive",
    )
    .await?;
    if next.fencing_token() <= lease.fencing_token() {
        return Err(format!(
            "token grows across expiry: {:?} then {:?}",
            lease.fencing_token(),
            next.fencing_token()
        )
        .into());
    }
    b.release(&next).await?;
    // And a renewing lock released normally frees the key at once.
    let again = match a.try_acquire_renewing(key, ttl).await? {
        distlock_core::AcquireAttempt::Acquired(lease) => lease,
        other => return Err(format!("the released key must be free, got {other:?}").into()),
    };
    too_slow(&again, a.release(&again).await)?;
    let last = acquire(b, key, ctx.long_ttl(), "after releasing the renewing lock").await?;
    b.release(&last).await?;
    Ok(())
}

/// A client cannot release a lock with the owner token of an earlier
/// acquisition of the same key, even its own.
pub async fn stale_owner_release_refused(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let c = ctx.client().await?;
    let key = ctx.key("basic");
    let old = acquire(&a, &key, ctx.long_ttl(), "first").await?;
    a.release(&old).await?;
    let current = acquire(&a, &key, ctx.long_ttl(), "second, same client").await?;
    expect_kind(
        a.release(&old).await,
        ErrorKind::NotHeld,
        "release with the old lease",
    )?;
    refused(&c, &key, "current holder keeps it").await?;
    a.extend(&current, ctx.long_ttl()).await?;
    a.release(&current).await?;
    Ok(())
}

/// Same for extend: the old lease cannot extend the current holder's lock.
pub async fn stale_owner_extend_refused(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let c = ctx.client().await?;
    let key = ctx.key("basic");
    let old = acquire(&a, &key, ctx.long_ttl(), "first").await?;
    a.release(&old).await?;
    let current = acquire(&a, &key, ctx.short_ttl(), "second, same client").await?;
    expect_kind(
        a.extend(&old, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "extend with the old lease",
    )?;
    refused(&c, &key, "current holder keeps it").await?;
    a.release(&current).await?;
    Ok(())
}

/// Foreign release: A's old lease cannot release B's lock.
pub async fn foreign_release_refused(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let c = ctx.client().await?;
    let key = ctx.key("basic");
    let old = acquire(&a, &key, ctx.long_ttl(), "A").await?;
    a.release(&old).await?;
    let held = acquire(&b, &key, ctx.long_ttl(), "B").await?;
    expect_kind(
        a.release(&old).await,
        ErrorKind::NotHeld,
        "A releasing B's lock",
    )?;
    refused(&c, &key, "B keeps the lock").await?;
    b.extend(&held, ctx.long_ttl()).await?;
    b.release(&held).await?;
    Ok(())
}

/// Foreign extend: A's old lease cannot extend B's lock.
pub async fn foreign_extend_refused(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let c = ctx.client().await?;
    let key = ctx.key("basic");
    let old = acquire(&a, &key, ctx.long_ttl(), "A").await?;
    a.release(&old).await?;
    let held = acquire(&b, &key, ctx.long_ttl(), "B").await?;
    expect_kind(
        a.extend(&old, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "A extending B's lock",
    )?;
    refused(&c, &key, "B keeps the lock").await?;
    b.release(&held).await?;
    acquire(&c, &key, ctx.long_ttl(), "after B released").await?;
    Ok(())
}

/// A holder whose lock expired and was taken over cannot release the next
/// holder's lock.
pub async fn release_after_expiry_keeps_next_holder(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let c = ctx.client().await?;
    let key = ctx.key("basic");
    let ttl = ctx.short_ttl();
    let old = acquire(&a, &key, ttl, "A").await?;
    tokio::time::sleep(ttl).await;
    let next = eventually_acquire(
        &b,
        &key,
        ctx.long_ttl(),
        expiry_bound(ttl),
        "B after A's TTL",
    )
    .await?;
    expect_kind(
        a.release(&old).await,
        ErrorKind::NotHeld,
        "A's release after expiry",
    )?;
    refused(&c, &key, "B keeps the lock after A's late release").await?;
    b.extend(&next, ctx.long_ttl()).await?;
    b.release(&next).await?;
    Ok(())
}

/// An expired lease cannot be extended, and the failed extend does not
/// bring the lock back.
pub async fn extend_after_expiry_fails(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let ttl = ctx.short_ttl();
    let old = acquire(&a, &key, ttl, "A").await?;
    // Well past the TTL by any clock.
    tokio::time::sleep(ttl + ttl / 2 + Duration::from_millis(300)).await;
    expect_kind(
        a.extend(&old, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "extend after expiry",
    )?;
    let next = eventually_acquire(
        &b,
        &key,
        ctx.long_ttl(),
        expiry_bound(ttl),
        "key free after the refused extend",
    )
    .await?;
    b.release(&next).await?;
    Ok(())
}

/// An expired lease cannot extend the next holder's lock.
pub async fn extend_after_expiry_keeps_next_holder(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let c = ctx.client().await?;
    let key = ctx.key("basic");
    let ttl = ctx.short_ttl();
    let old = acquire(&a, &key, ttl, "A").await?;
    tokio::time::sleep(ttl).await;
    let next = eventually_acquire(
        &b,
        &key,
        ctx.long_ttl(),
        expiry_bound(ttl),
        "B after A's TTL",
    )
    .await?;
    expect_kind(
        a.extend(&old, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "A's extend after expiry",
    )?;
    refused(&c, &key, "B keeps the lock").await?;
    b.release(&next).await?;
    acquire(
        &c,
        &key,
        ctx.long_ttl(),
        "after B released (A's extend did not resurrect)",
    )
    .await?;
    Ok(())
}

/// A released lease cannot be extended, and the key stays free.
pub async fn extend_after_release_fails(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("basic");
    let lease = acquire(&a, &key, ctx.long_ttl(), "A").await?;
    a.release(&lease).await?;
    expect_kind(
        a.extend(&lease, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "extend after release",
    )?;
    let next = acquire(
        &b,
        &key,
        ctx.long_ttl(),
        "key stays free after the refused extend",
    )
    .await?;
    b.release(&next).await?;
    Ok(())
}

/// Keys that look alike in some encoding (paths, Redis hash tags, URL
/// escapes, globs, Unicode normal forms, trailing space) are independent.
pub async fn lookalike_keys_independent(ctx: TestContext) -> CaseResult {
    let stem = stem("look");
    let suffixes = [
        "a",
        "a/b",
        "a:b",
        "a{b}",
        "{a}b",
        "a%2Fb",
        "a%2fb",
        "a*",
        "a?",
        "a[b]",
        "a\\b",
        "a.b",
        "a b",
        "a ",
        "A",
        "a/",
        "a//b",
        "a_b",
        "a-b",
        "é",
        "e\u{301}",
        "日本",
        "ab",
        "a\nb",
        "a'b",
        "a\"b",
        "a%",
        "a_",
        "a\u{1F512}",
    ];
    let mut keys = suffixes
        .iter()
        .map(|suffix| key_with(&stem, suffix))
        .collect::<Result<Vec<_>, _>>()?;
    // Also the bare stem (a prefix of every other key).
    keys.push(key_with(stem.trim_end_matches('-'), "")?);
    independent_keys(&ctx, &keys).await
}

/// One client holds many keys at once; releasing one frees only that one.
pub async fn many_keys_per_client(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let stem = stem("many");
    let mut leases = Vec::new();
    for i in 0..20 {
        let key = key_with(&stem, &i.to_string())?;
        leases.push(acquire(&a, &key, ctx.long_ttl(), "one of many").await?);
    }
    let first = leases.remove(0);
    a.release(&first).await?;
    let got = acquire(&b, first.key(), ctx.long_ttl(), "the released one").await?;
    for lease in &leases {
        refused(&b, lease.key(), "the others").await?;
        a.release(lease).await?;
    }
    b.release(&got).await?;
    Ok(())
}

/// Distinct `keys` never interfere: one client takes them all (each must be
/// free: a key the server merged with an earlier one is refused), another
/// is refused every one, and releasing every other key frees exactly those.
async fn independent_keys(ctx: &TestContext, keys: &[LockKey]) -> CaseResult {
    let distinct: std::collections::HashSet<&str> = keys.iter().map(LockKey::as_str).collect();
    check_eq!(
        distinct.len(),
        keys.len(),
        "the case's keys are distinct strings"
    );
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let mut leases = Vec::new();
    for key in keys {
        let what = format!("look-alike {key:?} (merged with an earlier key by the server?)");
        leases.push(acquire(&a, key, ctx.long_ttl(), &what).await?);
    }
    for lease in &leases {
        refused(&b, lease.key(), "held look-alike").await?;
    }
    // Release every other key: exactly those become free.
    for lease in leases.iter().step_by(2) {
        a.release(lease).await?;
    }
    for (i, lease) in leases.iter().enumerate() {
        if i % 2 == 0 {
            let got = acquire(&b, lease.key(), ctx.long_ttl(), "released look-alike").await?;
            b.release(&got).await?;
        } else {
            refused(&b, lease.key(), "look-alike not released").await?;
            a.release(lease).await?;
        }
    }
    Ok(())
}

/// Keys that differ only by Unicode compatibility forms (fullwidth and
/// halfwidth letters, ligatures, superscripts, the Kelvin and Ångström
/// signs), canonical equivalents (precomposed and combining forms), or
/// invisible characters (zero-width space, joiners, word joiner, byte-order
/// mark, soft hyphen, direction marks, variation selectors, non-breaking and
/// ideographic spaces) are independent: a key is its exact UTF-8 bytes, and
/// a server that normalises or strips characters merges two locks.
pub async fn unicode_lookalike_keys_independent(ctx: TestContext) -> CaseResult {
    let stem = stem("uni");
    let suffixes = [
        "",
        "a",
        "\u{ff41}",
        "A",
        "\u{ff21}",
        "ab",
        "\u{ff41}\u{ff42}",
        "1",
        "\u{ff11}",
        "\u{2460}",
        "\u{b9}",
        "2",
        "\u{b2}",
        "fi",
        "\u{fb01}",
        "K",
        "\u{212a}",
        "k",
        "\u{c5}",
        "\u{212b}",
        "A\u{30a}",
        "\u{e9}",
        "e\u{301}",
        "\u{1c6}",
        "d\u{17e}",
        "\u{30ab}",
        "\u{ff76}",
        "\u{30ac}",
        "\u{30ab}\u{3099}",
        "a\u{200b}b",
        "a\u{200c}b",
        "a\u{200d}b",
        "a\u{2060}b",
        "\u{feff}ab",
        "ab\u{feff}",
        "a\u{ad}b",
        "a\u{200e}b",
        "a\u{202e}b",
        "ab\u{200b}",
        "\u{200b}",
        "a\u{fe0f}",
        "a b",
        "a\u{a0}b",
        "a\u{2009}b",
        "a\u{3000}b",
    ];
    let keys = suffixes
        .iter()
        .map(|suffix| key_with(&stem, suffix))
        .collect::<Result<Vec<_>, _>>()?;
    independent_keys(&ctx, &keys).await
}

/// Two clients in different namespaces of one server never see each
/// other's locks: the same key is held at once in the suite's own namespace
/// and in namespaces named alike (a prefix and its extensions by `x`, `.x`,
/// `-x`, `_x`, and the same letters in upper case); each namespace's own
/// second client is refused it (the namespace is honoured consistently),
/// and a release in one namespace frees the key there only.
pub async fn namespaces_independent(ctx: TestContext) -> CaseResult {
    let base = format!("dl{}", crate::naming::random_hex());
    let namespaces = [
        None,
        Some(base.clone()),
        Some(format!("{base}x")),
        Some(format!("{base}.x")),
        Some(format!("{base}-x")),
        Some(format!("{base}_x")),
        Some(base.to_uppercase()),
    ];
    let key = ctx.key("ns");
    let mut sides = Vec::new();
    for namespace in &namespaces {
        let name = namespace.as_deref().unwrap_or("the suite's own");
        let (holder, other) = match namespace {
            Some(ns) => (
                ctx.client_in_namespace(ns).await?,
                ctx.client_in_namespace(ns).await?,
            ),
            None => (ctx.client().await?, ctx.client().await?),
        };
        let what =
            format!("namespace {name:?}: the key held in the other namespaces must be free here");
        let lease = acquire(&holder, &key, ctx.long_ttl(), &what).await?;
        sides.push((name, holder, other, lease));
    }
    for (name, _, other, _) in &sides {
        refused(
            other,
            &key,
            &format!("namespace {name:?}: its own holder's lock"),
        )
        .await?;
    }
    // A release in one namespace frees the key there only.
    let (name, holder, other, lease) = &sides[1];
    holder.release(lease).await?;
    let got = acquire(
        other,
        &key,
        ctx.long_ttl(),
        &format!("namespace {name:?} after its holder released"),
    )
    .await?;
    for (name, _, other, _) in sides.iter().filter(|side| side.0 != *name) {
        refused(
            other,
            &key,
            &format!("namespace {name:?} after a release in another namespace"),
        )
        .await?;
    }
    other.release(&got).await?;
    for (_, holder, _, lease) in sides.iter().filter(|side| side.0 != *name) {
        holder.release(lease).await?;
    }
    Ok(())
}

/// A refusal's `expires_in`, and `inspect`'s where the backend has it, is
/// the holder's real time left: more than zero, at most its TTL, and at
/// least what its lease still promises (`valid_until` minus the instant the
/// answer arrived, less the backend's TTL granularity) — for a plain and a
/// renewing holder, after acquire and after extend. A "held" answer with
/// no time left makes every waiter retry at once, over and over.
pub async fn held_reports_time_left(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let other = ctx.client().await?;
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(30))?;
    for renewing in [false, true] {
        let key = ctx.key("basic-left");
        let attempt = if renewing {
            holder.try_acquire_renewing(&key, ttl).await?
        } else {
            holder.try_acquire(&key, ttl).await?
        };
        let AcquireAttempt::Acquired(acquired) = attempt else {
            return Err(format!("a free key must be acquired, got {attempt:?}").into());
        };
        let extended = holder.extend(&acquired, ttl).await?;
        for (step, lease) in [("acquired", &acquired), ("extended", &extended)] {
            let what = format!("holder {step} (renewing: {renewing})");
            match other.try_acquire(&key, ttl).await? {
                AcquireAttempt::Held {
                    expires_in: Some(left),
                } => time_left_is_real(&ctx, left, lease, Instant::now(), &what)?,
                AcquireAttempt::Held { expires_in: None } => {}
                AcquireAttempt::Acquired(_) => {
                    return Err(format!("{what}: a held key was granted to another client").into())
                }
            }
            if other.admin().is_some() {
                match other.inspect(&key).await? {
                    LockState::Held {
                        expires_in: Some(left),
                        fencing_token,
                        ..
                    } if fencing_token == lease.fencing_token() => time_left_is_real(
                        &ctx,
                        left,
                        lease,
                        Instant::now(),
                        &format!("inspect, {what}"),
                    )?,
                    LockState::Held {
                        expires_in: None, ..
                    } => {}
                    state => {
                        return Err(format!(
                            "inspect, {what}: expected the holder's token {}, got {state:?}",
                            lease.fencing_token()
                        )
                        .into())
                    }
                }
            }
        }
        holder.release(&extended).await?;
    }
    Ok(())
}

/// Fails unless `left`, reported for `lease`'s live lock in an answer that
/// arrived at `answered`, is more than zero, at most the lease's TTL and at
/// least its remaining validity (one-sided: the server may keep a lock
/// longer than its holder's conservative deadline, never shorter).
fn time_left_is_real(
    ctx: &TestContext,
    left: Duration,
    lease: &Lease,
    answered: Instant,
    what: &str,
) -> CaseResult {
    let granularity = ctx.capabilities().ttl_granularity;
    let promised = lease.valid_until().saturating_duration_since(answered);
    check!(
        !left.is_zero(),
        "{what}: a live holder's lock was reported with no time left, though its lease is valid for {promised:?} more"
    );
    check!(
        left <= lease.ttl() + granularity,
        "{what}: {left:?} left exceeds the holder's TTL {:?}",
        lease.ttl()
    );
    check!(
        left + granularity >= promised,
        "{what}: {left:?} left reported, but the holder's lease is valid for {promised:?} more (the server cannot expire it before)"
    );
    Ok(())
}
