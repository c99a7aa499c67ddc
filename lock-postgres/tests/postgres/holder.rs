//! Holder labels in the lock table: bound to the owner token that stored
//! them (an older client's takeover never shows the label it did not
//! write), added to a table of an earlier version, and a role that may not
//! add them works without labels.

use std::time::Duration;

use distlock_core::{
    AcquireReply, AcquireRequest, HolderId, LockBackend, LockKey, LockState, OwnerToken,
    PermitReply, PermitRequest, SemaphoreBackend,
};

use super::support::*;

/// Acquires `k` (free) for `owner` with `label`, directly on the backend.
async fn acquire_labelled(lock: &Pg, k: &LockKey, owner: OwnerToken, label: Option<&HolderId>) {
    let reply = lock
        .backend
        .acquire(AcquireRequest {
            key: k,
            owner,
            ttl: Duration::from_secs(30),
            renewing: false,
            settling: false,
            holder: label,
        })
        .await
        .unwrap();
    assert!(matches!(reply, AcquireReply::Granted(_)), "{reply:?}");
}

/// The label `inspect` shows for `k`, which must be held.
async fn shown(lock: &Pg, k: &LockKey) -> Option<HolderId> {
    match lock.inspect(k).await.unwrap() {
        LockState::Held { holder, .. } => holder,
        LockState::Free => panic!("{k:?} is held"),
    }
}

/// Runs `UPDATE ... SET {set}` on the row of `k`, as the superuser.
async fn set_row(lock: &Pg, k: &LockKey, set: &str) {
    sqlx::query(&format!(
        "UPDATE {} SET {set} WHERE namespace = $1 AND key = $2",
        lock.table()
    ))
    .bind(lock.backend.config().client().namespace())
    .bind(k.as_str())
    .execute(lock.pool())
    .await
    .unwrap_or_else(|e| panic!("SET {set}: {e}"));
}

/// Lets the lock on `k` expire now.
async fn expire(lock: &Pg, k: &LockKey) {
    set_row(
        lock,
        k,
        "expires_at = clock_timestamp() - interval '1 second'",
    )
    .await;
}

/// Whether `table` (unquoted, in `public`) has both holder columns.
async fn has_holder_columns(lock: &Pg, table: &str) -> bool {
    sqlx::query_scalar(
        "SELECT count(*) = 2 FROM pg_attribute
         WHERE attrelid = to_regclass($1) AND NOT attisdropped
           AND attname IN ('holder', 'holder_owner')",
    )
    .bind(format!("public.{table}"))
    .fetch_one(lock.pool())
    .await
    .unwrap()
}

/// Creates `public.{table}` as versions before holder labels did.
async fn create_old_table(admin_client: &Pg, table: &str) {
    admin(
        admin_client,
        &format!(
            "CREATE TABLE public.{table} (namespace text NOT NULL, key text NOT NULL, owner text,
                 fencing bigint NOT NULL, expires_at timestamptz NOT NULL, PRIMARY KEY (namespace, key))"
        ),
    )
    .await;
}

#[tokio::test]
async fn a_label_left_by_an_earlier_owner_is_not_shown() {
    let lock = client(&unique_name("holder")).await;
    assert!(lock.backend.capabilities().holder_ids);
    let k = key("labelled");
    let label = HolderId::new("worker-1:42").unwrap();
    let owner = OwnerToken::random();
    acquire_labelled(&lock, &k, owner, Some(&label)).await;
    assert_eq!(shown(&lock, &k).await, Some(label.clone()));
    let (stored, by): (Option<String>, Option<String>) = sqlx::query_as(&format!(
        "SELECT holder, holder_owner FROM {} WHERE namespace = $1 AND key = $2",
        lock.table()
    ))
    .bind(lock.backend.config().client().namespace())
    .bind(k.as_str())
    .fetch_one(lock.pool())
    .await
    .unwrap();
    assert_eq!(stored.as_deref(), Some(label.as_str()));
    assert_eq!(by, Some(owner.to_hex()), "stored with its owner token");

    // The lock expires and a client of an earlier version takes it over:
    // its acquire writes owner, fencing and expiry, and leaves the label
    // columns as they were.
    let intruder = OwnerToken::random();
    set_row(
        &lock,
        &k,
        &format!(
            "owner = '{}', fencing = fencing + 1,
             expires_at = clock_timestamp() + interval '30 seconds'",
            intruder.to_hex()
        ),
    )
    .await;
    assert_eq!(
        shown(&lock, &k).await,
        None,
        "the earlier owner's label is shown for the new holder"
    );

    // A labelled acquisition of this version after it shows its own.
    expire(&lock, &k).await;
    let other = HolderId::new("worker-2:7").unwrap();
    acquire_labelled(&lock, &k, OwnerToken::random(), Some(&other)).await;
    assert_eq!(shown(&lock, &k).await, Some(other));
    // And one without a label clears it.
    expire(&lock, &k).await;
    acquire_labelled(&lock, &k, OwnerToken::random(), None).await;
    assert_eq!(shown(&lock, &k).await, None);
}

