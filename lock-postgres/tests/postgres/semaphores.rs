//! Counting semaphores on the server: their own table, one row per
//! semaphore, adoption of a permit whose reply was lost, expired permits
//! reclaimed, rows distlock did not write left alone.

use std::time::Duration;

use distlock_conformance::fault::Direction;
use distlock_core::{
    ErrorKind, ExtendReply, Grant, HeldLock, LockKey, OwnerToken, PermitReply, PermitRequest,
    ReleaseReply, SemaphoreBackend,
};

use super::support::*;

fn request(k: &LockKey, owner: OwnerToken, ttl: Duration, limit: u32) -> PermitRequest<'_> {
    PermitRequest {
        key: k,
        owner,
        ttl,
        limit,
        renewing: false,
        settling: false,
        holder: None,
    }
}

fn granted(reply: PermitReply, why: &str) -> Grant {
    match reply {
        PermitReply::Granted(grant) => grant,
        other => panic!("{why}: {other:?}"),
    }
}

fn held<'a>(k: &'a LockKey, owner: OwnerToken, grant: &Grant) -> HeldLock<'a> {
    HeldLock {
        key: k,
        owner,
        fencing: grant.fencing,
        handle: grant.handle,
    }
}

fn semaphores(lock: &Pg) -> &dyn SemaphoreBackend {
    lock.backend.as_ref()
}

/// The semaphore row of `k`: its limit, fencing counter, and each permit's
/// owner, fencing token and milliseconds left by the database clock.
async fn semaphore_row(lock: &Pg, k: &LockKey) -> Option<(i64, i64, Vec<(String, i64, i64)>)> {
    type Row = (i64, i64, Vec<String>, Vec<i64>, Vec<i64>);
    let row: Option<Row> = sqlx::query_as(&format!(
        "SELECT permit_limit, fencing, owners, fencings,
                ARRAY(SELECT floor(extract(epoch FROM (e - clock_timestamp())) * 1000)::bigint
                      FROM unnest(expires) WITH ORDINALITY AS x (e, n) ORDER BY n)
         FROM {} WHERE namespace = $1 AND key = $2",
        lock.semaphore_table()
    ))
    .bind(lock.backend.config().client().namespace())
    .bind(k.as_str())
    .fetch_optional(lock.pool())
    .await
    .unwrap();
    row.map(|(limit, fencing, owners, fencings, left)| {
        let permits = owners
            .into_iter()
            .zip(fencings)
            .zip(left)
            .map(|((o, f), l)| (o, f, l))
            .collect();
        (limit, fencing, permits)
    })
}

#[tokio::test]
async fn a_permit_attempt_whose_reply_was_lost_is_adopted_by_the_next_with_its_owner_token() {
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("adopt_permit");
    // One connection, whose permit statement is prepared before replies
    // are held (preparing it takes a round trip of its own).
    let late = one_connection(&proxied, &ns).await;
    let direct = client(&ns).await;
    let warm_key = key("warm-up");
    let warm_owner = OwnerToken::random();
    let warm = granted(
        semaphores(&late)
            .acquire_permit(request(&warm_key, warm_owner, Duration::from_secs(5), 2))
            .await
            .unwrap(),
        "a free semaphore",
    );
    semaphores(&late)
        .release_permit(held(&warm_key, warm_owner, &warm))
        .await
        .unwrap();
    settled(&late).await;
    let k = key("adopted");
    let owner = OwnerToken::random();

    // The first attempt reaches the server and takes a permit; its reply
    // is held back past the operation timeout.
    proxy.hold(Direction::ToClient);
    let err = semaphores(&late)
        .acquire_permit(request(&k, owner, Duration::from_secs(20), 2))
        .await
        .expect_err("the reply was held back");
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    let (_, _, permits) = semaphore_row(&direct, &k)
        .await
        .expect("the first attempt wrote the semaphore's row");
    let [(holder, fencing, left)] = permits.as_slice() else {
        panic!("one permit expected: {permits:?}");
    };
    assert_eq!(holder, &owner.to_hex(), "taken by the first attempt");
    assert!(*left > 0 && *left <= 20_000, "{left} ms left");

    // The next attempt with the same owner token gets that permit: the
    // same fencing token, its expiry reset to the new TTL by the database
    // clock, and no second permit.
    let grant = granted(
        semaphores(&direct)
            .acquire_permit(request(&k, owner, Duration::from_secs(120), 2))
            .await
            .unwrap(),
        "a permit held by the request's own owner token was not adopted",
    );
    assert_eq!(grant.fencing.get(), *fencing as u64, "a new fencing token");
    let (_, counter, permits) = semaphore_row(&direct, &k).await.unwrap();
    assert_eq!(counter, *fencing, "the fencing counter moved on adoption");
    let [(_, _, left)] = permits.as_slice() else {
        panic!("the adopting attempt took a second permit: {permits:?}");
    };
    assert!(
        *left > 20_000,
        "the adopting attempt did not reset the expiry to its TTL: {left} ms left"
    );
    let other = OwnerToken::random();
    let second = granted(
        semaphores(&direct)
            .acquire_permit(request(&k, other, Duration::from_secs(120), 2))
            .await
            .unwrap(),
        "the second permit of two",
    );
    assert!(second.fencing > grant.fencing);
    let third = semaphores(&direct)
        .acquire_permit(request(&k, OwnerToken::random(), Duration::from_secs(5), 2))
        .await
        .unwrap();
    assert!(
        matches!(
            third,
            PermitReply::Full {
                expires_in: Some(_)
            }
        ),
        "a third permit of two: {third:?}"
    );

    // The first attempt's reply arrives late; the adopted permit stays.
    proxy.pass(Direction::ToClient);
    settled(&late).await;
    let (_, _, permits) = semaphore_row(&direct, &k).await.unwrap();
    assert_eq!(permits.len(), 2, "{permits:?}");
    for (k, owner, grant) in [(&k, owner, &grant), (&k, other, &second)] {
        let released = semaphores(&direct)
            .release_permit(held(k, owner, grant))
            .await
            .unwrap();
        assert_eq!(released, ReleaseReply::Released);
    }
}

