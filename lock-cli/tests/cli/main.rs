//! Runs the real `distlock` binary: checks without a server (memory://),
//! and cross-process scenarios against real Redis, etcd and PostgreSQL
//! servers (plain, TLS, clustered, pooled) started on 127.0.0.1 by the
//! conformance harness. A server that cannot be started fails its test.

mod etcd_cluster;
mod etcd_tls;
mod local;
mod postgres_pgbouncer;
mod postgres_tls;
mod redis_tls;
mod secrets;
mod servers;
mod stuck_attempt;
mod support;
