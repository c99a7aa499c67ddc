//! The whole conformance suite against a real etcd.

use std::sync::Arc;

use conformance_tests::{server, Suite};
use lock_core::DistributedLock;

fn main() -> std::process::ExitCode {
    Suite::new("etcd", |url: String| async move {
        let lock = lock_etcd::EtcdLock::connect(&url).await?;
        Ok(Arc::new(lock) as Arc<dyn DistributedLock>)
    })
    .server(server::Etcd)
    .run()
}
