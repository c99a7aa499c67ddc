//! Bounded server state: rows nobody has held for the fencing retention
//! are deleted by the clients' sweep, tokens stay strictly increasing
//! across it, and held rows are never deleted.

use std::time::{Duration, Instant};

use distlock_core::{Lease, LockKey, LockState};

use super::support::*;

/// A client in a fresh namespace whose fencing counters are kept `ms`.
async fn retaining(ms: u64) -> Pg {
    let ns = unique_name("reclaim");
    Pg::connect(&format!(
        "{}?namespace={ns}&fence_retention_ms={ms}",
        server().url()
    ))
    .await
}

/// How many rows of `lock`'s namespace in `table` have a key starting with
/// `prefix`.
async fn rows(lock: &Pg, table: &str, prefix: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE namespace = $1 AND starts_with(key, $2)"
    ))
    .bind(lock.backend.config().client().namespace())
    .bind(prefix)
    .fetch_one(lock.pool())
    .await
    .unwrap()
}

/// Takes a permit of `k`'s semaphore of `limit` for `ttl`, which must be
/// free (`why` says why it must).
async fn take_permit(lock: &Pg, k: &LockKey, limit: u32, ttl: Duration, why: &str) -> Lease {
    lock.try_acquire_permit(k, limit, ttl)
        .await
        .unwrap()
        .lease()
        .expect(why)
}

