//! The whole conformance suite against real etcd servers, three ways in one
//! libtest run (they share its threads):
//!
//! - `group::case`: a single etcd;
//! - `tls::group::case` (feature `tls`): an etcd that requires mutual TLS
//!   (`etcds://` with a CA, a client certificate and its key);
//! - `cluster::group::case`: a 3-member cluster, the URL listing every
//!   member (`DISTLOCK_ETCD_CLUSTER_URL` names an existing one instead).
//!   The harness does not kill or cut the shared cluster's members, so the
//!   cases that need that are ignored there; tests/cluster.rs does it on
//!   clusters of its own.

use std::process::ExitCode;

use distlock_conformance::server::{self, EtcdCluster};
use distlock_conformance::{Suite, Variant};
use distlock_core::LockClient;
use distlock_etcd::EtcdLock;

fn main() -> ExitCode {
    let suite = Suite::new("etcd", |url: String| async move {
        Ok(LockClient::new(EtcdLock::connect(&url).await?))
    })
    .server(server::Etcd);
    #[cfg(feature = "tls")]
    let suite = suite.variant(Variant::server("tls", || {
        server::TestPki::temporary().map(|pki| server::EtcdTls::mutual(&pki))
    }));
    suite
        .variant(Variant::group("cluster", || {
            match std::env::var("DISTLOCK_ETCD_CLUSTER_URL") {
                Ok(url) if !url.is_empty() => Ok((url, None)),
                _ => EtcdCluster::start(3).map(|cluster| (cluster.url(), Some(cluster))),
            }
        }))
        .run()
}
