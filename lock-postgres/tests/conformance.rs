//! The whole conformance suite against a real PostgreSQL (started by the
//! harness, or `DISTLOCK_POSTGRES_URL`).

use std::sync::Arc;

use conformance_tests::{server, Suite};
use lock_core::DistributedLock;

fn main() -> std::process::ExitCode {
    Suite::new("postgres", |url: String| async move {
        let lock = lock_postgres::PostgresLock::connect(&url).await?;
        Ok(Arc::new(lock) as Arc<dyn DistributedLock>)
    })
    .server(server::Postgres)
    .run()
}
