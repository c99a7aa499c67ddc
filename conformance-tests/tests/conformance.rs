//! The whole suite against the in-memory backend, its fault cases over a
//! simulated network (the clients of fault cases are attached to a
//! [`Link`]), and one in-memory server per namespace (a `namespace=` in the
//! URL picks it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use distlock_conformance::fault::Link;
use distlock_conformance::{namespace_of, Suite};
use distlock_core::{LockClient, MemoryLock};

fn main() -> std::process::ExitCode {
    let servers = Arc::new(Mutex::new(HashMap::<String, MemoryLock>::new()));
    Suite::new("memory", move |url: String| {
        let namespace = namespace_of(&url).unwrap_or_default().to_owned();
        let client: LockClient = servers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(namespace)
            .or_default()
            .client();
        async move { Link::attach(&url, client) }
    })
    .simulated_network()
    .namespaces()
    .run()
}
