//! `distlock::connect` picks the backend by URL scheme.

use std::time::Duration;

use distlock::{ErrorKind, LockKey};

#[tokio::test]
async fn memory_urls_share_a_server_per_name() {
    let a = distlock::connect("memory://shared").await.unwrap();
    let b = distlock::connect("memory://shared").await.unwrap();
    let other = distlock::connect("memory://other").await.unwrap();
    let key = LockKey::new("job").unwrap();
    let ttl = Duration::from_secs(10);
    let lease = a.try_acquire(&key, ttl).await.unwrap().lease().unwrap();
    assert!(b.try_acquire(&key, ttl).await.unwrap().lease().is_none());
    let elsewhere = other.try_acquire(&key, ttl).await.unwrap().lease();
    assert!(elsewhere.is_some(), "another memory server is independent");
    a.release(&lease).await.unwrap();
}

#[tokio::test]
async fn bad_urls_are_config_errors() {
    for url in ["", "127.0.0.1:6379", "zookeeper://x"] {
        let err = distlock::connect(url).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{url}");
    }
}

/// `url` fails with a Config error naming `feature`.
#[cfg(not(all(feature = "redis", feature = "etcd", feature = "postgres")))]
async fn assert_names_feature(url: &str, feature: &str) {
    let err = distlock::connect(url).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{url}: {err}");
    assert!(
        err.to_string().contains(&format!("`{feature}` feature")),
        "{url}: {err}"
    );
}

#[cfg(not(feature = "redis"))]
#[tokio::test]
async fn disabled_redis_names_its_feature() {
    assert_names_feature("redis://127.0.0.1:6379", "redis").await;
    assert_names_feature("rediss://127.0.0.1:6379", "redis").await;
    if !cfg!(feature = "tls") {
        assert_names_feature("rediss://127.0.0.1:6379", "tls").await;
    }
}

#[cfg(not(feature = "etcd"))]
#[tokio::test]
async fn disabled_etcd_names_its_feature() {
    assert_names_feature("etcd://127.0.0.1:2379", "etcd").await;
    assert_names_feature("etcds://127.0.0.1:2379", "etcd").await;
}

/// With etcd but without TLS, `etcds://` names the `tls` feature.
#[cfg(all(feature = "etcd", not(feature = "tls")))]
#[tokio::test]
async fn etcds_without_tls_names_the_feature() {
    let err = distlock::connect("etcds://127.0.0.1:2379")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("`tls` feature"), "{err}");
}

#[cfg(not(feature = "postgres"))]
#[tokio::test]
async fn disabled_postgres_names_its_feature() {
    assert_names_feature("postgres://u:p@127.0.0.1/db", "postgres").await;
    assert_names_feature("postgresql://u:p@127.0.0.1/db", "postgres").await;
}
