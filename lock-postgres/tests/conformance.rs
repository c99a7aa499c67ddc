//! The whole conformance suite against a real PostgreSQL, three times in
//! one run (libtest runs the trials of all three side by side):
//!
//! - `group::case`: a plain server (started by the harness, or
//!   `DISTLOCK_POSTGRES_URL`);
//! - `pgbouncer::group::case`: through PgBouncer in transaction mode
//!   (`pool_mode=transaction`, waiters on `listen_url` past the pooler);
//! - `tls::group::case` (feature `tls`): a TLS-only server, every
//!   connection — the listener's included — over mutual TLS with the
//!   `tls_ca_file`/`tls_cert_file`/`tls_key_file` parameters.
//!
//! `cargo test -p distlock-postgres --all-features --test conformance -- pgbouncer::`
//! runs one of them.

use std::process::ExitCode;

use distlock_conformance::server::{PoolMode, PooledPostgres, Postgres};
use distlock_conformance::{Suite, Variant};
use distlock_core::LockClient;

fn main() -> ExitCode {
    let suite = Suite::new("postgres", |url: String| async move {
        Ok(LockClient::new(
            distlock_postgres::PostgresLock::connect(&url).await?,
        ))
    })
    .server(Postgres)
    .variant(Variant::server("pgbouncer", || {
        Ok::<_, std::io::Error>(PooledPostgres::new(PoolMode::Transaction))
    }))
    // 8 (and 12) let a 200 ms TTL guard case miss its renewals while the
    // three exclusion tortures ran beside it on a 2-core CI machine
    // (`guard::renewal_keeps_lock_past_ttl`).
    .test_threads(4);
    #[cfg(feature = "tls")]
    let suite = suite.variant(Variant::server("tls", || {
        distlock_conformance::server::PostgresTls::new().map(|server| server.mutual())
    }));
    suite.run()
}