#[tokio::test]
async fn a_semaphore_is_one_row_of_its_own_table_and_expired_permits_are_reclaimed() {
    let ns = unique_name("sem_rows");
    let lock = client(&ns).await;
    let k = key("shared-name");
    // A lock of the same name: another table, another counter.
    let lease = take(&lock, &k, Duration::from_secs(30), "free").await;
    let short = Duration::from_millis(200);
    let mut fencings = Vec::new();
    for _ in 0..3 {
        let owner = OwnerToken::random();
        let grant = granted(
            semaphores(&lock)
                .acquire_permit(request(&k, owner, short, 3))
                .await
                .unwrap(),
            "a permit of a semaphore named like a held lock",
        );
        fencings.push(grant.fencing.get());
    }
    // Tokens follow the database clock (see the crate docs on fencing
    // tokens): strictly increasing, the counter the last one.
    assert!(
        fencings.windows(2).all(|w| w[0] < w[1]),
        "the semaphore's own counter: {fencings:?}"
    );
    let (limit, counter, _) = semaphore_row(&lock, &k).await.unwrap();
    assert_eq!((limit, counter as u64), (3, fencings[2]));
    tokio::time::sleep(short * 4).await;
    // The next permit drops the expired ones (under another limit, since
    // none is live) and keeps counting.
    let owner = OwnerToken::random();
    let grant = granted(
        semaphores(&lock)
            .acquire_permit(request(&k, owner, Duration::from_secs(30), 5))
            .await
            .unwrap(),
        "a permit once every other ran out",
    );
    assert!(grant.fencing.get() > fencings[2]);
    let (limit, counter, permits) = semaphore_row(&lock, &k).await.unwrap();
    assert_eq!((limit, counter as u64), (5, grant.fencing.get()));
    assert_eq!(
        permits.iter().map(|p| p.0.clone()).collect::<Vec<_>>(),
        [owner.to_hex()],
        "expired permits were not reclaimed"
    );
    // Released, the permit is kept given up (see the test below), and the
    // row (its counter) stays.
    let released = semaphores(&lock)
        .release_permit(held(&k, owner, &grant))
        .await
        .unwrap();
    assert_eq!(released, ReleaseReply::Released);
    let again = semaphores(&lock)
        .release_permit(held(&k, owner, &grant))
        .await
        .unwrap();
    assert_eq!(again, ReleaseReply::NotHeld, "released twice");
    let extended = semaphores(&lock)
        .extend_permit(held(&k, owner, &grant), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(extended, ExtendReply::NotHeld, "a released permit extended");
    let (_, counter, _) = semaphore_row(&lock, &k).await.unwrap();
    assert_eq!(counter as u64, grant.fencing.get());
    let (_, lock_fencing, _) = row(&lock, &k).await.unwrap();
    assert_eq!(lock_fencing as u64, lease.fencing_token().get());
    lock.release(&lease).await.unwrap();
}

#[tokio::test]
async fn given_up_permits_are_not_counted_and_only_the_last_limit_of_them_are_kept() {
    let ns = unique_name("sem_given_up");
    let lock = client(&ns).await;
    let k = key("returned");
    let ttl = Duration::from_secs(30);
    let limit = 2;
    let mut owners = Vec::new();
    let mut last_token = 0;
    for _ in 0..5 {
        let owner = OwnerToken::random();
        let grant = granted(
            semaphores(&lock)
                .acquire_permit(request(&k, owner, ttl, limit))
                .await
                .unwrap(),
            "every earlier permit was returned",
        );
        let released = semaphores(&lock)
            .release_permit(held(&k, owner, &grant))
            .await
            .unwrap();
        assert_eq!(released, ReleaseReply::Released);
        owners.push(owner);
        last_token = grant.fencing.get();
    }
    // Each permit stays given up, to refuse its attempt's late sends, but
    // only the last `limit` of them: the row stays small.
    let (_, counter, permits) = semaphore_row(&lock, &k).await.unwrap();
    assert_eq!(counter as u64, last_token);
    let kept: Vec<String> = permits.iter().map(|p| p.0.clone()).collect();
    let last: Vec<String> = owners[3..].iter().map(|o| o.to_hex()).collect();
    assert_eq!(kept, last, "the given-up permits kept");
    assert!(
        permits.iter().all(|p| p.2 < 0),
        "a given-up permit is live: {permits:?}"
    );
    // They count for nothing: `limit` more permits, one of them by the
    // owner token of a given-up one (a later attempt, not a late send).
    for owner in [owners[4], OwnerToken::random()] {
        granted(
            semaphores(&lock)
                .acquire_permit(request(&k, owner, ttl, limit))
                .await
                .unwrap(),
            "a permit beside given-up ones",
        );
    }
    let full = semaphores(&lock)
        .acquire_permit(request(&k, OwnerToken::random(), ttl, limit))
        .await
        .unwrap();
    assert!(
        matches!(full, PermitReply::Full { .. }),
        "a permit beyond the limit: {full:?}"
    );
}

#[tokio::test]
async fn a_semaphore_row_edited_into_an_impossible_state_is_reported_not_overwritten() {
    let ns = unique_name("sem_corrupt");
    let a = client(&ns).await;
    let table = a.semaphore_table();
    let ttl = Duration::from_secs(30);
    for (name, edit) in [
        ("owner", "owners = ARRAY['not-a-token']"),
        ("limit", "permit_limit = 0"),
        ("lengths", "fencings = ARRAY[]::bigint[]"),
        ("fencing", "fencing = 0"),
    ] {
        let k = key(name);
        let owner = OwnerToken::random();
        let grant = granted(
            semaphores(&a)
                .acquire_permit(request(&k, owner, ttl, 2))
                .await
                .unwrap(),
            "a free semaphore",
        );
        admin(
            &a,
            &format!("UPDATE {table} SET {edit} WHERE namespace = '{ns}' AND key = '{name}'"),
        )
        .await;
        let before = semaphore_row(&a, &k).await;
        let err = semaphores(&a)
            .acquire_permit(request(&k, OwnerToken::random(), ttl, 2))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupted, "{name}: {err}");
        assert!(err.to_string().contains("semaphore"), "{err}");
        let err = semaphores(&a)
            .extend_permit(held(&k, owner, &grant), ttl)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupted, "{name}: {err}");
        let err = semaphores(&a)
            .release_permit(held(&k, owner, &grant))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupted, "{name}: {err}");
        let after = semaphore_row(&a, &k).await;
        assert_eq!(
            before.map(|(l, f, p)| (l, f, p.len())),
            after.map(|(l, f, p)| (l, f, p.len())),
            "{name}: the foreign row was changed"
        );
    }
}

