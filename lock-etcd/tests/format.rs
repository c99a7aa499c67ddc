//! The namespace's format marker, `NS/lock/%format`: stored at the first
//! connect, accepted when it names this client's format, refused (with
//! both numbers) when it names another, reported as corrupted (and left
//! alone) when it holds anything else.

mod common;

use common::{acquire, any_server, raw_client, unique_key};
use distlock_conformance::naming::unique_name;
use std::time::Duration;

use distlock_core::{ErrorKind, LockClient, LockError, STORAGE_FORMAT};
use distlock_etcd::etcd_client::Client;
use distlock_etcd::EtcdLock;

/// A fresh namespace on the shared server, its marker key and a raw client.
async fn namespace(url: &str) -> (String, String, Client) {
    let ns = unique_name("fmt");
    let marker = format!("{ns}/lock/%format");
    (ns, marker, raw_client(url).await)
}

async fn stored(raw: &mut Client, marker: &str) -> Option<Vec<u8>> {
    let reply = raw.get(marker, None).await.unwrap();
    reply.kvs().first().map(|kv| kv.value().to_vec())
}

async fn connect_ns(url: &str, ns: &str) -> Result<EtcdLock, LockError> {
    EtcdLock::connect(&format!("{url}?namespace={ns}")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_connect_stores_the_marker_and_later_ones_accept_it() {
    let server = any_server();
    let url = server.url();
    let (ns, marker, mut raw) = namespace(&url).await;
    assert_eq!(stored(&mut raw, &marker).await, None);

    // Several clients at once: one stores the marker, all connect.
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (url, ns) = (url.clone(), ns.clone());
            tokio::spawn(async move { connect_ns(&url, &ns).await })
        })
        .collect();
    for client in clients {
        let client = LockClient::new(
            client
                .await
                .unwrap()
                .expect("every concurrent connect succeeds"),
        );
        let lease = acquire(&client, &unique_key("format"), Duration::from_secs(5)).await;
        client.release(&lease).await.unwrap();
    }
    let reply = raw.get(marker.as_str(), None).await.unwrap();
    let kv = reply.kvs().first().expect("the marker is stored");
    assert_eq!(kv.value(), STORAGE_FORMAT.to_string().as_bytes());
    assert_eq!(kv.lease(), 0, "the marker is on no lease");
    assert_eq!(kv.version(), 1, "the marker was written once");
    connect_ns(&url, &ns)
        .await
        .expect("a later connect accepts the marker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_format_number_is_refused_naming_both() {
    let server = any_server();
    let url = server.url();
    let (ns, marker, mut raw) = namespace(&url).await;
    for (value, word) in [("2", "newer"), ("0", "older")] {
        raw.put(marker.as_str(), value, None).await.unwrap();
        let err = connect_ns(&url, &ns).await.expect_err(value);
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("format {value}")), "{text}");
        assert!(text.contains(&format!("format {STORAGE_FORMAT}")), "{text}");
        assert!(text.contains(&marker), "{text}");
        assert!(text.contains(word), "{text}");
        assert_eq!(
            stored(&mut raw, &marker).await.as_deref(),
            Some(value.as_bytes()),
            "the marker is left alone"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_data_at_the_marker_is_corrupted_and_left_alone() {
    let server = any_server();
    let url = server.url();
    let (ns, marker, mut raw) = namespace(&url).await;
    for value in [&b"v1"[..], b"", b"\xff\xfe"] {
        raw.put(marker.as_str(), value, None).await.unwrap();
        let err = connect_ns(&url, &ns).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupted, "{value:?}: {err}");
        assert!(err.to_string().contains(&marker), "{err}");
        assert_eq!(stored(&mut raw, &marker).await.as_deref(), Some(value));
    }
}
