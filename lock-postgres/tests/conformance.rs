//! The whole conformance suite against a real PostgreSQL (started by the
//! harness, or `DISTLOCK_POSTGRES_URL`).

use conformance_tests::{server, Suite};
use lock_core::LockClient;

fn main() -> std::process::ExitCode {
    Suite::new("postgres", |url: String| async move {
        Ok(LockClient::new(
            lock_postgres::PostgresLock::connect(&url).await?,
        ))
    })
    .server(server::Postgres)
    .run()
}
