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

#[cfg(not(feature = "redis"))]
#[tokio::test]
async fn disabled_backend_names_its_feature() {
    let err = distlock::connect("redis://127.0.0.1:6379")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("`redis` feature"), "{err}");
}
