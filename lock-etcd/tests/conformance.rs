//! The whole conformance suite against a real etcd.

use conformance_tests::{server, Suite};
use lock_core::LockClient;

fn main() -> std::process::ExitCode {
    Suite::new("etcd", |url: String| async move {
        Ok(LockClient::new(lock_etcd::EtcdLock::connect(&url).await?))
    })
    .server(server::Etcd)
    .run()
}
