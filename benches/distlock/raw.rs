//! The raw baselines: the same driver, the same kind of connection the
//! backend uses (Redis: one multiplexed ConnectionManager; etcd: one gRPC
//! channel; PostgreSQL: a pool of 8 with no health-check ping), issuing the
//! minimal commands of an acquire + release itself (etcd: a lease grant, the
//! put transaction, the delete transaction, and the lease's revoke in the
//! background, as the library's plain locks do) (PostgreSQL: the
//! library's own two statements, `distlock_postgres::StatementTexts`, so the
//! baseline cannot drift from what the backend sends). The acquire half
//! alone can be timed (the crowd rows' baseline write).
//!
//! The same for a permit of a semaphore: Redis, one script that drops
//! expired permits from a sorted set, counts, takes the next fencing token
//! and adds the permit, and a `ZREM`; etcd, a read of the permits, a lease
//! grant, a transaction putting the permit on it and reading the permits
//! (its place is its grant), a delete transaction and a revoke in the
//! background (as the library's); PostgreSQL, the library's own permit
//! statements (`distlock_postgres::PermitStatementTexts`).
//!
//! And the fenced Redis pair the peer row measures against: one script
//! doing `SET NX PX` and `INCR` of a fencing counter (returning the
//! token), then the compare-and-delete; both by EVALSHA of scripts loaded
//! at connect, on the one multiplexed connection. Besides, what a
//! namespace left on a server (the state row's counts).

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::etcd::etcd_client::{
    Client as EtcdClient, Compare, CompareOp, ConnectOptions, GetOptions, KvClient, LeaseClient,
    PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};
use distlock::postgres::{
    PermitStatementTexts, StatementTexts, DEFAULT_SCHEMA, DEFAULT_SEMAPHORE_TABLE, DEFAULT_TABLE,
    WAITER_TABLE,
};
use distlock::redis::redis::{self, aio::ConnectionManager, Script};
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::servers::Backend;

/// Compare-and-delete: the minimal safe Redis release.
const REDIS_RELEASE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// A fenced acquire: the lock if free, and then the next fencing token
/// (0 when refused). KEYS: lock, fence. ARGV: owner, ttl ms.
const REDIS_ACQUIRE_FENCED: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('INCR', KEYS[2]) else return 0 end";

/// A permit: drop expired ones (scores are expiries in server ms), refuse
/// at the limit, else the next fencing token and the permit
/// `<owner>:<token>`. KEYS: permit set, fence. ARGV: owner, ttl ms, limit.
const REDIS_ACQUIRE_PERMIT: &str = r#"
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
local token = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1] .. ':' .. token)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"#;

/// The channel the raw PostgreSQL releases notify.
pub const PG_CHANNEL: &str = "distlock_rawbench";
/// The channel of raw PostgreSQL releases nobody listens for.
const PG_QUIET_CHANNEL: &str = "distlock_rawbench_quiet";
/// Its channel of single wake-ups (unused: the raw acquires never wait).
const PG_NEXT_CHANNEL: &str = "distlock_rawbench_next";
/// Its observers' channel (unused: the raw acquires carry no label).
const PG_HOLDER_CHANNEL: &str = "distlock_rawbench_holder";
/// The listener pid of a raw PostgreSQL acquire: none, it does not wait.
const NOT_WAITING: i64 = 0;
/// The send number of every raw PostgreSQL acquire and release: each
/// acquisition has an owner of its own, so any will do.
const RAW_SEND: i64 = 1;

/// What a raw acquire took, for its release.
pub enum RawHeld {
    Redis {
        key: String,
        owner: String,
    },
    Etcd {
        key: String,
        owner: String,
        /// The lock's own lease, revoked after the release.
        lease: i64,
    },
    Postgres {
        key: String,
        owner: String,
        fencing: i64,
    },
}

