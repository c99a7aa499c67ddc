//! The lock table's rows: keys as bind parameters, the database clock,
//! rows edited outside distlock, conflicting transactions.

use std::time::Duration;

use distlock_core::{AcquireAttempt, ErrorKind, LockState};

use super::support::*;

#[tokio::test]
async fn awkward_keys_are_bind_parameters() {
    let ns = unique_name("keys");
    let a = client(&ns).await;
    let b = client(&ns).await;
    let names = vec![
        "a".to_owned(),
        "a/b".to_owned(),
        "a:b".to_owned(),
        "a{b}".to_owned(),
        "a%2Fb".to_owned(),
        "it's".to_owned(),
        "\"quoted\"".to_owned(),
        "back\\slash\\".to_owned(),
        "'); DROP TABLE distlock_locks; --".to_owned(),
        "ünïcødé ключ 鍵 🔒".to_owned(),
        "x".repeat(512),
        "é".repeat(256),
        "$1".to_owned(),
        "%".to_owned(),
        "_".to_owned(),
    ];
    let ttl = Duration::from_secs(30);
    let mut leases = Vec::new();
    for name in &names {
        let k = key(name);
        let lease = a
            .try_acquire(&k, ttl)
            .await
            .unwrap()
            .lease()
            .unwrap_or_else(|| panic!("{name:?} is free"));
        assert!(
            matches!(
                b.try_acquire(&k, ttl).await.unwrap(),
                AcquireAttempt::Held { .. }
            ),
            "{name:?} is held"
        );
        leases.push(lease);
    }
    // Waiting works for such keys too (the key is the NOTIFY payload).
    let k = key(&"é".repeat(256));
    let mut watch = b.watch(&k).await;
    for lease in &leases {
        a.release(lease).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), watch.released())
        .await
        .expect("notified")
        .unwrap();
    for name in &names {
        let lease = b.try_acquire(&key(name), ttl).await.unwrap().lease();
        assert!(lease.is_some(), "{name:?} is free again");
    }
}

#[tokio::test]
async fn awkward_values_as_literals_reach_the_same_rows_as_bind_parameters() {
    // pool_mode=transaction sends values as literals (simple protocol); a
    // default client binds them. Both must name the same rows, so the
    // literals round-trip exactly, and none can break out of its quotes.
    let ns = unique_name("literal");
    let table = format!("{}$1\"'x", unique_name("lit"));
    let base = format!(
        "{}?namespace={}&table={}",
        server().url(),
        percent_encode(&ns),
        percent_encode(&table)
    );
    let literal = Pg::connect(&format!("{base}&pool_mode=transaction")).await;
    let bound = Pg::connect(&base).await;
    let names = [
        "it's",
        "back\\slash\\",
        "'); DROP TABLE distlock_locks; --",
        "E'\\x27'",
        "ünïcødé ключ 鍵 🔒",
        "tab\there\nnew\u{7f}\u{80}\u{ffff}",
        "$1 $2",
        "%_",
    ];
    let ttl = Duration::from_secs(30);
    for name in names {
        let k = key(name);
        let lease = take(&literal, &k, ttl, "free").await;
        match bound.inspect(&k).await.unwrap() {
            LockState::Held { fencing_token, .. } => {
                assert_eq!(fencing_token, lease.fencing_token(), "{name:?}")
            }
            state => panic!("{name:?} taken with literals, but {state:?} with bind parameters"),
        }
        let lease = literal.extend(&lease, ttl).await.unwrap();
        literal.release(&lease).await.unwrap();
        let again = take(&bound, &k, ttl, "released through literals").await;
        assert!(again.fencing_token() > lease.fencing_token(), "{name:?}");
        assert!(
            matches!(
                literal.try_acquire(&k, ttl).await.unwrap(),
                AcquireAttempt::Held { .. }
            ),
            "{name:?} held through bind parameters, seen through literals"
        );
        bound.release(&again).await.unwrap();
    }
}

