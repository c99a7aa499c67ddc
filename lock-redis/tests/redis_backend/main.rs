//! Redis-specific tests beyond the shared suite, each against its own
//! `redis-server` started on a loopback port (never an external server,
//! so command counts are exact).

mod acl;
mod commands;
mod pubsub;
mod support;
#[cfg(feature = "tls")]
mod tls;