/// A raw client for one backend.
#[derive(Clone)]
pub enum Raw {
    Redis {
        conn: ConnectionManager,
        release: Script,
        acquire_permit: Script,
        acquire_fenced: Script,
    },
    Etcd {
        kv: Box<KvClient>,
        leases: Box<LeaseClient>,
    },
    Postgres {
        pool: PgPool,
        /// The library's own acquire and release, on its default table.
        statements: Arc<StatementTexts>,
        /// The library's own permit acquire and release, on its default
        /// semaphore table.
        permits: Arc<PermitStatementTexts>,
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
                let (release, acquire_permit, acquire_fenced) = (
                    Script::new(REDIS_RELEASE),
                    Script::new(REDIS_ACQUIRE_PERMIT),
                    Script::new(REDIS_ACQUIRE_FENCED),
                );
                // Loaded now, so every call is one EVALSHA (no NOSCRIPT
                // round trip while timed).
                for script in [&release, &acquire_permit, &acquire_fenced] {
                    script
                        .load_async(&mut conn)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Ok(Raw::Redis {
                    conn,
                    release,
                    acquire_permit,
                    acquire_fenced,
                })
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
                    permits: Arc::new(PermitStatementTexts::new(
                        DEFAULT_SCHEMA,
                        DEFAULT_SEMAPHORE_TABLE,
                    )),
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
        let (held, _) = self.acquire(key, n, ttl).await?;
        self.release(held).await
    }

    /// Acquires fresh `key` for `ttl` with the minimal commands; what
    /// [`release`](Self::release) needs, and how long the acquire write
    /// alone took (Redis: the `SET NX PX`; etcd: the put transaction, its
    /// lease granted before, untimed; PostgreSQL: the library's acquire
    /// statement).
    pub async fn acquire(
        &self,
        key: &str,
        n: u64,
        ttl: Duration,
    ) -> Result<(RawHeld, Duration), String> {
        let owner = owner_hex(n);
        match self {
            Raw::Redis { conn, .. } => {
                let mut conn = conn.clone();
                let key = format!("rawbench:{{{key}}}:lock");
                let started = Instant::now();
                let ok: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg(&owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl.as_millis() as u64)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                let took = started.elapsed();
                if ok.is_none() {
                    return Err(format!("raw SET NX refused on fresh key {key}"));
                }
                Ok((RawHeld::Redis { key, owner }, took))
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
                let started = Instant::now();
                let reply = kv.txn(put).await.map_err(|e| e.to_string())?;
                let took = started.elapsed();
                if !reply.succeeded() {
                    return Err(format!("raw put txn refused on fresh key {key}"));
                }
                Ok((
                    RawHeld::Etcd {
                        key,
                        owner,
                        lease: lease.id(),
                    },
                    took,
                ))
            }
            Raw::Postgres {
                pool, statements, ..
            } => {
                use sqlx::Row;
                let started = Instant::now();
                let row = sqlx::query(&statements.acquire)
                    .bind("rawbench")
                    .bind(key)
                    .bind(&owner)
                    .bind(ttl.as_millis() as i64)
                    .bind(RAW_SEND)
                    .bind(DEFAULT_TABLE)
                    .bind(NOT_WAITING)
                    // No holder label.
                    .bind("")
                    .bind(PG_HOLDER_CHANNEL)
                    .fetch_optional(pool)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("raw acquire returned no row for {key}"))?;
                let took = started.elapsed();
                let acquired: bool = row.try_get("acquired").map_err(|e| e.to_string())?;
                let fencing: i64 = row.try_get("fencing").map_err(|e| e.to_string())?;
                if !acquired {
                    return Err(format!("raw acquire refused on fresh key {key}"));
                }
                let key = key.to_owned();
                Ok((
                    RawHeld::Postgres {
                        key,
                        owner,
                        fencing,
                    },
                    took,
                ))
            }
        }
    }

    /// Releases what [`acquire`](Self::acquire) took, with the minimal
    /// command (compare-and-delete).
    pub async fn release(&self, held: RawHeld) -> Result<(), String> {
        self.release_telling(held, PG_CHANNEL).await
    }

    /// [`release`](Self::release), a PostgreSQL release notifying a
    /// channel nobody listens on (the raw handoff's waiter gives back).
    pub async fn release_quietly(&self, held: RawHeld) -> Result<(), String> {
        self.release_telling(held, PG_QUIET_CHANNEL).await
    }

