//! Connecting: URLs, credentials, table creation, an unreachable server.

use std::time::Duration;

use distlock_core::ErrorKind;
use distlock_postgres::{PostgresConfig, PostgresLock};

use super::support::*;

#[tokio::test]
async fn password_authentication_through_the_url() {
    let admin_client = client("auth").await;
    let role = unique_name("distlock_role");
    let password = format!("pw'{}\\x", rand::random::<u32>());
    let escaped = password.replace('\'', "''");
    admin(
        &admin_client,
        &format!("CREATE ROLE {role} LOGIN PASSWORD '{escaped}'"),
    )
    .await;
    admin(
        &admin_client,
        &format!("GRANT CREATE, USAGE ON SCHEMA public TO {role}"),
    )
    .await;
    // The format markers' table exists already (the superuser's client
    // made it): a role needs to read and add rows there, as the docs say.
    admin(
        &admin_client,
        &format!("GRANT SELECT, INSERT ON public.distlock_format TO {role}"),
    )
    .await;
    let table = unique_name("auth_locks");
    let encoded = percent_encode(&password);
    let url = format!("{}?table={table}", url_with_user(&role, &encoded));
    let lock = Pg::new(
        PostgresLock::connect(&url)
            .await
            .expect("the role connects with its password"),
    );
    let k = key("auth");
    let lease = take(&lock, &k, Duration::from_secs(5), "free").await;
    lock.release(&lease).await.unwrap();

    let wrong = format!("{}?table={table}", url_with_user(&role, "not-the-password"));
    let err = PostgresLock::connect(&wrong).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(
        err.to_string().contains("authentication failed")
            && err.to_string().contains("user and password"),
        "{err}"
    );
    let no_password = format!("postgres://{role}@{}?table={table}", server_rest());
    let err = PostgresLock::connect(&no_password).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    let unknown = format!("{}?table={table}", url_with_user("no_such_role", "x"));
    let err = PostgresLock::connect(&unknown).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
}

#[tokio::test]
async fn many_clients_create_the_table_at_once() {
    let table = unique_name("race");
    let base = server().url();
    let connects = (0..8).map(|i| {
        let url = format!("{base}?table={table}&namespace=n{i}");
        tokio::spawn(async move { PostgresLock::connect(&url).await })
    });
    for task in connects {
        let lock = Pg::new(
            task.await
                .unwrap()
                .expect("connect while others create the table"),
        );
        let lease = take(&lock, &key("k"), Duration::from_secs(5), "free").await;
        lock.release(&lease).await.unwrap();
    }
}

#[tokio::test]
async fn schema_and_table_are_configurable_and_quoted() {
    let schema = unique_name("Sch\"ema");
    let url = server().url();
    let config = PostgresConfig::from_url(&url)
        .unwrap()
        .with_schema(schema.clone())
        .with_table("my \"locks\"");
    let config = config
        .clone()
        .with_client(config.client().clone().with_namespace("cfg"));
    let lock = Pg::with_config(config).await;
    assert_eq!(lock.backend.config().schema(), schema);
    let lease = take(&lock, &key("k"), Duration::from_secs(5), "free").await;
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE owner IS NOT NULL",
        lock.table()
    ))
    .fetch_one(lock.pool())
    .await
    .unwrap();
    assert_eq!(n, 1);
    lock.release(&lease).await.unwrap();
}

#[tokio::test]
async fn unreachable_server_is_unavailable_in_bounded_time() {
    let port = distlock_conformance::server::free_port().unwrap();
    let url =
        format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres?connect_timeout_ms=500");
    let err = PostgresLock::connect(&url).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test]
async fn url_parameters_reach_sqlx_and_unknown_ones_are_refused() {
    let url = format!(
        "{}?namespace=params&sslmode=disable&application_name=distlock%20test",
        server().url()
    );
    let lock = Pg::connect(&url).await;
    let name: String = sqlx::query_scalar("SHOW application_name")
        .fetch_one(lock.pool())
        .await
        .unwrap();
    assert_eq!(name, "distlock test");

    let typo = format!("{}?namespace=params&tabel=locks", server().url());
    let err = PostgresLock::connect(&typo).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("tabel"), "{err}");
    assert!(!err.to_string().contains(":postgres@"), "{err}");
}
