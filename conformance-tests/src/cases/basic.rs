//! `basic::` — acquire, refuse, release, extend, expire.

use crate::context::{CaseResult, TestContext};
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
