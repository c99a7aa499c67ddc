//! `input::` — every bad input gets a typed error, never a panic.

use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockKey, LockOptions, Locker, MemoryLock, MAX_KEY_BYTES};

use super::support::{acquire, expect_kind, key_with, refused, stem};
use crate::context::{CaseResult, TestContext};
use crate::{check, check_eq};

pub async fn empty_key_rejected(_ctx: TestContext) -> CaseResult {
    expect_kind(LockKey::new(""), ErrorKind::InvalidInput, "empty key")?;
    expect_kind(
        LockKey::try_from(""),
        ErrorKind::InvalidInput,
        "empty key via TryFrom",
    )?;
    expect_kind(
        "".parse::<LockKey>(),
        ErrorKind::InvalidInput,
        "empty key via FromStr",
    )?;
    Ok(())
}

pub async fn oversized_key_rejected(_ctx: TestContext) -> CaseResult {
    expect_kind(
        LockKey::new("k".repeat(MAX_KEY_BYTES + 1)),
        ErrorKind::InvalidInput,
        "513-byte key",
    )?;
    // 256 two-byte characters plus one byte: 513 bytes, 257 characters.
    expect_kind(
        LockKey::new(format!("{}x", "é".repeat(256))),
        ErrorKind::InvalidInput,
        "513-byte multibyte key",
    )?;
    expect_kind(
        LockKey::new("k".repeat(100_000)),
        ErrorKind::InvalidInput,
        "100 kB key",
    )?;
    Ok(())
}

pub async fn nul_key_rejected(_ctx: TestContext) -> CaseResult {
    for bad in ["\0", "a\0", "\0a", "a\0b"] {
        expect_kind(
            LockKey::new(bad),
            ErrorKind::InvalidInput,
            &format!("key {bad:?}"),
        )?;
    }
    Ok(())
}

/// A key of exactly 512 bytes of multi-byte characters works end to end and
/// stays distinct from a key differing only in its last character.
pub async fn max_length_multibyte_key_works(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    // A random 16-hex prefix, then 3-byte and 4-byte characters, padded with
    // 2-byte ones to exactly 512 bytes.
    let prefix = crate::naming::random_hex();
    let mut text = prefix.clone();
    text.push_str(&"€".repeat(100)); // 300 bytes
    text.push_str(&"🔒".repeat(24)); // 96 bytes
    while text.len() + 2 <= MAX_KEY_BYTES {
        text.push('é');
    }
    while text.len() < MAX_KEY_BYTES {
        text.push('x');
    }
    check_eq!(text.len(), MAX_KEY_BYTES, "test key length");
    let key = LockKey::new(text.clone())?;
    let mut twin = text;
    twin.pop();
    twin.push('y');
    let twin = LockKey::new(twin)?;
    let lease = acquire(&a, &key, ctx.long_ttl(), "512-byte key").await?;
    check_eq!(lease.key(), &key, "the lease names the full key");
    refused(&b, &key, "512-byte key held").await?;
    let twin_lease = acquire(
        &b,
        &twin,
        ctx.long_ttl(),
        "512-byte key differing in its last byte",
    )
    .await?;
    let lease = a.extend(&lease, ctx.long_ttl()).await?;
    a.release(&lease).await?;
    let again = acquire(&b, &key, ctx.long_ttl(), "512-byte key after release").await?;
    b.release(&again).await?;
    b.release(&twin_lease).await?;
    Ok(())
}

pub async fn zero_ttl_rejected(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("input");
    expect_kind(
        a.try_acquire(&key, Duration::ZERO).await,
        ErrorKind::InvalidInput,
        "try_acquire with zero TTL",
    )?;
    let locker = Locker::new(a.clone());
    expect_kind(
        locker
            .try_lock(&key, &LockOptions::new(Duration::ZERO))
            .await,
        ErrorKind::InvalidInput,
        "Locker::try_lock with zero TTL",
    )?;
    // Nothing was taken by the refused calls.
    let lease = acquire(&a, &key, ctx.long_ttl(), "after the refused calls").await?;
    expect_kind(
        a.extend(&lease, Duration::ZERO).await,
        ErrorKind::InvalidInput,
        "extend with zero TTL",
    )?;
    // The refused extend did not touch the lock.
    refused(&ctx.client().await?, &key, "after the refused extend").await?;
    a.release(&lease).await?;
    Ok(())
}

pub async fn ttl_above_max_rejected(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("input");
    let max = a.capabilities().max_ttl;
    let Some(too_long) = max.checked_add(Duration::from_secs(1)) else {
        return Ok(()); // no TTL is above the maximum
    };
    expect_kind(
        a.try_acquire(&key, too_long).await,
        ErrorKind::InvalidInput,
        "try_acquire above max_ttl",
    )?;
    expect_kind(
        a.try_acquire(&key, Duration::MAX).await,
        ErrorKind::InvalidInput,
        "try_acquire with Duration::MAX",
    )?;
    let lease = acquire(&a, &key, ctx.long_ttl(), "after the refused calls").await?;
    expect_kind(
        a.extend(&lease, too_long).await,
        ErrorKind::InvalidInput,
        "extend above max_ttl",
    )?;
    refused(&ctx.client().await?, &key, "after the refused extend").await?;
    a.release(&lease).await?;
    Ok(())
}

