//! What the servers say about themselves: versions, and the work they did
//! (Redis `INFO commandstats`, etcd's gRPC counters on /metrics,
//! PostgreSQL's `pg_stat_statements`). Read between measurements, so
//! nothing sits between the library client and its server while it is
//! timed. Client-side counts, where a scenario still wants them, come from
//! the conformance toolkit's counting hop ([`Calls::of`] a `Link`).

use std::collections::BTreeMap;

use distlock::postgres::DEFAULT_SEMAPHORE_TABLE;
use distlock_conformance::fault::Link;
use distlock_conformance::server::etcd_grpc_received;
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::plan::BenchResult;
use crate::servers::{self, Backend, Server};

/// Server-side counters, as far as the server offers them.
#[derive(Debug, Clone, Default)]
pub struct ServerCount {
    /// Commands/requests/statements the server executed (None: no server-side
    /// count).
    pub total: Option<u64>,
    /// Redis: every command including those run inside scripts.
    pub all_calls: Option<u64>,
    /// Redis: µs the server spent running scripts (`EVALSHA` and `EVAL`,
    /// the commands they ran included), by `INFO commandstats`.
    pub script_usec: Option<u64>,
    pub detail: BTreeMap<String, u64>,
}

impl ServerCount {
    /// `self` minus an `earlier` reading.
    pub fn since(&self, earlier: &ServerCount) -> ServerCount {
        let mut detail = BTreeMap::new();
        for (k, v) in &self.detail {
            let d = v - earlier.detail.get(k).copied().unwrap_or(0).min(*v);
            if d > 0 {
                detail.insert(k.clone(), d);
            }
        }
        ServerCount {
            total: self
                .total
                .zip(earlier.total)
                .map(|(a, b)| a.saturating_sub(b)),
            all_calls: self
                .all_calls
                .zip(earlier.all_calls)
                .map(|(a, b)| a.saturating_sub(b)),
            script_usec: self
                .script_usec
                .zip(earlier.script_usec)
                .map(|(a, b)| a.saturating_sub(b)),
            detail,
        }
    }

