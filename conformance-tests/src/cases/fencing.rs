//! `fencing::` — tokens strictly grow per key and never change on extend.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockOptions, Locker, Renewal};

use super::support::{
    acquire, eventually_acquire, expiry_bound, lock_free_key, until_attempts, within,
};
use crate::context::{CaseResult, TestContext};
use crate::{check, check_eq, ObservedLock};

pub async fn increases_across_release(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("fencing");
    let mut last = None;
    for i in 0..10 {
        let lease = acquire(&a, &key, ctx.long_ttl(), &format!("round {i}")).await?;
        if let Some(prev) = last {
            check!(
                lease.fencing_token() > prev,
                "token {} after {prev} (round {i})",
                lease.fencing_token()
            );
        }
        last = Some(lease.fencing_token());
        a.release(&lease).await?;
    }
    Ok(())
}

pub async fn increases_across_expiry(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("fencing");
    let ttl = ctx.short_ttl();
    let first = acquire(&a, &key, ttl, "first").await?;
    tokio::time::sleep(ttl).await;
    // Same client, after expiry without release.
    let second = eventually_acquire(&a, &key, ttl, expiry_bound(ttl), "after expiry").await?;
    check!(
        second.fencing_token() > first.fencing_token(),
        "token {} after expiry of {}",
        second.fencing_token(),
        first.fencing_token()
    );
    a.release(&second).await?;
    Ok(())
}

pub async fn increases_across_clients(ctx: TestContext) -> CaseResult {
    let clients = super::support::clients(&ctx, 3).await?;
    let key = ctx.key("fencing");
    let mut last = None;
    for round in 0..9 {
        let client = &clients[round % clients.len()];
        let lease = acquire(
            client,
            &key,
            ctx.long_ttl(),
            &format!("client {} round {round}", round % 3),
        )
        .await?;
        if let Some(prev) = last {
            check!(
                lease.fencing_token() > prev,
                "token {} after {prev} from another client",
                lease.fencing_token()
            );
        }
        last = Some(lease.fencing_token());
        client.release(&lease).await?;
    }
    Ok(())
}

pub async fn unchanged_by_extend(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let key = ctx.key("fencing");
    let lease = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    let token = lease.fencing_token();
    let mut current = lease;
    for i in 0..5 {
        current = a.extend(&current, ctx.long_ttl()).await?;
        check_eq!(current.fencing_token(), token, "token after extend {i}");
    }
    a.release(&current).await?;
    let next = acquire(&a, &key, ctx.long_ttl(), "next").await?;
    check!(
        next.fencing_token() > token,
        "extends do not hold back the next token"
    );
    a.release(&next).await?;
    Ok(())
}

/// A guard's token stays the same through its renewals.
pub async fn unchanged_by_guard_renewal(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let key = ctx.key("fencing");
    let ttl = ctx.steady_ttl();
    let options = LockOptions::new(ttl).with_renewal(Renewal::Every(ttl / 4));
    let guard = lock_free_key(&locker, &key, &options).await?;
    let token = guard.fencing_token();
    check_eq!(
        guard.lease().fencing_token(),
        token,
        "guard and lease agree"
    );
    tokio::time::sleep(ttl + ttl / 2).await;
    check!(!guard.is_lost(), "renewed guard lost its lock");
    check_eq!(guard.fencing_token(), token, "token after renewals");
    check_eq!(
        guard.lease().fencing_token(),
        token,
        "lease token after renewals"
    );
    guard.release().await?;
    Ok(())
}

/// Tokens of different keys are independent orders: interleaving does not
/// break either.
pub async fn increases_per_key_interleaved(ctx: TestContext) -> CaseResult {
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let k1 = ctx.key("fencing-x");
    let k2 = ctx.key("fencing-y");
    let (mut last1, mut last2) = (None, None);
    for i in 0..6 {
        let (c1, c2) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let l1 = acquire(c1, &k1, ctx.long_ttl(), "key 1").await?;
        let l2 = acquire(c2, &k2, ctx.long_ttl(), "key 2").await?;
        if let Some(p) = last1 {
            check!(
                l1.fencing_token() > p,
                "key 1 token {} after {p}",
                l1.fencing_token()
            );
        }
        if let Some(p) = last2 {
            check!(
                l2.fencing_token() > p,
                "key 2 token {} after {p}",
                l2.fencing_token()
            );
        }
        last1 = Some(l1.fencing_token());
        last2 = Some(l2.fencing_token());
        c2.release(&l2).await?;
        c1.release(&l1).await?;
    }
    Ok(())
}

/// Waiters handed the lock one after another get growing tokens.
pub async fn increases_for_successive_waiters(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let key = ctx.key("fencing");
    let first = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let mut tasks = Vec::new();
    let mut observed = Vec::new();
    for _ in 0..4 {
        let client = Arc::new(ObservedLock::new(ctx.client().await?));
        observed.push(client.clone());
        let locker = Locker::new(client);
        let key = key.clone();
        let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(60));
        tasks.push(tokio::spawn(async move {
            let guard = locker.acquire(&key, &options).await?;
            let Some(guard) = guard else { return Ok(None) };
            let token = guard.fencing_token();
            tokio::task::yield_now().await;
            guard.release().await?;
            Ok::<_, distlock_core::LockError>(Some(token))
        }));
    }
    for (i, client) in observed.iter().enumerate() {
        until_attempts(client, 1, &format!("waiter {i}")).await?;
    }
    holder.release(&first).await?;
    let mut tokens = Vec::new();
    for task in tasks {
        let token = within(Duration::from_secs(90), task, "waiter")
            .await?
            .map_err(|e| format!("waiter task panicked: {e}"))??;
        tokens.push(token.ok_or("a waiter never got the lock")?);
    }
    tokens.sort();
    tokens.dedup();
    check_eq!(tokens.len(), 4, "each waiter got a distinct token");
    check!(
        tokens[0] > first.fencing_token(),
        "waiters' tokens above the first holder's"
    );
    Ok(())
}
