//! Redis-specific tests beyond the shared suite, each against its own
//! `redis-server` (or Sentinel group, or cluster) started on loopback
//! (never an external server, so command counts are exact, and primaries
//! can be killed).

mod acl;
mod cluster;
mod commands;
mod eviction;
mod foreign;
mod format;
mod holder;
mod outcomes;
mod permit_holder;
mod pubsub;
mod semaphore;
mod sentinel;
mod support;
#[cfg(feature = "tls")]
mod tls;
mod turns;
