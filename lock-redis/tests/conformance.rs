//! The shared distlock conformance suite against a real redis-server.

use conformance_tests::{server, Suite};
use lock_core::LockClient;

fn main() -> std::process::ExitCode {
    Suite::new("redis", |url: String| async move {
        Ok(LockClient::new(lock_redis::RedisLock::connect(&url).await?))
    })
    .server(server::Redis::default())
    .run()
}
