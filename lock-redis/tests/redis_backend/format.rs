//! The namespace's format marker, `NS:format`: stored at the first
//! connect, accepted when it names this client's format, refused (with
//! both numbers) when it names another, reported as corrupted (and left
//! alone) when it holds anything else.

use std::time::Duration;

use distlock_conformance::server;
use distlock_core::{ErrorKind, STORAGE_FORMAT};
use distlock_redis::redis::{self, AsyncCommands};

use crate::support::*;

const MARKER: &str = "distlock:format";

#[tokio::test]
async fn the_first_connect_stores_the_marker_and_later_ones_accept_it() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    let before: Option<String> = admin.get(MARKER).await.unwrap();
    assert_eq!(before, None);

    // Several clients at once: one stores the marker, all connect.
    let url = server.url();
    let clients = futures_util::future::join_all((0..4).map(|_| connect(&url))).await;
    for client in clients {
        let client = client.expect("every concurrent connect succeeds");
        let key = unique_key("format");
        let lease = acquired(
            client
                .try_acquire(&key, Duration::from_secs(5))
                .await
                .unwrap(),
        );
        client.release(&lease).await.unwrap();
    }
    let stored: Option<String> = admin.get(MARKER).await.unwrap();
    assert_eq!(stored, Some(STORAGE_FORMAT.to_string()));
    let ttl: i64 = admin.pttl(MARKER).await.unwrap();
    assert_eq!(ttl, -1, "the marker does not expire");
    connect(&server.url())
        .await
        .expect("a later connect accepts the marker");
}

#[tokio::test]
async fn another_format_number_is_refused_naming_both() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    for (stored, word) in [("2", "newer"), ("0", "older")] {
        let _: () = admin.set(MARKER, stored).await.unwrap();
        let err = connect(&server.url()).await.expect_err(stored);
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("format {stored}")), "{text}");
        assert!(text.contains(&format!("format {STORAGE_FORMAT}")), "{text}");
        assert!(text.contains(MARKER), "{text}");
        assert!(text.contains(word), "{text}");
        let after: String = admin.get(MARKER).await.unwrap();
        assert_eq!(after, stored, "the marker is left alone");
    }
}

#[tokio::test]
async fn foreign_data_at_the_marker_is_corrupted_and_left_alone() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    let _: () = admin.set(MARKER, "v1").await.unwrap();
    let err = connect(&server.url()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.to_string().contains(MARKER), "{err}");
    let after: String = admin.get(MARKER).await.unwrap();
    assert_eq!(after, "v1");

    let _: () = admin.del(MARKER).await.unwrap();
    let _: () = admin.hset(MARKER, "format", "1").await.unwrap();
    let err = connect(&server.url()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupted, "{err}");
    assert!(err.to_string().contains(MARKER), "{err}");
    assert!(err.to_string().contains("hash"), "{err}");
    let kind: String = redis::cmd("TYPE")
        .arg(MARKER)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(kind, "hash", "the hash is left alone");
}

#[tokio::test]
async fn each_namespace_has_its_own_marker() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    let _: () = admin.set("other:format", "2").await.unwrap();
    connect(&server.url())
        .await
        .expect("the default namespace is format 1");
    let err = connect(&format!("redis://{}/?namespace=other", server.addr()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("other:format"), "{err}");
}
