//! The shared distlock conformance suite against real Redis servers, once
//! per topology, all from this one binary so libtest runs them side by
//! side:
//!
//! - `basic::…` etc.: one `redis-server`;
//! - `tls::basic::…`: one TLS-only `redis-server` (feature `tls`), client
//!   certificates optional;
//! - `sentinel::basic::…`: a Sentinel group (primary, replica, three
//!   sentinels), through `redis+sentinel://`;
//! - `cluster::basic::…`: a Redis Cluster (three primaries, one replica
//!   each), through `redis+cluster://`.
//!
//! The suite's own fault cases kill, pause or proxy a single server
//! process: against the groups they show as ignored (a client that asks
//! the sentinels or the cluster for addresses goes around a proxy); the
//! Redis tests (`redis_backend`, `sentinel::`, `cluster::`) kill primaries
//! of dedicated groups instead.

use std::process::ExitCode;

use distlock_conformance::server::{self, RedisCluster, RedisSentinel};
use distlock_conformance::{Suite, Variant};
use distlock_core::LockClient;

fn main() -> ExitCode {
    let suite = Suite::new("redis", |url: String| async move {
        Ok(LockClient::new(
            distlock_redis::RedisLock::connect(&url).await?,
        ))
    })
    .server(server::Redis::default())
    // Four suites of cases that mostly wait on TTLs and servers; more than
    // 8 at once let the 200 ms TTL guard cases miss renewals on a loaded
    // 2-core machine (as on PostgreSQL).
    .test_threads(8);
    #[cfg(feature = "tls")]
    let suite = suite.variant(Variant::server("tls", || {
        server::TestPki::temporary()
            .map(|pki| server::RedisTls::new(pki).client_auth(server::RedisTlsAuth::Optional))
    }));
    suite
        .variant(Variant::group("sentinel", || {
            RedisSentinel::start().map(|group| (group.url(), group))
        }))
        .variant(Variant::group("cluster", || {
            RedisCluster::start().map(|cluster| (cluster.url(), cluster))
        }))
        .run()
}
