//! The whole suite against the in-memory backend, its fault cases over a
//! simulated network (the clients of fault cases are attached to a
//! [`Link`]).

use distlock_conformance::fault::Link;
use distlock_conformance::Suite;
use distlock_core::{LockClient, MemoryLock};

fn main() -> std::process::ExitCode {
    let server = MemoryLock::new();
    Suite::new("memory", move |url: String| {
        let client: LockClient = server.client();
        async move { Link::attach(&url, client) }
    })
    .simulated_network()
    .run()
}
