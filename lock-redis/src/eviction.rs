//! The server's `maxmemory-policy`, checked at connect: every policy but
//! `noeviction` lets the server delete keys when its memory is full, a
//! held lock among them (the `volatile-*` policies pick from keys with an
//! expiry, which every lock has), and a second client then takes the lock
//! while the first still holds it.

use std::collections::HashMap;

use distlock_core::LockError;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{RedisError, Value};

use crate::config::RedisConfig;
use crate::connection::Conn;

/// The only policy that never evicts.
const SAFE: &str = "noeviction";

/// Refuses a server (any cluster primary) whose `maxmemory-policy` may
/// evict keys, naming the setting and the fix; with
/// [`allow_eviction`](RedisConfig::allow_eviction), warns instead. A
/// server that will not say (`CONFIG` refused by the ACL user, renamed or
/// disabled on managed services) gets a warning, not a refusal: distlock
/// cannot know, and the operator may have checked.
pub(crate) async fn check(
    conn: &mut Conn,
    config: &RedisConfig,
    what: &str,
) -> Result<(), LockError> {
    let answer = config
        .client()
        .timed(what, async { Ok(policies(conn).await) })
        .await;
    let policies = match answer {
        Ok(Ok(policies)) => policies,
        Ok(Err(e)) => {
            cannot_check(what, &e.to_string());
            return Ok(());
        }
        Err(e) => {
            cannot_check(what, e.message());
            return Ok(());
        }
    };
    let evicting: Vec<String> = policies
        .iter()
        .filter(|(_, policy)| policy != SAFE)
        .map(|(node, policy)| match node {
            Some(node) => format!("{policy} (on {node})"),
            None => policy.clone(),
        })
        .collect();
    if evicting.is_empty() {
        return Ok(());
    }
    let evicting = evicting.join(", ");
    if config.allow_eviction() {
        tracing::warn!(
            server = %config,
            maxmemory_policy = %evicting,
            "redis maxmemory-policy {evicting} may evict a held lock when the server's memory is full, \
             letting a second holder in; allowed by allow_eviction. Set maxmemory-policy noeviction to be safe"
        );
        return Ok(());
    }
    Err(LockError::config(format!(
        "{what}: the server's maxmemory-policy is {evicting}: when its memory is full it deletes keys, \
         a held lock among them, and a second client then takes that lock while the first still \
         holds it. Set `maxmemory-policy noeviction` (in redis.conf, or CONFIG SET maxmemory-policy \
         noeviction), or connect with allow_eviction=true (RedisConfig::with_allow_eviction) to accept \
         the risk with a warning"
    )))
}

fn cannot_check(what: &str, why: &str) {
    tracing::warn!(
        "{what}: cannot read the server's maxmemory-policy ({why}); make sure it is noeviction: \
         any other policy may evict a held lock when memory is full, letting a second holder in"
    );
}

/// Each server's policy: one, or (in a cluster) one per primary with its
/// address.
async fn policies(conn: &mut Conn) -> Result<Vec<(Option<String>, String)>, RedisError> {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg("maxmemory-policy");
    match conn {
        Conn::Cluster(cluster) => {
            let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            let reply = cluster.route_command(get, routing).await?;
            let Value::Map(nodes) = reply else {
                return Err(unexpected(&reply));
            };
            nodes
                .into_iter()
                .map(|(node, reply)| {
                    let node: String = redis::from_redis_value(node)?;
                    Ok((Some(node), policy(reply.extract_error()?)?))
                })
                .collect()
        }
        other => {
            let reply: Value = get.query_async(other).await?;
            Ok(vec![(None, policy(reply)?)])
        }
    }
}

/// The policy in a `CONFIG GET maxmemory-policy` reply (a name/value list
/// on RESP2, a map on RESP3).
fn policy(reply: Value) -> Result<String, RedisError> {
    let copy = reply.clone();
    let mut settings: HashMap<String, String> = redis::from_redis_value(reply)?;
    settings
        .remove("maxmemory-policy")
        .ok_or_else(|| unexpected(&copy))
}

fn unexpected(reply: &Value) -> RedisError {
    RedisError::from((
        redis::ErrorKind::Parse,
        "unexpected reply to CONFIG GET maxmemory-policy",
        format!("{reply:?}"),
    ))
}