    /// Its largest entries per `n` units of work ("name 1.00, ...").
    pub fn top(&self, n: f64, entries: usize) -> String {
        let mut detail: Vec<_> = self.detail.iter().collect();
        detail.sort_by(|a, b| b.1.cmp(a.1));
        detail
            .iter()
            .take(entries)
            .map(|(k, v)| format!("{k} {:.2}", **v as f64 / n))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What a server-side total counts, for the notes; `per` is the unit of
/// work (a handoff, a renewal period) its "incl. inside scripts" and
/// script-time figures are divided by. The script time shows what a
/// script costs where it runs, after other work (about twice what it
/// costs back to back in a loop; README, "Where the time goes").
pub fn source(backend: Backend, count: &ServerCount, per: f64) -> String {
    match (backend, count.all_calls) {
        (Backend::Redis, Some(all)) => format!(
            "redis commands sent (INFO commandstats minus those run inside the scripts); {:.2} incl. inside scripts; {:.1} µs of server time in scripts",
            all as f64 / per,
            count.script_usec.unwrap_or(0) as f64 / per
        ),
        (Backend::Etcd, _) => {
            "etcd gRPC requests (grpc_server_msg_received_total: each watch created or cancelled and each lease keep-alive counts)"
                .to_owned()
        }
        (Backend::Postgres, _) => {
            "postgres statements (pg_stat_statements calls, top level)".to_owned()
        }
        _ => "no server-side count".to_owned(),
    }
}

/// The commands distlock-redis's scripts (the locks' and the permits')
/// run inside EVALSHA.
const REDIS_SCRIPT_INNER: &[&str] = &[
    "type",
    "get",
    "set",
    "del",
    "pttl",
    "pexpire",
    "publish",
    "time",
    "zadd",
    "zrange",
    "zrem",
    "zremrangebyscore",
];

/// Reads one server's own counters.
pub struct Probe {
    backend: Backend,
    port: u16,
    redis: Option<distlock::redis::redis::aio::MultiplexedConnection>,
    postgres: Option<PgPool>,
}

impl Probe {
    pub async fn new(backend: Backend, url: &str, port: u16) -> BenchResult<Self> {
        let mut probe = Probe {
            backend,
            port,
            redis: None,
            postgres: None,
        };
        match backend {
            Backend::Redis => {
                let client =
                    distlock::redis::redis::Client::open(url).map_err(|e| e.to_string())?;
                probe.redis = Some(
                    client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(|e| e.to_string())?,
                );
            }
            Backend::Postgres => probe.postgres = pg_statements(url).await,
            _ => {}
        }
        Ok(probe)
    }

    /// Redis: `INFO commandstats` calls (excluding the INFO calls of this
    /// probe; commands run inside scripts are counted too). etcd: gRPC
    /// request messages (`grpc_server_msg_received_total`: a stream's
    /// watch creates and cancels and lease keep-alives one each; counting
    /// streams started hid them). PostgreSQL: calls of
    /// every statement in `pg_stat_statements` but this probe's. Memory, or
    /// a server without the counters: none.
    pub async fn count(&mut self) -> BenchResult<ServerCount> {
        match self.backend {
            Backend::Redis => {
                let Some(conn) = self.redis.as_mut() else {
                    return Ok(ServerCount::default());
                };
                let info: String = distlock::redis::redis::cmd("INFO")
                    .arg("commandstats")
                    .query_async(conn)
                    .await
                    .map_err(|e| e.to_string())?;
                let mut detail = servers::parse_commandstats(&info);
                detail.remove("info");
                // Commands the lock scripts call inside EVALSHA: server
                // work, but not round trips.
                let inner: u64 = detail
                    .iter()
                    .filter(|(k, _)| REDIS_SCRIPT_INNER.contains(&k.as_str()))
                    .map(|(_, v)| *v)
                    .sum();
                let all: u64 = detail.values().sum();
                let usec = servers::parse_commandstats_usec(&info);
                let script_usec = ["evalsha", "eval"]
                    .iter()
                    .filter_map(|c| usec.get(*c))
                    .sum();
                Ok(ServerCount {
                    total: Some(all - inner),
                    all_calls: Some(all),
                    script_usec: Some(script_usec),
                    detail,
                })
            }
            Backend::Etcd => {
                let port = self.port;
                let detail = tokio::task::spawn_blocking(move || etcd_grpc_received(port))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())?;
                Ok(ServerCount {
                    total: Some(detail.values().sum()),
                    all_calls: None,
                    script_usec: None,
                    detail,
                })
            }
            Backend::Postgres => {
                let Some(pool) = &self.postgres else {
                    return Ok(ServerCount::default());
                };
                let rows: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT query, calls FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%'",
                )
                .fetch_all(pool)
                .await
                .map_err(|e| format!("reading pg_stat_statements: {e}"))?;
                let mut detail = BTreeMap::new();
                for (query, calls) in rows {
                    *detail.entry(pg_label(&query)).or_default() += calls.max(0) as u64;
                }
                Ok(ServerCount {
                    total: Some(detail.values().sum()),
                    all_calls: None,
                    script_usec: None,
                    detail,
                })
            }
            Backend::Memory => Ok(ServerCount::default()),
        }
    }
}

/// A connection that reads `pg_stat_statements`, if the server has it
/// loaded (the bench's own server does; one named by DISTLOCK_POSTGRES_URL
/// may not: its statements are then counted at the client).
async fn pg_statements(url: &str) -> Option<PgPool> {
    let attempt = async {
        let pool = PgPoolOptions::new().max_connections(1).connect(url).await?;
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&pool)
            .await?;
        sqlx::query("SELECT count(*) FROM pg_stat_statements")
            .execute(&pool)
            .await?;
        Ok::<_, sqlx::Error>(pool)
    };
    match attempt.await {
        Ok(pool) => Some(pool),
        Err(e) => {
            eprintln!(
                "[postgres] no pg_stat_statements ({e}); statements are counted at the client"
            );
            None
        }
    }
}

