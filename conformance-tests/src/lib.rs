//! The distlock conformance suite (work in progress).
pub mod server;