#[tokio::test]
async fn expiry_uses_the_database_clock_and_is_never_revived() {
    let ns = unique_name("expiry");
    let a = client(&ns).await;
    let b = client(&ns).await;
    let k = key("short");
    let lease = take(&a, &k, Duration::from_millis(200), "free").await;
    match b.try_acquire(&k, Duration::from_secs(5)).await.unwrap() {
        AcquireAttempt::Held { expires_in } => {
            let left = expires_in.expect("the server says how long");
            assert!(left <= Duration::from_millis(200), "{left:?}");
        }
        other => panic!("expected held, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        a.extend(&lease, Duration::from_secs(5))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotHeld
    );
    assert_eq!(
        a.release(&lease).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
    let next = take(&b, &k, Duration::from_secs(5), "expired").await;
    assert!(next.fencing_token() > lease.fencing_token());
}

#[tokio::test]
async fn row_edited_into_an_impossible_state_is_reported_not_overwritten() {
    let ns = unique_name("corrupt");
    let a = client(&ns).await;
    let b = client(&ns).await;
    let table = a.table();
    let ttl = Duration::from_secs(30);

    // A foreign owner value.
    let k = key("owner");
    let lease = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    admin(
        &a,
        &format!(
            "UPDATE {table} SET owner = 'not-a-token' WHERE namespace = '{ns}' AND key = 'owner'"
        ),
    )
    .await;
    let err = b.try_acquire(&k, ttl).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.to_string().contains("owner"), "{err}");
    assert_eq!(
        a.release(&lease).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    assert_eq!(
        a.extend(&lease, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    // Expired, still never taken over.
    admin(&a, &format!("UPDATE {table} SET expires_at = now() - interval '1 hour' WHERE namespace = '{ns}' AND key = 'owner'")).await;
    assert_eq!(
        b.try_acquire(&k, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    let owner: String = sqlx::query_scalar(&format!(
        "SELECT owner FROM {table} WHERE namespace = $1 AND key = 'owner'"
    ))
    .bind(&ns)
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(owner, "not-a-token", "the foreign row is left untouched");

    // A negative fencing counter.
    let k = key("negative");
    let lease = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    admin(
        &a,
        &format!("UPDATE {table} SET fencing = -5 WHERE namespace = '{ns}' AND key = 'negative'"),
    )
    .await;
    assert_eq!(
        b.try_acquire(&k, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
    assert_eq!(
        a.release(&lease).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );

    // A fencing counter lower than the lease's (reset by hand).
    let k = key("backwards");
    let first = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    a.release(&first).await.unwrap();
    let lease = a.try_acquire(&k, ttl).await.unwrap().lease().expect("free");
    assert!(lease.fencing_token() > first.fencing_token());
    admin(&a, &format!("UPDATE {table} SET fencing = 0, owner = NULL WHERE namespace = '{ns}' AND key = 'backwards'")).await;
    let err = a.release(&lease).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.to_string().contains("backwards"), "{err}");
    assert_eq!(
        a.extend(&lease, ttl).await.unwrap_err().kind(),
        ErrorKind::Corrupted
    );
}

#[tokio::test]
async fn serializable_default_isolation_never_fails_concurrent_acquires() {
    // A database whose transactions are serializable unless they say
    // otherwise: concurrent acquires of one key conflict there (SQLSTATE
    // 40001), and such a statement was rolled back, so it can be sent again.
    let lock = serializable_client().await;
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(lock.pool())
        .await
        .unwrap();
    assert_eq!(isolation, "serializable");

    let errors = contended_rounds(&lock, 1, |lock, k| async move {
        lock.try_acquire(&k, Duration::from_secs(30)).await
    })
    .await;
    assert!(
        errors.is_empty(),
        "{} of 160 acquires failed, e.g. {:?}",
        errors.len(),
        errors.first()
    );
}

/// A batched renewal reads about as many rows as it renews: its answer
/// for each lock counted the updated rows with a subquery of its own,
/// 250,000 rows for a batch of 500 (80 ms of server time a statement in
/// the bench's renewal row, 20 statements a period at 10,000 guards); and
/// the planner, taking every batch for 100 locks, read a small table whole
/// (twice) to renew one lock.
#[tokio::test]
async fn a_batched_extend_reads_about_the_rows_it_renews() {
    const LOCKS: u64 = 500;
    let (table, ns) = (unique_name("batch"), unique_name("batch"));
    let a = Pg::connect(&format!("{}?table={table}&namespace={ns}", server().url())).await;
    for i in 0..LOCKS {
        take(&a, &key(&format!("k{i}")), Duration::from_secs(60), "fresh").await;
    }
    let qualified = format!("public.{table}");
    // Statistics as autovacuum keeps them.
    admin(&a, &format!("ANALYZE {qualified}")).await;
    let extend_many = distlock_postgres::StatementTexts::new("public", &table).extend_many;
    // A batch of the first `n` locks: its plan, and how many locks it renewed.
    let renew = |n: u64| {
        let (a, ns, qualified, extend_many) = (
            a.clone(),
            ns.clone(),
            qualified.clone(),
            extend_many.clone(),
        );
        async move {
            let batch: String = sqlx::query_scalar(&format!(
                "SELECT jsonb_agg(jsonb_build_object('n', n, 'key', key, 'owner', owner, 'fencing', fencing))::text
                 FROM (SELECT row_number() OVER (ORDER BY key) - 1 AS n, key, owner, fencing
                       FROM {qualified} WHERE namespace = $1 ORDER BY key LIMIT $2) AS r"
            ))
            .bind(&ns)
            .bind(i64::try_from(n).unwrap())
            .fetch_one(a.pool())
            .await
            .unwrap();
            let ttl_ms = 600_000 + i64::try_from(n).unwrap();
            let plan: Vec<String> =
                sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, COSTS OFF) {extend_many}"))
                    .bind(&ns)
                    .bind(batch)
                    .bind(ttl_ms)
                    .bind(i64::try_from(n).unwrap())
                    .fetch_all(a.pool())
                    .await
                    .unwrap();
            let renewed: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {qualified}
                 WHERE namespace = $1 AND expires_at > now() + $2::bigint * interval '1 millisecond' - interval '60 seconds'"
            ))
            .bind(&ns)
            .bind(ttl_ms)
            .fetch_one(a.pool())
            .await
            .unwrap();
            (plan, u64::try_from(renewed).unwrap())
        }
    };
    for (n, most) in [(1, 20), (LOCKS, 20 * LOCKS)] {
        let (plan, renewed) = renew(n).await;
        assert_eq!(renewed, n, "the batch renews each of its locks");
        let read = rows_read(&plan);
        assert!(
            read <= most,
            "a batch of {n} of {LOCKS} locks read {read} rows:\n{}",
            plan.join("\n")
        );
    }
}

/// A batched renewal (one statement for many locks, awkward keys among
/// them) answers each lock alone: a row edited into an impossible state is
/// that lock's `Corrupted`, a lock released behind its holder's back is
/// `NotHeld`, and the others are extended (and the edited row is left as
/// it was).
#[tokio::test]
async fn batched_extend_answers_each_lock_alone() {
    use distlock_core::{ExtendReply, LockBackend};
    let ns = unique_name("batch");
    let a = client(&ns).await;
    let table = a.table();
    assert!(
        a.capabilities().extend_batch > 1,
        "PostgreSQL batches renewals"
    );
    let names = ["plain", "it's", "$1", "ünïcødé 🔒", "corrupt", "released"];
    let mut leases = Vec::new();
    for name in names {
        leases.push(take(&a, &key(name), Duration::from_secs(10), "fresh").await);
    }
    admin(
        &a,
        &format!(
            "UPDATE {table} SET owner = 'not-a-token' WHERE namespace = '{ns}' AND key = 'corrupt'"
        ),
    )
    .await;
    a.release(&leases[5]).await.unwrap();
    let held: Vec<_> = leases.iter().map(|l| l.held()).collect();
    let replies = a
        .backend
        .extend_many(&held, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(replies.len(), names.len());
    for (name, reply) in names.iter().zip(&replies).take(4) {
        assert!(
            matches!(reply, Ok(ExtendReply::Extended(_))),
            "{name}: {reply:?}"
        );
    }
    assert!(
        matches!(&replies[4], Err(e) if e.kind() == ErrorKind::Corrupted),
        "the edited row: {:?}",
        replies[4]
    );
    assert!(
        matches!(replies[5], Ok(ExtendReply::NotHeld)),
        "the released lock: {:?}",
        replies[5]
    );
    for name in &names[..4] {
        let left: f64 = sqlx::query_scalar(&format!(
            "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM {table} WHERE namespace = $1 AND key = $2"
        ))
        .bind(&ns)
        .bind(*name)
        .fetch_one(a.pool())
        .await
        .unwrap();
        assert!(left > 10.0, "{name} was not extended: {left} s left");
    }
    let owner: String = sqlx::query_scalar(&format!(
        "SELECT owner FROM {table} WHERE namespace = $1 AND key = 'corrupt'"
    ))
    .bind(&ns)
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(owner, "not-a-token", "the edited row is left untouched");
}