#[tokio::test]
async fn a_label_distlock_did_not_write_is_reported_as_corrupted() {
    let lock = client(&unique_name("holder")).await;
    let k = key("edited");
    let owner = OwnerToken::random();
    let label = HolderId::new("worker-1:42").unwrap();
    acquire_labelled(&lock, &k, owner, Some(&label)).await;
    set_row(&lock, &k, "holder = E'two\\nlines'").await;
    let error = lock.inspect(&k).await.unwrap_err();
    assert_eq!(error.kind(), distlock_core::ErrorKind::Corrupted, "{error}");
    assert!(error.to_string().contains("holder label"), "{error}");
}

#[tokio::test]
async fn a_table_of_the_previous_version_gets_the_holder_columns() {
    let admin_client = client("holder-admin").await;
    let table = unique_name("old_holder");
    create_old_table(&admin_client, &table).await;
    assert!(!has_holder_columns(&admin_client, &table).await);
    let lock = Pg::connect(&format!(
        "{}?namespace=old&table={table}&semaphore_table={table}_sem",
        server().url()
    ))
    .await;
    assert!(has_holder_columns(&lock, &table).await, "columns added");
    assert!(lock.backend.capabilities().holder_ids);
    let k = key("k");
    let label = HolderId::new("pod-é 3").unwrap();
    acquire_labelled(&lock, &k, OwnerToken::random(), Some(&label)).await;
    assert_eq!(shown(&lock, &k).await, Some(label));
}

#[tokio::test]
async fn a_role_that_may_not_add_the_columns_works_without_labels() {
    let admin_client = client("holder-admin").await;
    let table = unique_name("old_holder_ro");
    create_old_table(&admin_client, &table).await;
    let role = unique_name("distlock_noalter");
    for sql in [
        format!("CREATE ROLE {role} LOGIN PASSWORD 'pw'"),
        format!("GRANT USAGE ON SCHEMA public TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON public.{table} TO {role}"),
        format!("GRANT SELECT, INSERT ON public.distlock_format TO {role}"),
    ] {
        admin(&admin_client, &sql).await;
    }
    let lock = Pg::connect(&format!(
        "{}?namespace=ro&table={table}&semaphore_table={table}_sem",
        url_with_user(&role, "pw")
    ))
    .await;
    assert!(!has_holder_columns(&admin_client, &table).await);
    assert!(
        !lock.backend.capabilities().holder_ids,
        "no columns, no labels"
    );
    let k = key("k");
    let label = HolderId::new("worker-1:42").unwrap();
    acquire_labelled(&lock, &k, OwnerToken::random(), Some(&label)).await;
    assert_eq!(shown(&lock, &k).await, None, "not stored");
    // No label, nothing for observers to follow: they read.
    assert!(!lock.backend.capabilities().holder_watch);
    let watch = lock
        .backend
        .admin()
        .unwrap()
        .watch_holder(&k)
        .await
        .unwrap();
    assert!(watch.is_none(), "no observers' watch without labels");
    // The release statements name no holder column here.
    let lease = take(&lock, &key("k-released"), Duration::from_secs(30), "free").await;
    lock.release(&lease)
        .await
        .expect("released on the old table");

    // Once the table's owner adds them, the role's next client stores labels.
    admin(
        &admin_client,
        &format!("ALTER TABLE public.{table} ADD COLUMN holder text, ADD COLUMN holder_owner text"),
    )
    .await;
    let next = Pg::connect(&format!(
        "{}?namespace=ro&table={table}&semaphore_table={table}_sem",
        url_with_user(&role, "pw")
    ))
    .await;
    assert!(next.backend.capabilities().holder_ids);
    assert!(next.backend.capabilities().holder_watch);
    let k = key("k2");
    acquire_labelled(&next, &k, OwnerToken::random(), Some(&label)).await;
    assert_eq!(shown(&next, &k).await, Some(label));
}

