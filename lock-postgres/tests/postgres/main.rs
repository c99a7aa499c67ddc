//! PostgreSQL-specific tests beyond the conformance suite, against a real
//! server started by the harness (or `DISTLOCK_POSTGRES_URL`), one module
//! per theme.

mod connect;
mod faults;
mod format;
mod holder;
mod line;
mod listener;
mod observers;
mod outcomes;
mod pooler;
mod reclaim;
mod rows;
mod semaphores;
mod settings;
mod support;
mod terminate;
#[cfg(feature = "tls")]
mod tls;