/// A short name for a statement distlock-postgres (or the raw baseline) runs
/// (`pg_stat_statements` shows constants such as NULL as parameters).
fn pg_label(query: &str) -> String {
    let q = query.split_whitespace().collect::<Vec<_>>().join(" ");
    // A release also sets `expires_at` (up to when it was given up), so
    // `pg_notify` is looked for first.
    let name = if q.contains(DEFAULT_SEMAPHORE_TABLE) {
        if q.contains("INSERT INTO") {
            "permit acquire"
        } else if q.contains("pg_notify") {
            "permit release"
        } else {
            "permit extend"
        }
    } else if q.contains("INSERT INTO") {
        "acquire"
    } else if q.contains("pg_notify") && q.contains("fencing = $4") {
        "release"
    } else if q.contains("pg_notify") {
        "abandon/force-release"
    } else if q.contains("SET expires_at") {
        "extend"
    } else {
        return q.chars().take(24).collect();
    };
    name.to_owned()
}

/// Calls that crossed a counting [`Link`], by kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct Calls {
    pub try_acquire: u64,
    pub extend: u64,
    pub release: u64,
    pub watch: u64,
}

impl Calls {
    /// What `link` carried so far.
    pub fn of(link: &Link) -> Calls {
        Calls {
            try_acquire: link.requests("try_acquire")
                + link.requests("try_acquire_renewing")
                + link.requests("acquire_permit"),
            extend: link.requests("extend") + link.requests("extend_permit"),
            release: link.requests("release") + link.requests("release_permit"),
            watch: link.requests("watch") + link.requests("watch_permits"),
        }
    }

    /// try_acquire + extend + release: the lock operations (each is one
    /// statement on PostgreSQL, one script call on Redis, 1-3 RPCs on etcd).
    pub fn ops(&self) -> u64 {
        self.try_acquire + self.extend + self.release
    }

    pub fn since(&self, earlier: &Calls) -> Calls {
        Calls {
            try_acquire: self.try_acquire - earlier.try_acquire,
            extend: self.extend - earlier.extend,
            release: self.release - earlier.release,
            watch: self.watch - earlier.watch,
        }
    }
}

/// Each server's version, for the header.
pub async fn server_versions(servers: &[Server]) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    for s in servers {
        let v = match s.backend {
            Backend::Memory => Ok("in-process MemoryLock".to_owned()),
            Backend::Redis => {
                async {
                    let client = distlock::redis::redis::Client::open(s.url.as_str())
                        .map_err(|e| e.to_string())?;
                    let mut c = client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(|e| e.to_string())?;
                    let info: String = distlock::redis::redis::cmd("INFO")
                        .arg("server")
                        .query_async(&mut c)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok::<_, String>(
                        info.lines()
                            .find_map(|l| l.strip_prefix("redis_version:"))
                            .map(|v| format!("redis {}", v.trim()))
                            .unwrap_or_default(),
                    )
                }
                .await
            }
            Backend::Etcd => servers::http_get(s.port().unwrap_or(0), "/version")
                .map(|v| format!("etcd {}", v.trim())),
            Backend::Postgres => {
                async {
                    let pool = PgPoolOptions::new()
                        .max_connections(1)
                        .connect(&s.url)
                        .await
                        .map_err(|e| e.to_string())?;
                    let v: String = sqlx::query_scalar("SHOW server_version")
                        .fetch_one(&pool)
                        .await
                        .map_err(|e| e.to_string())?;
                    pool.close().await;
                    Ok(format!("PostgreSQL {v}"))
                }
                .await
            }
        };
        out.insert(
            s.backend.name(),
            v.unwrap_or_else(|e| format!("version unknown: {e}")),
        );
    }
    out
}
