//! The whole conformance suite against a real PostgreSQL, three times in
//! one run (libtest runs the trials of all three side by side):
//!
//! - `group::case`: a plain server (started by the harness, or
//!   `DISTLOCK_POSTGRES_URL`);
//! - `[pgbouncer] group::case`: through PgBouncer in transaction mode
//!   (`pool_mode=transaction`, waiters on `listen_url` past the pooler);
//! - `[tls] group::case` (feature `tls`): a TLS-only server, every
//!   connection — the listener's included — over mutual TLS with the
//!   `tls_ca_file`/`tls_cert_file`/`tls_key_file` parameters.
//!
//! `cargo test -p distlock-postgres --all-features --test conformance -- pgbouncer`
//! runs one of them.

use std::process::ExitCode;

use distlock_conformance::fault::HOLDER_ENV;
use distlock_conformance::server::{PoolMode, PooledPostgres, Postgres};
use distlock_conformance::Suite;
use distlock_core::{LockClient, LockError};
use libtest_mimic::{Arguments, Trial};

/// Cases run at once unless the command line says. 8 (and 12) let a 200 ms
/// TTL guard case miss its renewals while the three exclusion tortures ran
/// beside it on a 2-core CI machine (`guard::renewal_keeps_lock_past_ttl`).
const TEST_THREADS: usize = 4;

async fn connect(url: String) -> Result<LockClient, LockError> {
    Ok(LockClient::new(
        distlock_postgres::PostgresLock::connect(&url).await?,
    ))
}

fn main() -> ExitCode {
    if std::env::var_os(HOLDER_ENV).is_some() {
        // A fault case's lock holder: its URL says which server.
        return Suite::new("postgres", connect).run();
    }
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(TEST_THREADS);
    }
    // Each suite starts its server(s) when listing its trials: start them
    // side by side.
    let trials = std::thread::scope(|scope| {
        let plain = scope.spawn(|| Suite::new("postgres", connect).server(Postgres).trials());
        let pooled = scope.spawn(|| {
            kind(
                "pgbouncer",
                Suite::new("postgres-pgbouncer", connect)
                    .server(PooledPostgres::new(PoolMode::Transaction))
                    .trials(),
            )
        });
        #[cfg(feature = "tls")]
        let tls = scope.spawn(|| match distlock_conformance::server::PostgresTls::new() {
            Ok(server) => kind(
                "tls",
                Suite::new("postgres-tls", connect)
                    .server(server.mutual())
                    .trials(),
            ),
            Err(e) => vec![Trial::test("[tls] generating the test PKI", move || {
                Err(format!("cannot generate the test PKI: {e}").into())
            })],
        });
        let mut trials = plain.join().expect("listing the plain suite");
        trials.extend(pooled.join().expect("listing the pooled suite"));
        #[cfg(feature = "tls")]
        trials.extend(tls.join().expect("listing the TLS suite"));
        trials
    });
    libtest_mimic::run(&args, trials).exit_code()
}

fn kind(name: &str, trials: Vec<Trial>) -> Vec<Trial> {
    trials.into_iter().map(|t| t.with_kind(name)).collect()
}