/// A TTL below the backend's minimum is rounded up, never dropped.
pub async fn short_ttl_rounded_up(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let caps = a.capabilities();
    let key = ctx.key("input");
    let asked = Duration::from_millis(1);
    let lease = acquire(&a, &key, asked, "1 ms TTL").await?;
    let expected = caps.effective_ttl(asked)?;
    check!(
        lease.ttl() >= caps.min_ttl,
        "lease TTL {:?} below min_ttl {:?}",
        lease.ttl(),
        caps.min_ttl
    );
    check!(
        lease.ttl() >= expected,
        "lease TTL {:?} below effective_ttl {:?}",
        lease.ttl(),
        expected
    );
    // Release (or let it expire, whichever came first).
    let _ = a.release(&lease).await;
    Ok(())
}

/// A lease that was released is not held: extend and release say so.
pub async fn lease_used_after_release(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("input");
    let lease = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    a.release(&lease).await?;
    expect_kind(
        a.extend(&lease, ctx.long_ttl()).await,
        ErrorKind::NotHeld,
        "extend after release",
    )?;
    expect_kind(
        a.release(&lease).await,
        ErrorKind::NotHeld,
        "release after release",
    )?;
    let again = acquire(&a, &key, ctx.long_ttl(), "key free").await?;
    a.release(&again).await?;
    Ok(())
}

/// A lease handed to another client is refused as invalid input, and the
/// holder keeps the lock.
pub async fn lease_from_other_client(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("input");
    let lease = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    expect_kind(
        b.release(&lease).await,
        ErrorKind::InvalidInput,
        "release through another client",
    )?;
    expect_kind(
        b.extend(&lease, ctx.long_ttl()).await,
        ErrorKind::InvalidInput,
        "extend through another client",
    )?;
    refused(&b, &key, "holder keeps the lock").await?;
    a.release(&lease).await?;
    Ok(())
}

/// A lease from another backend (an in-process one) is refused as invalid
/// input and acts on nothing.
pub async fn lease_from_other_backend(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("input");
    let held = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    let other = MemoryLock::new().client();
    let foreign = acquire(&other, &key, ctx.long_ttl(), "same key on another backend").await?;
    expect_kind(
        a.release(&foreign).await,
        ErrorKind::InvalidInput,
        "release of a foreign backend's lease",
    )?;
    expect_kind(
        a.extend(&foreign, ctx.long_ttl()).await,
        ErrorKind::InvalidInput,
        "extend of a foreign backend's lease",
    )?;
    refused(&ctx.client().await?, &key, "holder keeps the lock").await?;
    a.release(&held).await?;
    other.release(&foreign).await?;
    Ok(())
}

/// A wait deadline in the past means exactly one attempt.
pub async fn past_deadline_is_one_attempt(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let key = ctx.key("input");
    let past = Instant::now()
        .checked_sub(Duration::from_secs(1))
        .unwrap_or_else(Instant::now);
    let lease = a.acquire(&key, ctx.long_ttl(), past).await?;
    check!(
        lease.is_some(),
        "a free key is acquired by one attempt even with a past deadline"
    );
    let lease = lease.unwrap();
    let second = b.acquire(&key, ctx.long_ttl(), past).await?;
    check!(
        second.is_none(),
        "a held key with a past deadline returns None at once"
    );
    a.release(&lease).await?;
    // Through the Locker: zero wait is one attempt too.
    let locker = Locker::new(b.clone());
    let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::ZERO);
    let guard = locker.acquire(&key, &options).await?;
    check!(guard.is_some(), "zero wait on a free key acquires");
    let other = Locker::new(a.clone()).acquire(&key, &options).await?;
    check!(other.is_none(), "zero wait on a held key returns None");
    guard.unwrap().release().await?;
    Ok(())
}

/// Keys are used exactly as given: no trimming, case folding or
/// normalisation.
pub async fn keys_used_verbatim(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let stem = stem("verbatim");
    for (x, y) in [
        ("k", "k "),
        ("k", " k"),
        ("k", "K"),
        ("é", "e\u{301}"),
        ("k", "k\t"),
    ] {
        let kx = key_with(&stem, x)?;
        let ky = key_with(&stem, y)?;
        let lx = acquire(&a, &kx, ctx.long_ttl(), &format!("{x:?}")).await?;
        let ly = acquire(&a, &ky, ctx.long_ttl(), &format!("{y:?} next to {x:?}")).await?;
        check_eq!(lx.key().as_str(), kx.as_str(), "key kept verbatim");
        a.release(&lx).await?;
        a.release(&ly).await?;
    }
    Ok(())
}
