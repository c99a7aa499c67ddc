//! The format marker of a lock table and namespace, a row of
//! `distlock_format`: stored at the first connect, accepted when it names
//! this client's format, refused (with both numbers) when it names another,
//! reported as corrupted (and left alone) when it holds anything else.

use distlock_core::{ErrorKind, LockError, STORAGE_FORMAT};
use distlock_postgres::PostgresLock;

use super::support::*;

/// The marker of `ns` in the default lock table, read as the superuser.
async fn marker(admin: &Pg, ns: &str) -> Option<String> {
    sqlx::query_scalar(
        "SELECT format FROM public.distlock_format WHERE lock_table = 'distlock_locks' AND namespace = $1",
    )
    .bind(ns)
    .fetch_optional(admin.pool())
    .await
    .unwrap()
}

/// Sets the marker of `ns` to `value`.
async fn set_marker(admin: &Pg, ns: &str, value: &str) {
    sqlx::query(
        "INSERT INTO public.distlock_format (lock_table, namespace, format) \
         VALUES ('distlock_locks', $1, $2) \
         ON CONFLICT (lock_table, namespace) DO UPDATE SET format = excluded.format",
    )
    .bind(ns)
    .bind(value)
    .execute(admin.pool())
    .await
    .unwrap();
}

async fn connect_ns(url: &str, ns: &str) -> Result<PostgresLock, LockError> {
    PostgresLock::connect(&format!("{url}?namespace={ns}")).await
}

#[tokio::test]
async fn the_first_connect_stores_the_marker_even_through_a_transaction_pooler() {
    let admin = client(&unique_name("fmtadmin")).await;
    let pooler = transaction_pooler_of(2).await;
    let ns = unique_name("fmt");
    assert_eq!(marker(&admin, &ns).await, None);

    // Several clients at once, through the pooler: one stores the marker,
    // all connect.
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (url, ns) = (pooler.url(), ns.clone());
            tokio::spawn(async move { connect_ns(&url, &ns).await })
        })
        .collect();
    for client in clients {
        client
            .await
            .unwrap()
            .expect("every concurrent connect succeeds");
    }
    assert_eq!(marker(&admin, &ns).await, Some(STORAGE_FORMAT.to_string()));
    connect_ns(&server().url(), &ns)
        .await
        .expect("a later connect accepts the marker");
}

#[tokio::test]
async fn another_format_number_is_refused_naming_both() {
    let admin = client(&unique_name("fmtadmin")).await;
    let ns = unique_name("fmt");
    for (value, word) in [("2", "newer"), ("0", "older")] {
        set_marker(&admin, &ns, value).await;
        let err = connect_ns(&server().url(), &ns).await.expect_err(value);
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("format {value}")), "{text}");
        assert!(text.contains(&format!("format {STORAGE_FORMAT}")), "{text}");
        assert!(
            text.contains("distlock_format") && text.contains(&ns),
            "{text}"
        );
        assert!(text.contains(word), "{text}");
        assert_eq!(marker(&admin, &ns).await.as_deref(), Some(value));
    }
}

#[tokio::test]
async fn foreign_data_at_the_marker_is_corrupted_and_left_alone() {
    let admin = client(&unique_name("fmtadmin")).await;
    let ns = unique_name("fmt");
    for value in ["v1", "", "1 "] {
        set_marker(&admin, &ns, value).await;
        let err = connect_ns(&server().url(), &ns).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupted, "{value:?}: {err}");
        assert!(err.to_string().contains("distlock_format"), "{err}");
        assert_eq!(marker(&admin, &ns).await.as_deref(), Some(value));
    }
}

#[tokio::test]
async fn a_client_over_an_application_pool_checks_the_marker_at_first_use() {
    let admin = client(&unique_name("fmtadmin")).await;
    let ns = unique_name("fmt");
    set_marker(&admin, &ns, "2").await;
    let config =
        distlock_postgres::PostgresConfig::from_url(&format!("{}?namespace={ns}", server().url()))
            .unwrap();
    let lock = Pg::new(PostgresLock::from_pool(admin.pool().clone(), config).unwrap());
    let err = lock
        .try_acquire(&key("fmt"), std::time::Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("format 2"), "{err}");
}