    async fn release_telling(&self, held: RawHeld, pg_channel: &str) -> Result<(), String> {
        match (self, held) {
            (Raw::Redis { conn, release, .. }, RawHeld::Redis { key, owner }) => {
                let mut conn = conn.clone();
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
            (Raw::Etcd { kv, leases }, RawHeld::Etcd { key, owner, lease }) => {
                let mut kv = KvClient::clone(kv);
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
                // Revoked in the background, as the library revokes a
                // plain lock's lease (and as this file's permits are): a
                // lease left to expire costs the same Raft write later,
                // when the leader revokes it, outside a short run's window.
                let mut leases = LeaseClient::clone(leases);
                tokio::spawn(async move {
                    let _ = leases.revoke(lease).await;
                });
                Ok(())
            }
            (
                Raw::Postgres {
                    pool, statements, ..
                },
                RawHeld::Postgres {
                    key,
                    owner,
                    fencing,
                },
            ) => {
                use sqlx::Row;
                let row = sqlx::query(&statements.release)
                    .bind("rawbench")
                    .bind(&key)
                    .bind(&owner)
                    .bind(fencing)
                    .bind(pg_channel)
                    .bind(RAW_SEND)
                    .bind(DEFAULT_TABLE)
                    .bind(PG_NEXT_CHANNEL)
                    .bind(PG_HOLDER_CHANNEL)
                    .fetch_one(pool)
                    .await
                    .map_err(|e| e.to_string())?;
                let done: i64 = row.try_get("done").map_err(|e| e.to_string())?;
                if done != 1 {
                    return Err(format!("raw release did not release {key}"));
                }
                Ok(())
            }
            _ => Err("raw release of another backend's lock".to_owned()),
        }
    }

    /// Redis only: acquires `key` for `ttl` with its next fencing token,
    /// and releases it (compare-and-delete); the token.
    pub async fn fenced_acquire_release(
        &self,
        key: &str,
        n: u64,
        ttl: Duration,
    ) -> Result<i64, String> {
        let Raw::Redis {
            conn,
            acquire_fenced,
            ..
        } = self
        else {
            return Err("the fenced raw pair is Redis only".to_owned());
        };
        let owner = owner_hex(n);
        let mut conn = conn.clone();
        let (lock, fence) = (
            format!("rawbench:{{{key}}}:lock"),
            format!("rawbench:{{{key}}}:fence"),
        );
        let token: i64 = acquire_fenced
            .key(&lock)
            .key(&fence)
            .arg(&owner)
            .arg(ttl.as_millis() as u64)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        if token == 0 {
            return Err(format!("raw fenced acquire refused on fresh key {lock}"));
        }
        self.release(RawHeld::Redis { key: lock, owner }).await?;
        Ok(token)
    }

    /// Redis only: how many keys match `pattern` (a full SCAN; the server
    /// skips expired keys).
    pub async fn count_redis_keys(&self, pattern: &str) -> Result<u64, String> {
        let Raw::Redis { conn, .. } = self else {
            return Err("counting Redis keys needs Redis".to_owned());
        };
        let mut conn = conn.clone();
        let (mut cursor, mut count) = (0u64, 0u64);
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            count += keys.len() as u64;
            if next == 0 {
                return Ok(count);
            }
            cursor = next;
        }
    }

