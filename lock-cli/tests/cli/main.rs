//! Runs the real `distlock` binary: checks without a server (memory://),
//! and cross-process scenarios against real Redis, etcd and PostgreSQL
//! servers (plain, TLS, clustered, pooled) started on 127.0.0.1 by the
//! conformance harness. A server that cannot be started fails its test.

//!
//! Tests of a backend the build leaves out (the CLI's `redis`, `etcd`,
//! `postgres` and `tls` features) are left out with it.

mod election;
#[cfg(feature = "etcd")]
mod etcd_cluster;
#[cfg(all(feature = "etcd", feature = "tls"))]
mod etcd_tls;
mod local;
mod output;
#[cfg(feature = "postgres")]
mod postgres_pgbouncer;
#[cfg(all(feature = "postgres", feature = "tls"))]
mod postgres_tls;
#[cfg(all(feature = "redis", feature = "tls"))]
mod redis_tls;
#[cfg(feature = "redis")]
mod secrets;
mod servers;
#[cfg(feature = "redis")]
mod stuck_attempt;
mod support;