#[tokio::test]
async fn serializable_default_isolation_never_fails_concurrent_permit_attempts() {
    // As for locks (see rows.rs): concurrent writes of one semaphore row
    // conflict under a serializable default (SQLSTATE 40001), and such a
    // statement was rolled back, so it is sent again.
    let lock = serializable_client().await;

    let errors = contended_rounds(&lock, 3, |lock, k| async move {
        lock.try_acquire_permit(&k, 3, Duration::from_secs(30))
            .await
    })
    .await;
    assert!(
        errors.is_empty(),
        "{} of 160 permit attempts failed, e.g. {:?}",
        errors.len(),
        errors.first()
    );
}

#[tokio::test]
async fn permits_work_through_a_transaction_pooler_found_at_connect_and_waiters_poll() {
    // Fewer server connections than the clients open: transactions move
    // between server sessions, so only the simple protocol works, and the
    // semaphore table (one of its own) is created through the pooler.
    let pooler = transaction_pooler_of(2).await;
    let url = format!(
        "{}?namespace={}&semaphore_table={}&retry_interval_ms=50",
        pooler.url(),
        unique_name("pooled_sem"),
        unique_name("pooled_semaphores")
    );
    let holder = Pg::connect(&url).await;
    let waiter = Pg::connect(&url).await;
    for lock in [&holder, &waiter] {
        assert_eq!(
            lock.backend.pool_mode(),
            distlock_postgres::PoolMode::Transaction
        );
        // Nothing can wake a permit waiter through the pooler: it polls.
        assert!(semaphores(lock)
            .watch_permits(&key("x"), 1, distlock_core::OwnerToken::random())
            .await
            .unwrap()
            .is_none());
    }
    let k = key("handed-over");
    let ttl = Duration::from_secs(60);
    let mut held = Vec::new();
    for _ in 0..2 {
        let attempt = holder.try_acquire_permit(&k, 2, ttl).await.unwrap();
        held.push(attempt.lease().expect("a free permit"));
    }
    let extended = holder.extend(&held[0], ttl).await.unwrap();
    assert_eq!(extended.fencing_token(), held[0].fencing_token());
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            waiter.acquire_permit(&k, 2, ttl, deadline).await
        })
    };
    holder.release(&held[0]).await.unwrap();
    let got = waiting
        .await
        .unwrap()
        .unwrap()
        .expect("the waiter gets the returned permit long before the holder's 60 s");
    assert!(got.fencing_token() > held[1].fencing_token());
    waiter.release(&got).await.unwrap();
    holder.release(&held[1]).await.unwrap();
}