    /// What namespace `namespace` left on the server, as (what, count):
    /// Redis keys `NS:*`; etcd keys under `NS/`; PostgreSQL rows of the
    /// namespace in the lock table and in the table of waiter lines.
    pub async fn state_counts(&self, namespace: &str) -> Result<Vec<(&'static str, u64)>, String> {
        match self {
            Raw::Redis { .. } => {
                let keys = self.count_redis_keys(&format!("{namespace}:*")).await?;
                Ok(vec![("redis_keys", keys)])
            }
            Raw::Etcd { kv, .. } => {
                let mut kv = KvClient::clone(kv);
                let reply = kv
                    .get(
                        format!("{namespace}/"),
                        Some(GetOptions::new().with_prefix().with_count_only()),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(vec![(
                    "etcd_keys",
                    u64::try_from(reply.count()).unwrap_or(0),
                )])
            }
            Raw::Postgres { pool, .. } => {
                let count = |sql: String| async move {
                    sqlx::query_scalar::<_, i64>(&sql)
                        .bind(namespace)
                        .fetch_one(pool)
                        .await
                        .map(|n| u64::try_from(n).unwrap_or(0))
                        .map_err(|e| format!("{sql}: {e}"))
                };
                let locks = count(format!(
                    "SELECT count(*) FROM \"{DEFAULT_SCHEMA}\".\"{DEFAULT_TABLE}\" WHERE namespace = $1"
                ))
                .await?;
                let waiters = count(format!(
                    "SELECT count(*) FROM \"{DEFAULT_SCHEMA}\".\"{WAITER_TABLE}\" WHERE namespace = $1"
                ))
                .await?;
                Ok(vec![("lock_rows", locks), ("waiter_rows", waiters)])
            }
        }
    }

    /// Takes a permit of `key`'s semaphore of `limit` for `ttl` and gives
    /// it back, with the minimal commands.
    pub async fn permit_acquire_release(
        &self,
        key: &str,
        n: u64,
        limit: u32,
        ttl: Duration,
    ) -> Result<(), String> {
        let owner = owner_hex(n);
        match self {
            Raw::Redis {
                conn,
                acquire_permit,
                ..
            } => {
                let mut conn = conn.clone();
                let (set, fence) = (
                    format!("rawbench:{{{key}}}:sem"),
                    format!("rawbench:{{{key}}}:sem-fence"),
                );
                let token: i64 = acquire_permit
                    .key(&set)
                    .key(&fence)
                    .arg(&owner)
                    .arg(ttl.as_millis() as u64)
                    .arg(limit)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if token == 0 {
                    return Err(format!("raw permit refused on fresh semaphore {set}"));
                }
                let removed: i64 = redis::cmd("ZREM")
                    .arg(&set)
                    .arg(format!("{owner}:{token}"))
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if removed != 1 {
                    return Err(format!("raw ZREM did not give back the permit of {set}"));
                }
                Ok(())
            }
            Raw::Etcd { kv, leases } => {
                let (mut kv, mut leases) = (KvClient::clone(kv), LeaseClient::clone(leases));
                let prefix = format!("rawbench/sem/{key}/permits/");
                let permit = format!("{prefix}{owner}");
                let oldest_first = || {
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                };
                let before = kv
                    .get(prefix.as_str(), Some(oldest_first()))
                    .await
                    .map_err(|e| e.to_string())?;
                if before.kvs().len() >= limit as usize {
                    return Err(format!("raw permit read found {prefix} full"));
                }
                let lease = leases
                    .grant(ttl.as_secs().max(1) as i64, None)
                    .await
                    .map_err(|e| e.to_string())?
                    .id();
                let join = Txn::new()
                    .when([Compare::create_revision(
                        permit.as_str(),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then([
                        TxnOp::put(
                            permit.as_str(),
                            owner.as_str(),
                            Some(PutOptions::new().with_lease(lease)),
                        ),
                        TxnOp::get(prefix.as_str(), Some(oldest_first())),
                    ]);
                let reply = kv.txn(join).await.map_err(|e| e.to_string())?;
                let line = reply
                    .op_responses()
                    .into_iter()
                    .find_map(|op| match op {
                        TxnOpResponse::Get(get) => Some(get.kvs().to_vec()),
                        _ => None,
                    })
                    .unwrap_or_default();
                let place = line.iter().position(|kv| kv.key() == permit.as_bytes());
                let fencing = match place {
                    Some(place) if reply.succeeded() && place < limit as usize => {
                        line[place].create_revision()
                    }
                    _ => return Err(format!("raw permit not granted in {prefix}")),
                };
                let release = Txn::new()
                    .when([Compare::create_revision(
                        permit.as_str(),
                        CompareOp::Equal,
                        fencing,
                    )])
                    .and_then([TxnOp::delete(permit.as_str(), None)]);
                let reply = kv.txn(release).await.map_err(|e| e.to_string())?;
                if !reply.succeeded() {
                    return Err(format!("raw permit delete refused for {permit}"));
                }
                // The library revokes a released permit's lease in the
                // background too.
                tokio::spawn(async move {
                    let _ = leases.revoke(lease).await;
                });
                Ok(())
            }
            Raw::Postgres { pool, permits, .. } => {
                use sqlx::Row;
                let row = sqlx::query(&permits.acquire)
                    .bind("rawbench")
                    .bind(key)
                    .bind(&owner)
                    .bind(ttl.as_millis() as i64)
                    .bind(i64::from(limit))
                    .bind(RAW_SEND)
                    .bind(DEFAULT_SEMAPHORE_TABLE)
                    .bind(NOT_WAITING)
                    // No holder label.
                    .bind("")
                    .fetch_optional(pool)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("raw permit acquire returned no row for {key}"))?;
                let granted: bool = row.try_get("granted").map_err(|e| e.to_string())?;
                if !granted {
                    return Err(format!("raw permit refused on fresh semaphore {key}"));
                }
                let fencing: i64 = row.try_get("fencing").map_err(|e| e.to_string())?;
                let row = sqlx::query(&permits.release)
                    .bind("rawbench")
                    .bind(key)
                    .bind(&owner)
                    .bind(fencing)
                    .bind(PG_CHANNEL)
                    .bind(RAW_SEND)
                    .bind(DEFAULT_SEMAPHORE_TABLE)
                    .bind(PG_NEXT_CHANNEL)
                    .fetch_one(pool)
                    .await
                    .map_err(|e| e.to_string())?;
                let done: i64 = row.try_get("done").map_err(|e| e.to_string())?;
                if done != 1 {
                    return Err(format!("raw permit release did not release {key}"));
                }
                Ok(())
            }
        }
    }
}
