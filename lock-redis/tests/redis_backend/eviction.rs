//! Servers whose `maxmemory-policy` may evict keys: a held lock evicted
//! lets a second holder in, so such a server is refused at connect unless
//! `allow_eviction` is set (then a warning); a server that will not say
//! (CONFIG refused or renamed) gets a warning.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use distlock_conformance::server::{self, ServerKind, ServerProcess};
use distlock_core::ErrorKind;

use crate::support::*;

/// `redis-server` as the harness starts it, with extra arguments.
struct RedisWith(Vec<&'static str>);

impl ServerKind for RedisWith {
    fn name(&self) -> &'static str {
        "redis"
    }
    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_REDIS_URL"
    }
    fn command(&self, dir: &Path, port: u16) -> Command {
        let mut command = server::Redis::default().command(dir, port);
        command.args(&self.0);
        command
    }
    fn url(&self, addr: SocketAddr) -> String {
        server::Redis::default().url(addr)
    }
}

fn start_with(args: &[&'static str]) -> ServerProcess {
    ServerProcess::start(Arc::new(RedisWith(args.to_vec()))).expect("cannot start redis-server")
}

fn eviction_warnings(warnings: &Warnings) -> Vec<String> {
    warnings
        .take()
        .into_iter()
        .filter(|w| w.contains("maxmemory-policy"))
        .collect()
}

#[tokio::test]
async fn an_evicting_maxmemory_policy_is_refused_unless_allowed() {
    let warnings = Warnings::capture();
    for policy in ["allkeys-lru", "volatile-ttl"] {
        let server = start_with(&["--maxmemory", "64mb", "--maxmemory-policy", policy]);
        let url = server.url();
        match connect(&url).await {
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Config, "{e}");
                for named in ["maxmemory-policy", policy, "noeviction", "allow_eviction"] {
                    assert!(e.message().contains(named), "{policy}: {named}: {e}");
                }
            }
            Ok(_) => {
                panic!("connected to a server whose maxmemory-policy {policy} may evict held locks")
            }
        }
        let lock = connect(&format!("{url}/?allow_eviction=true"))
            .await
            .expect("allow_eviction connects anyway");
        let warned = eviction_warnings(&warnings);
        assert!(
            warned.iter().any(|w| w.contains(policy)),
            "{policy}: no warning: {warned:?}"
        );
        let lease = acquired(
            lock.try_acquire(&unique_key("evictable"), std::time::Duration::from_secs(5))
                .await
                .unwrap(),
        );
        lock.release(&lease).await.unwrap();
    }

    // The default policy: no warning.
    let server = start(server::Redis::default());
    connect(&server.url()).await.unwrap();
    assert_eq!(eviction_warnings(&warnings), Vec::<String>::new());
}

#[tokio::test]
async fn a_server_that_will_not_show_its_policy_is_used_with_a_warning() {
    let warnings = Warnings::capture();
    // CONFIG renamed away, as on some managed services.
    let server = start_with(&[
        "--maxmemory-policy",
        "allkeys-lru",
        "--rename-command",
        "CONFIG",
        "",
    ]);
    connect(&server.url())
        .await
        .expect("a server whose policy cannot be read still connects");
    let warned = eviction_warnings(&warnings);
    assert_eq!(warned.len(), 1, "one warning: {warned:?}");

    // CONFIG refused by the ACL user (exactly the permissions the docs list).
    let server = start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let mut admin = raw(&server.url()).await;
    acl_user(&mut admin, "locks", DOC_PERMISSIONS).await;
    connect(&format!("redis://locks:pw@{}", server.addr()))
        .await
        .expect("an ACL user without CONFIG still connects");
    let warned = eviction_warnings(&warnings);
    assert_eq!(warned.len(), 1, "one warning: {warned:?}");
}
