//! The whole suite against the in-memory backend.

use std::sync::Arc;

use conformance_tests::Suite;
use lock_core::{DistributedLock, MemoryLock};

fn main() -> std::process::ExitCode {
    let server = MemoryLock::new();
    Suite::new("memory", move |_url: String| {
        let client = server.client();
        async move { Ok(client as Arc<dyn DistributedLock>) }
    })
    .run()
}
