//! The shared distlock conformance suite against a real redis-server.

use std::sync::Arc;

use conformance_tests::{server, Suite};
use lock_core::DistributedLock;

fn main() -> std::process::ExitCode {
    Suite::new("redis", |url: String| async move {
        let lock = lock_redis::RedisLock::connect(&url).await?;
        Ok(Arc::new(lock) as Arc<dyn DistributedLock>)
    })
    .server(server::Redis::default())
    .run()
}