/// Takes a permit of `k` (limit 3) for `owner` with `label`, directly on
/// the backend; returns its fencing token.
async fn permit_labelled(
    lock: &Pg,
    k: &LockKey,
    owner: OwnerToken,
    label: Option<&HolderId>,
) -> distlock_core::FencingToken {
    let reply = lock
        .backend
        .acquire_permit(PermitRequest {
            key: k,
            owner,
            ttl: Duration::from_secs(30),
            limit: 3,
            renewing: false,
            settling: false,
            holder: label,
        })
        .await
        .unwrap();
    match reply {
        PermitReply::Granted(grant) => grant.fencing,
        other => panic!("{k:?} has room, yet {other:?}"),
    }
}

/// The labels `inspect_permits` shows for `k`, oldest first.
async fn permit_labels(lock: &Pg, k: &LockKey) -> Vec<Option<HolderId>> {
    let permits = lock.inspect_permits(k).await.unwrap();
    permits.into_iter().map(|p| p.holder).collect()
}

/// The `holders` column of `k`'s semaphore row, as text.
async fn holders_of(lock: &Pg, k: &LockKey) -> Option<String> {
    sqlx::query_scalar(&format!(
        "SELECT holders::text FROM {} WHERE namespace = $1 AND key = $2",
        lock.semaphore_table()
    ))
    .bind(lock.backend.config().client().namespace())
    .bind(k.as_str())
    .fetch_one(lock.pool())
    .await
    .unwrap()
}

/// Creates `public.{table}` as semaphore tables were before permit labels.
async fn create_old_semaphore_table(admin_client: &Pg, table: &str) {
    admin(
        admin_client,
        &format!(
            "CREATE TABLE public.{table} (namespace text NOT NULL, key text NOT NULL,
                 permit_limit bigint NOT NULL, fencing bigint NOT NULL, owners text[] NOT NULL,
                 fencings bigint[] NOT NULL, expires timestamptz[] NOT NULL,
                 updated_at timestamptz NOT NULL, PRIMARY KEY (namespace, key))"
        ),
    )
    .await;
}

