//! The shared distlock conformance suite against real Redis servers, once
//! per topology, all from this one binary so libtest runs them side by
//! side:
//!
//! - `basic::…` etc.: one `redis-server`;
//! - `[tls] basic::…`: one TLS-only `redis-server` (feature `tls`), client
//!   certificates optional;
//! - `[sentinel] basic::…`: a Sentinel group (primary, replica, three
//!   sentinels), through `redis+sentinel://`;
//! - `[cluster] basic::…`: a Redis Cluster (three primaries, one replica
//!   each), through `redis+cluster://`.
//!
//! The Sentinel group and the cluster are started once, here, and stopped
//! when the run ends. The suite's own fault cases kill, pause or proxy a
//! single server process: against the groups they show as ignored (a
//! client that asks the sentinels or the cluster for addresses goes around
//! a proxy); the Redis tests (`redis_backend`, `sentinel::`, `cluster::`)
//! kill primaries of dedicated groups instead.

use std::process::ExitCode;

use distlock_conformance::fault::HOLDER_ENV;
use distlock_conformance::server::{self, RedisCluster, RedisSentinel};
use distlock_conformance::Suite;
use distlock_core::LockClient;
use libtest_mimic::{Arguments, Trial};

fn suite() -> Suite {
    Suite::new("redis", |url: String| async move {
        Ok(LockClient::new(
            distlock_redis::RedisLock::connect(&url).await?,
        ))
    })
}

/// The suite against a group started here, each case named `[kind] …`; if
/// the group did not start, every case fails with the reason.
fn group_trials(kind: &str, url: Result<String, String>) -> Vec<Trial> {
    match url {
        Ok(url) => suite()
            .external_server(url)
            .trials()
            .into_iter()
            .map(|t| t.with_kind(kind))
            .collect(),
        Err(reason) => distlock_conformance::cases::all()
            .into_iter()
            .map(|case| {
                let reason = format!("the {kind} servers did not start: {reason}");
                Trial::test(format!("{}::{}", case.group, case.name), move || {
                    Err(reason.into())
                })
                .with_kind(kind)
            })
            .collect(),
    }
}

fn main() -> ExitCode {
    // A fault case's lock holder: this binary again, for one client.
    if std::env::var_os(HOLDER_ENV).is_some() {
        return suite().run();
    }
    let mut args = Arguments::from_args();
    // Four suites of cases that mostly wait on TTLs and servers; more than
    // 8 at once let the 200 ms TTL guard cases miss renewals on a loaded
    // 2-core machine (as on PostgreSQL).
    args.test_threads.get_or_insert(8);

    // The groups start side by side (each waits for its members).
    let sentinel = std::thread::spawn(RedisSentinel::start);
    let cluster = std::thread::spawn(RedisCluster::start);
    let sentinel = sentinel
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("start panicked")));
    let cluster = cluster
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("start panicked")));

    let mut trials = suite().server(server::Redis::default()).trials();
    let pki_dir = std::env::temp_dir().join(format!("distlock-redis-tls-{}", std::process::id()));
    #[cfg(feature = "tls")]
    trials.extend(tls_trials(&pki_dir));
    trials.extend(group_trials(
        "sentinel",
        sentinel
            .as_ref()
            .map(RedisSentinel::url)
            .map_err(|e| e.to_string()),
    ));
    trials.extend(group_trials(
        "cluster",
        cluster
            .as_ref()
            .map(RedisCluster::url)
            .map_err(|e| e.to_string()),
    ));
    let conclusion = libtest_mimic::run(&args, trials);
    // Stops every server of the groups.
    drop((sentinel, cluster));
    let _ = std::fs::remove_dir_all(&pki_dir);
    conclusion.exit_code()
}

/// The suite over TLS, named `[tls] …`.
#[cfg(feature = "tls")]
fn tls_trials(dir: &std::path::Path) -> Vec<Trial> {
    let pki = match server::TestPki::generate(dir) {
        Ok(pki) => pki,
        Err(e) => return group_trials("tls", Err(format!("cannot generate certificates: {e}"))),
    };
    suite()
        .server(server::RedisTls::new(pki).client_auth(server::RedisTlsAuth::Optional))
        .trials()
        .into_iter()
        .map(|t| t.with_kind("tls"))
        .collect()
}
