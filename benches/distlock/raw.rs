//! The raw baselines: the same driver, the same kind of connection the
//! backend uses (Redis: one multiplexed ConnectionManager; etcd: one gRPC
//! channel; PostgreSQL: a pool of 8 with no health-check ping), issuing the
//! minimal commands of an acquire + release itself (PostgreSQL: the
//! library's own two statements, `distlock_postgres::StatementTexts`, so the
//! baseline cannot drift from what the backend sends).

use std::sync::Arc;
use std::time::Duration;

use distlock::etcd::etcd_client::{
    Client as EtcdClient, Compare, CompareOp, ConnectOptions, KvClient, LeaseClient, PutOptions,
    Txn, TxnOp,
};
use distlock::postgres::{StatementTexts, DEFAULT_SCHEMA, DEFAULT_TABLE};
use distlock::redis::redis::{self, aio::ConnectionManager, Script};
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::servers::Backend;

/// Compare-and-delete: the minimal safe Redis release.
const REDIS_RELEASE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// A raw client for one backend.
#[derive(Clone)]
pub enum Raw {
    Redis {
        conn: ConnectionManager,
        release: Script,
    },
    Etcd {
        kv: Box<KvClient>,
        leases: Box<LeaseClient>,
    },
    Postgres {
        pool: PgPool,
        /// The library's own acquire and release, on its default table.
        statements: Arc<StatementTexts>,
    },
}

fn owner_hex(n: u64) -> String {
    format!("{:032x}", (n as u128) << 64 | 0x5eed)
}

impl Raw {
    pub async fn connect(backend: Backend, url: &str, port: u16) -> Result<Self, String> {
        match backend {
            Backend::Memory => Err("no raw client for memory".to_owned()),
            Backend::Redis => {
                let client = redis::Client::open(url).map_err(|e| e.to_string())?;
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(5)))
                    .set_response_timeout(Some(Duration::from_secs(5)));
                let mut conn = ConnectionManager::new_with_config(client, config)
                    .await
                    .map_err(|e| e.to_string())?;
                let release = Script::new(REDIS_RELEASE);
                release
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Raw::Redis { conn, release })
            }
            Backend::Etcd => {
                let options = ConnectOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(5));
                let client =
                    EtcdClient::connect([format!("http://127.0.0.1:{port}")], Some(options))
                        .await
                        .map_err(|e| e.to_string())?;
                Ok(Raw::Etcd {
                    kv: Box::new(client.kv_client()),
                    leases: Box::new(client.lease_client()),
                })
            }
            Backend::Postgres => {
                let pool = PgPoolOptions::new()
                    .max_connections(8)
                    .min_connections(0)
                    .test_before_acquire(false)
                    .connect(url)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Raw::Postgres {
                    pool,
                    statements: Arc::new(StatementTexts::new(DEFAULT_SCHEMA, DEFAULT_TABLE)),
                })
            }
        }
    }

    /// One plain server round trip: PING, an etcd range read, SELECT 1.
    pub async fn ping(&self) -> Result<(), String> {
        match self {
            Raw::Redis { conn, .. } => {
                let mut conn = conn.clone();
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
            Raw::Etcd { kv, .. } => {
                let mut kv = KvClient::clone(kv);
                kv.get("rawbench/ping", None)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
            Raw::Postgres { pool, .. } => sqlx::query("SELECT 1")
                .fetch_one(pool)
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
        }
    }

    /// Acquire `key` for `ttl` and release it, with the minimal commands.
    pub async fn acquire_release(&self, key: &str, n: u64, ttl: Duration) -> Result<(), String> {
        let owner = owner_hex(n);
        match self {
            Raw::Redis { conn, release } => {
                let mut conn = conn.clone();
                let key = format!("rawbench:{{{key}}}:lock");
                let ok: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg(&owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl.as_millis() as u64)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if ok.is_none() {
                    return Err(format!("raw SET NX refused on fresh key {key}"));
                }
                let deleted: i64 = release
                    .key(&key)
                    .arg(&owner)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if deleted != 1 {
                    return Err(format!("raw release did not delete {key}"));
                }
                Ok(())
            }
            Raw::Etcd { kv, leases } => {
                let (mut kv, mut leases) = (KvClient::clone(kv), LeaseClient::clone(leases));
                let key = format!("rawbench/lock/{key}");
                let lease = leases
                    .grant(ttl.as_secs().max(1) as i64, None)
                    .await
                    .map_err(|e| e.to_string())?;
                let put = Txn::new()
                    .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(
                        key.as_str(),
                        owner.as_str(),
                        Some(PutOptions::new().with_lease(lease.id())),
                    )])
                    .or_else([TxnOp::get(key.as_str(), None)]);
                let reply = kv.txn(put).await.map_err(|e| e.to_string())?;
                if !reply.succeeded() {
                    return Err(format!("raw put txn refused on fresh key {key}"));
                }
                let delete = Txn::new()
                    .when([Compare::value(
                        key.as_str(),
                        CompareOp::Equal,
                        owner.as_str(),
                    )])
                    .and_then([TxnOp::delete(key.as_str(), None)]);
                let reply = kv.txn(delete).await.map_err(|e| e.to_string())?;
                if !reply.succeeded() {
                    return Err(format!("raw delete txn refused for {key}"));
                }
                Ok(())
            }
            Raw::Postgres { pool, statements } => {
                use sqlx::Row;
                // Each acquisition has an owner of its own, so any send
                // number will do; release names the acquire's.
                let send = 1_i64;
                let row = sqlx::query(&statements.acquire)
                    .bind("rawbench")
                    .bind(key)
                    .bind(&owner)
                    .bind(ttl.as_millis() as i64)
                    .bind(send)
                    .fetch_optional(pool)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("raw acquire returned no row for {key}"))?;
                let acquired: bool = row.try_get("acquired").map_err(|e| e.to_string())?;
                let fencing: i64 = row.try_get("fencing").map_err(|e| e.to_string())?;
                if !acquired {
                    return Err(format!("raw acquire refused on fresh key {key}"));
                }
                let row = sqlx::query(&statements.release)
                    .bind("rawbench")
                    .bind(key)
                    .bind(&owner)
                    .bind(fencing)
                    .bind("distlock_rawbench")
                    .bind(send)
                    .fetch_one(pool)
                    .await
                    .map_err(|e| e.to_string())?;
                let done: i64 = row.try_get("done").map_err(|e| e.to_string())?;
                if done != 1 {
                    return Err(format!("raw release did not release {key}"));
                }
                Ok(())
            }
        }
    }
}