/// A permit's label is stored under its owner token in the row's
/// `holders`, dropped when the permit is released (and with permits no
/// longer live), and shown only for that permit; a label an older client
/// left behind, or anything else in `holders`, is never shown for another
/// permit and stops nothing.
#[tokio::test]
async fn permit_labels_go_with_their_permits() {
    let lock = client(&unique_name("permit_holder")).await;
    assert!(lock.backend.capabilities().permit_holder_ids);
    let k = key("permits");
    let (a, b) = (
        HolderId::new("worker-a:1").unwrap(),
        HolderId::new("worker-b:2").unwrap(),
    );
    let owner_a = OwnerToken::random();
    let token_a = permit_labelled(&lock, &k, owner_a, Some(&a)).await;
    permit_labelled(&lock, &k, OwnerToken::random(), None).await;
    assert_eq!(permit_labels(&lock, &k).await, vec![Some(a.clone()), None]);
    let released = lock
        .backend
        .release_permit(distlock_core::HeldLock {
            key: &k,
            owner: owner_a,
            fencing: token_a,
            handle: 1,
        })
        .await
        .unwrap();
    assert_eq!(released, distlock_core::ReleaseReply::Released);
    assert_eq!(
        holders_of(&lock, &k).await.as_deref(),
        Some("{}"),
        "a's label dropped"
    );
    assert_eq!(permit_labels(&lock, &k).await, vec![None]);

    // Left by an older client for an owner whose permit is gone, and
    // garbage under a live permit's owner: never shown.
    let owner_b = OwnerToken::random();
    permit_labelled(&lock, &k, owner_b, Some(&b)).await;
    let set = |holders: String| {
        let lock = lock.clone();
        let k = k.clone();
        async move {
            admin(
                &lock,
                &format!(
                    "UPDATE {} SET holders = '{holders}'::jsonb WHERE namespace = '{}' AND key = '{}'",
                    lock.semaphore_table(),
                    lock.backend.config().client().namespace(),
                    k.as_str()
                ),
            )
            .await
        }
    };
    let b_hex = owner_b.to_hex();
    for holders in [
        format!(r#"{{"{}": "ghost"}}"#, OwnerToken::random().to_hex()),
        format!(r#"{{"{b_hex}": 7}}"#),
        format!(r#"{{"{b_hex}": "two\nlines"}}"#),
        r#"["not", "an", "object"]"#.to_owned(),
        "42".to_owned(),
    ] {
        set(holders.clone()).await;
        assert_eq!(
            permit_labels(&lock, &k).await,
            vec![None, None],
            "{holders}"
        );
        // A labelled permit over it works, and shows its own label.
        let owner = OwnerToken::random();
        let token = permit_labelled(&lock, &k, owner, Some(&a)).await;
        assert_eq!(
            permit_labels(&lock, &k).await,
            vec![None, None, Some(a.clone())],
            "{holders}"
        );
        let released = lock
            .backend
            .release_permit(distlock_core::HeldLock {
                key: &k,
                owner,
                fencing: token,
                handle: 1,
            })
            .await
            .unwrap();
        assert_eq!(released, distlock_core::ReleaseReply::Released, "{holders}");
    }
}

/// A semaphore table of the previous version gets the `holders` column;
/// a role that may not add it works without permit labels (granted, not
/// stored, none shown), and its next client stores them once the table's
/// owner added it.
#[tokio::test]
async fn an_old_semaphore_table_gets_the_holders_column_or_works_without() {
    let admin_client = client("permit-holder-admin").await;
    let lock_table = unique_name("perm_locks");
    let table = unique_name("old_sem");
    let role = unique_name("distlock_noalter_sem");
    // The lock table as this version makes it (the role may not alter it
    // either, but it needs nothing added).
    let owner = Pg::connect(&format!(
        "{}?namespace=setup&table={lock_table}&semaphore_table={table}_unused",
        server().url()
    ))
    .await;
    drop(owner);
    create_old_semaphore_table(&admin_client, &table).await;
    for sql in [
        format!("CREATE ROLE {role} LOGIN PASSWORD 'pw'"),
        format!("GRANT USAGE ON SCHEMA public TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON public.{lock_table} TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON public.{table} TO {role}"),
        format!("GRANT SELECT, INSERT ON public.distlock_format TO {role}"),
    ] {
        admin(&admin_client, &sql).await;
    }
    let url = format!(
        "{}?namespace=ro&table={lock_table}&semaphore_table={table}",
        url_with_user(&role, "pw")
    );
    let label = HolderId::new("worker-1:42").unwrap();
    let lock = Pg::connect(&url).await;
    assert!(
        !lock.backend.capabilities().permit_holder_ids,
        "no column, no labels"
    );
    let k = key("k");
    permit_labelled(&lock, &k, OwnerToken::random(), Some(&label)).await;
    assert_eq!(permit_labels(&lock, &k).await, vec![None], "not stored");

    // The table's owner (here the superuser) connecting adds it.
    let added = Pg::connect(&format!(
        "{}?namespace=ro&table={lock_table}&semaphore_table={table}",
        server().url()
    ))
    .await;
    assert!(
        added.backend.capabilities().permit_holder_ids,
        "column added"
    );
    let next = Pg::connect(&url).await;
    assert!(next.backend.capabilities().permit_holder_ids);
    // The unlabelled client's permit is still there, without a label.
    permit_labelled(&next, &k, OwnerToken::random(), Some(&label)).await;
    assert_eq!(permit_labels(&next, &k).await, vec![None, Some(label)]);
}
