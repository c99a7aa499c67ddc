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

use distlock_conformance::fault::holder::HOLDER_ENV;
use distlock_conformance::server::{self, EtcdCluster};
use distlock_conformance::Suite;
use distlock_core::LockClient;
use distlock_etcd::EtcdLock;

fn suite() -> Suite {
    Suite::new("etcd", |url: String| async move {
        Ok(LockClient::new(EtcdLock::connect(&url).await?))
    })
}

fn main() -> ExitCode {
    // A fault case's holder (this binary re-executed) needs no servers.
    if std::env::var_os(HOLDER_ENV).is_some() {
        return suite().run();
    }
    let mut variants = Vec::new();

    #[cfg(feature = "tls")]
    let pki_dir = std::env::temp_dir().join(format!("distlock-etcd-pki-{}", std::process::id()));
    #[cfg(feature = "tls")]
    {
        let pki = server::TestPki::generate(&pki_dir).expect("a test PKI for TLS etcd");
        variants.push(suite().variant("tls").server(server::EtcdTls::mutual(&pki)));
    }

    let mut cluster = None;
    let cluster_url = match std::env::var("DISTLOCK_ETCD_CLUSTER_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => cluster
            .insert(EtcdCluster::start(3).expect("a 3-member etcd cluster must start"))
            .url(),
    };
    variants.push(suite().variant("cluster").external_server(cluster_url));

    let code = suite().server(server::Etcd).run_with(variants);
    drop(cluster);
    #[cfg(feature = "tls")]
    let _ = std::fs::remove_dir_all(&pki_dir);
    code
}