/// Acquires and releases lock (and permit) `poke` of `lock` until `done`
/// says so: a sweep starts from acquisitions. Fails only if it never does.
async fn until<F, Fut>(lock: &Pg, what: &str, done: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(120);
    let poke = key("poke");
    while !done().await {
        assert!(Instant::now() < deadline, "never: {what}");
        let lease = take(lock, &poke, Duration::from_secs(30), "poke is free").await;
        lock.release(&lease).await.unwrap();
        let permit = take_permit(
            lock,
            &poke,
            1,
            Duration::from_secs(30),
            "the poke permit is free",
        )
        .await;
        lock.release(&permit).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn rows_nobody_holds_are_reclaimed_after_the_retention() {
    let lock = retaining(200).await;
    let ttl = Duration::from_secs(30);
    for i in 0..120 {
        let k = key(&format!("job-{i}"));
        let lease = take(&lock, &k, ttl, "a new key is free").await;
        lock.release(&lease).await.unwrap();
    }
    // One lock left to expire rather than released.
    take(&lock, &key("job-expired"), Duration::from_millis(1), "free").await;
    for i in 0..10 {
        let k = key(&format!("sem-{i}"));
        let permit = take_permit(&lock, &k, 2, ttl, "a new semaphore has a permit free").await;
        lock.release(&permit).await.unwrap();
    }
    let (table, semaphores) = (lock.table(), lock.semaphore_table());
    // At most these: on a slow machine a sweep may already have taken the
    // first ones (they are older than the retention), so not exactly.
    assert!(rows(&lock, &table, "job-").await <= 121);
    assert!(rows(&lock, &semaphores, "sem-").await <= 10);
    until(
        &lock,
        "the idle lock and semaphore rows were deleted",
        || async {
            rows(&lock, &table, "job-").await == 0 && rows(&lock, &semaphores, "sem-").await == 0
        },
    )
    .await;
}

/// One sweep deletes every row idle for the retention, however many: a
/// namespace whose keys go idle faster than a capped sweep deletes them
/// (5,000 rows an interval and client, before) grew without bound. 6,000
/// keys are fired by a client whose sweeps keep rows an hour; then one
/// acquisition of a client keeping them 200 ms starts its first sweep, and
/// no acquisition after it starts another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sweep_deletes_every_idle_row() {
    const KEYS: usize = 6_000;
    let ns = unique_name("reclaim");
    let url = |ms: u64| format!("{}?namespace={ns}&fence_retention_ms={ms}", server().url());
    let firing = Pg::connect(&url(3_600_000)).await;
    let ttl = Duration::from_secs(30);
    let mut tasks = Vec::new();
    for t in 0..16 {
        let firing = firing.clone();
        tasks.push(tokio::spawn(async move {
            for i in (t..KEYS).step_by(16) {
                let k = key(&format!("fired-{i}"));
                let lease = take(&firing, &k, ttl, "a new key is free").await;
                firing.release(&lease).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let table = firing.table();
    assert_eq!(rows(&firing, &table, "fired-").await, KEYS as i64);
    // Past the sweeping client's retention.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let sweeping = Pg::connect(&url(200)).await;
    let lease = take(&sweeping, &key("poke"), ttl, "poke is free").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut left = rows(&sweeping, &table, "fired-").await;
    while left > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        left = rows(&sweeping, &table, "fired-").await;
    }
    assert_eq!(left, 0, "idle rows left after the sweep");
    sweeping.release(&lease).await.unwrap();
}

/// A sweep batch reads about the rows it deletes, whatever the table's
/// statistics say. Taken while the namespace had no rows (a table analyzed
/// before a scheduler fired its keys), they put it at a row, and the
/// planner scanned every idle row of the namespace for each row of the
/// batch: 100 batches over 10,000 idle rows made a sweep take seconds, and
/// the bench's state row ended with thousands of rows left.
#[tokio::test]
async fn a_sweep_batch_reads_about_the_rows_it_deletes_whatever_the_statistics() {
    sweep_batch_reads_about_what_it_deletes(Swept::Locks).await;
}

/// The same for the semaphore table, whose sweep has its own idle test
/// (no permit live or expired within the retention).
#[tokio::test]
async fn a_permit_sweep_batch_reads_about_the_rows_it_deletes_whatever_the_statistics() {
    sweep_batch_reads_about_what_it_deletes(Swept::Semaphores).await;
}

/// Which table a sweep test sweeps.
#[derive(Clone, Copy)]
enum Swept {
    Locks,
    Semaphores,
}

async fn sweep_batch_reads_about_what_it_deletes(swept: Swept) {
    const IDLE: u64 = 2_000;
    let (table, semaphores, ns) = (
        unique_name("stale"),
        unique_name("stale_sem"),
        unique_name("reclaim"),
    );
    let lock = Pg::connect(&format!(
        "{}?table={table}&semaphore_table={semaphores}&namespace={ns}",
        server().url()
    ))
    .await;
    // Idle rows as distlock leaves them: released an hour ago.
    let old = "floor(extract(epoch FROM now() - interval '1 hour') * 1000000)::bigint + g";
    let (swept_table, sweep, insert) = match swept {
        Swept::Locks => (
            table.clone(),
            distlock_postgres::StatementTexts::new("public", &table).sweep,
            format!(
                "(namespace, key, owner, fencing, expires_at)
                 SELECT '{ns}', 'fired-' || g, NULL, {old}, now() - interval '1 hour'"
            ),
        ),
        Swept::Semaphores => (
            semaphores.clone(),
            distlock_postgres::PermitStatementTexts::new("public", &semaphores).sweep,
            format!(
                "(namespace, key, permit_limit, fencing, owners, fencings, expires, updated_at)
                 SELECT '{ns}', 'fired-' || g, 2, {old}, '{{}}', '{{}}', '{{}}',
                        now() - interval '1 hour'"
            ),
        ),
    };
    let qualified = format!("public.{swept_table}");
    // Statistics of the empty namespace, kept (no autovacuum on this table).
    admin(
        &lock,
        &format!("ALTER TABLE {qualified} SET (autovacuum_enabled = false)"),
    )
    .await;
    admin(&lock, &format!("ANALYZE {qualified}")).await;
    admin(
        &lock,
        &format!("INSERT INTO {qualified} {insert} FROM generate_series(1, {IDLE}) AS g"),
    )
    .await;
    let mut conn = lock.pool().acquire().await.unwrap();
    // Prepared, the statement is planned for its values at first and may
    // later get one plan for any values: both.
    for (done, plans) in [(100, "force_custom_plan"), (200, "force_generic_plan")] {
        sqlx::query(&format!("SET plan_cache_mode = {plans}"))
            .execute(&mut *conn)
            .await
            .unwrap();
        let plan: Vec<String> =
            sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, COSTS OFF) {sweep}"))
                .bind(&ns)
                .bind(2_000_i64)
                .bind(100_i64)
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        let left = rows(&lock, &qualified, "fired-").await;
        assert_eq!(left, (IDLE - done) as i64, "each batch deletes 100 rows");
        let read = rows_read(&plan);
        assert!(
            read <= 1_000,
            "one batch ({plans}) of {qualified} read {read} rows to delete 100 of {IDLE}:\n{}",
            plan.join("\n")
        );
    }
    sqlx::query("RESET plan_cache_mode")
        .execute(&mut *conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_reclaimed_key_gets_a_greater_token_than_its_last() {
    let lock = retaining(200).await;
    let ttl = Duration::from_secs(30);
    let k = key("again");
    let (table, semaphores) = (lock.table(), lock.semaphore_table());

    let first = take(&lock, &k, ttl, "free").await;
    lock.release(&first).await.unwrap();
    let permit = take_permit(&lock, &k, 1, ttl, "free").await;
    lock.release(&permit).await.unwrap();
    until(&lock, "the rows of the key were deleted", || async {
        rows(&lock, &table, "again").await == 0 && rows(&lock, &semaphores, "again").await == 0
    })
    .await;

    let second = take(&lock, &k, ttl, "free").await;
    assert!(
        second.fencing_token() > first.fencing_token(),
        "token {} after reclamation is not above {}",
        second.fencing_token(),
        first.fencing_token()
    );
    let next = take_permit(&lock, &k, 1, ttl, "free").await;
    assert!(next.fencing_token() > permit.fencing_token());
    lock.release(&second).await.unwrap();
    lock.release(&next).await.unwrap();
}

#[tokio::test]
async fn held_locks_and_permits_are_never_reclaimed() {
    // The retention is far shorter than the TTLs.
    let lock = retaining(200).await;
    let ttl = Duration::from_secs(60);
    let (table, semaphores) = (lock.table(), lock.semaphore_table());
    let held = key("held");
    let lease = take(&lock, &held, ttl, "free").await;
    // A semaphore with one permit held and one returned.
    let sem = key("held-sem");
    let permit = take_permit(&lock, &sem, 2, ttl, "free").await;
    let returned = take_permit(&lock, &sem, 2, ttl, "a second permit is free").await;
    lock.release(&returned).await.unwrap();
    // Canaries acquired after them: once the sweep deleted these, it has
    // passed over the held rows with counters older than theirs.
    let canary = key("canary");
    let lease_c = take(&lock, &canary, ttl, "free").await;
    lock.release(&lease_c).await.unwrap();
    let permit_c = take_permit(&lock, &canary, 1, ttl, "free").await;
    lock.release(&permit_c).await.unwrap();
    until(&lock, "the canary rows were deleted", || async {
        rows(&lock, &table, "canary").await == 0 && rows(&lock, &semaphores, "canary").await == 0
    })
    .await;

    assert_eq!(rows(&lock, &table, "held").await, 1);
    assert_eq!(rows(&lock, &semaphores, "held-sem").await, 1);
    match lock.inspect(&held).await.unwrap() {
        LockState::Held { fencing_token, .. } => {
            assert_eq!(fencing_token, lease.fencing_token())
        }
        other => panic!("the held lock is gone: {other:?}"),
    }
    let lease = lock.extend(&lease, ttl).await.expect("still held");
    let permit = lock.extend(&permit, ttl).await.expect("still held");
    lock.release(&lease).await.unwrap();
    lock.release(&permit).await.unwrap();
}

#[tokio::test]
async fn a_table_of_the_previous_version_gets_the_sweep_index() {
    let admin_client = client("reclaim-admin").await;
    let table = unique_name("old_locks");
    // The lock table as the previous version created it: no index on
    // fencing.
    admin(
        &admin_client,
        &format!(
            "CREATE TABLE public.{table} (namespace text NOT NULL, key text NOT NULL, owner text,
                 fencing bigint NOT NULL, expires_at timestamptz NOT NULL, PRIMARY KEY (namespace, key))"
        ),
    )
    .await;
    admin(
        &admin_client,
        &format!("INSERT INTO public.{table} VALUES ('old', 'k', NULL, 7, '2000-01-01')"),
    )
    .await;
    let lock = Pg::connect(&format!(
        "{}?namespace=old&table={table}&semaphore_table={table}_sem",
        server().url()
    ))
    .await;
    let index: Option<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' AND indexname = $1",
    )
    .bind(format!("{table}_fencing"))
    .fetch_optional(lock.pool())
    .await
    .unwrap();
    let index = index.expect("the sweep index was created on the existing table");
    assert!(index.contains("(namespace, fencing)"), "{index}");
    // The old row's small counter is no obstacle to a strictly greater
    // token.
    let lease = take(
        &lock,
        &LockKey::new("k").unwrap(),
        Duration::from_secs(5),
        "free",
    )
    .await;
    assert!(lease.fencing_token().get() > 7);
    lock.release(&lease).await.unwrap();
}
