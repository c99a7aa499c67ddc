//! The Redis backend of distlock.
//!
//! ```no_run
//! use std::time::Duration;
//! use distlock_core::{Locker, LockKey, LockOptions};
//! use distlock_redis::RedisLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), distlock_core::LockError> {
//! let lock = RedisLock::connect("redis://:secret@127.0.0.1:6379/0?namespace=jobs").await?;
//! let locker = Locker::new(lock);
//! let key = LockKey::new("nightly-report")?;
//! if let Some(guard) = locker.try_lock(&key, &LockOptions::new(Duration::from_secs(30))).await? {
//!     // ... the job ...
//!     guard.release().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! [`RedisLock`] is the raw [`LockBackend`](distlock_core::LockBackend)
//! (plus [`LockAdmin`](distlock_core::LockAdmin) and
//! [`SemaphoreBackend`](distlock_core::SemaphoreBackend)); job code uses it through
//! [`LockClient`](distlock_core::LockClient) or
//! [`Locker`](distlock_core::Locker), which own owner tokens, lease
//! deadlines, waiting and renewal.
//!
//! # URL and parameters
//!
//! The URL forms (one server, Sentinel, Cluster, TLS, Unix sockets) and
//! the table of query parameters are on [`RedisConfig`]; any parameter not
//! in the table, or a value out of its range, is a
//! [`ErrorKind::Config`](distlock_core::ErrorKind) error naming it.
//!
//! - [`RedisLock::connect`]`("redis://[user:password@]host[:port][/db]")`;
//!   with an ACL user, `redis://user:password@host`; with the legacy
//!   `requirepass`, `redis://:password@host`. Wrong credentials give
//!   [`ErrorKind::Config`](distlock_core::ErrorKind) saying authentication failed.
//! - `rediss://…` connects over TLS (see [TLS](#tls)).
//! - `unix:///path/to/redis.sock` (or `redis+unix://`) connects over a Unix
//!   socket; [`RedisLock::connect`] accepts it, the `distlock` facade routes
//!   only the [`SCHEMES`] to this crate.
//! - [`RedisLock::with_config`] takes a [`RedisConfig`] (parsed from a URL
//!   or built in code); [`RedisLock::from_connection_manager`] reuses an
//!   application's [`ConnectionManager`](redis::aio::ConnectionManager).
//!
//! ## ACL users
//!
//! In namespace `NS` distlock needs, for its ACL user:
//!
//! - the keys `~NS:*`, read and write (the locks and semaphores, and the
//!   namespace's format marker `NS:format`, see
//!   [`STORAGE_FORMAT`](distlock_core::STORAGE_FORMAT));
//! - the channels `&NS:*` (Redis 7 gives new users none:
//!   `acl-pubsub-default resetchannels`);
//! - the commands `EVALSHA`, `EVAL`, `SUBSCRIBE`, `UNSUBSCRIBE`, `PING`, and
//!   inside its scripts `TYPE`, `GET`, `SET`, `DEL`, `PTTL`, `PEXPIRE`,
//!   `TIME`, `PUBLISH`, and for waiter lines and semaphores `ZRANGE`,
//!   `ZADD`, `ZREM`, `ZREMRANGEBYSCORE`. `HGET`, `HSET` and `HDEL` (inside
//!   the scripts) are optional: without them permits' holder labels are
//!   not stored (a labelled permit is granted, with a warning) and none is
//!   shown. `SCRIPT LOAD` is optional: without it a script the
//!   server does not have is sent with `EVAL` (which caches it). `CONFIG`
//!   (`CONFIG GET maxmemory-policy`, see [Eviction](#eviction)) is optional
//!   too: without it the policy is not checked, and a warning says so.
//!
//! For example `ACL SETUSER jobs on >pw ~jobs:* &jobs:* +evalsha +eval
//! +subscribe +unsubscribe +ping +type +get +set +del +pttl +pexpire +time
//! +publish +zrange +zadd +zrem +zremrangebyscore`. [`RedisLock::connect`] checks this on Redis 7 and later (with
//! `redis.acl_check_cmd`, running nothing) and fails with
//! [`ErrorKind::Config`](distlock_core::ErrorKind) naming what is missing, rather
//! than connecting a client whose every acquire fails, or whose releases
//! wake nobody. A missing channel permission is refused too: without it a
//! release cannot wake the waiters of other clients, which would then wait
//! for the holder's TTL. Older servers, and
//! [`RedisLock::from_connection_manager`], report a missing permission at
//! first use (`Config`, with the server's reason).
//!
//! If the channel permission is taken away later, a release still deletes
//! the lock and reports success (the script publishes with `redis.pcall`;
//! scripts are not rolled back, so failing after the `DEL` would report a
//! release that happened as an error); the refused notification is logged as
//! a warning and waiters elsewhere wake at the holder's expiry.
//!
//! ## Eviction
//!
//! A server whose `maxmemory-policy` is anything but `noeviction` deletes
//! keys when its memory is full: `allkeys-*` any key, `volatile-*` keys
//! with an expiry, which every lock has. A held lock evicted lets a second
//! client take it while the first still runs its job. [`RedisLock::connect`]
//! reads the policy (`CONFIG GET maxmemory-policy`, on every primary of a
//! cluster) and refuses such a server with
//! [`ErrorKind::Config`](distlock_core::ErrorKind) naming the setting and
//! the fix (`maxmemory-policy noeviction`): a lock that silently stops
//! excluding is worse than a client that does not start. Where the risk is
//! accepted (a shared cache that must evict, with memory to spare),
//! `allow_eviction=true` ([`RedisConfig::allow_eviction`]) connects with a
//! warning. A server that will not say (`CONFIG` refused by the ACL user,
//! or renamed or disabled, as on many managed services) is used with a
//! warning. The policy is read at connect only (a Sentinel failover, or a
//! `CONFIG SET` later, is not seen), and not at all by
//! [`RedisLock::from_connection_manager`].
//!
//! # How it works
//!
//! Keys (see the table in `keys.rs`): for lock `K` in namespace `NS`,
//! `NS:{K'}:lock`, `NS:{K'}:fence`, `NS:{K'}:gone`, the waiter line
//! `NS:{K'}:waiters`, the holder label `NS:{K'}:holder`, the woken
//! waiter's turn `NS:{K'}:turn` and the channels
//! `NS:{K'}:released:<client id>` (waiters) and `NS:{K'}:released:observers`
//! (observers: scripts publish there when a labelled holder takes or
//! leaves the lock; [`LockAdmin::watch_holder`](distlock_core::LockAdmin::watch_holder)),
//! where `K'` is `K` with `%`, `{`, `}` percent-escaped — injective, and
//! the hash tag `{K'}` puts them all in one Redis Cluster slot whatever `K`
//! contains. The semaphore `K` has names of its own in the same slot:
//! `NS:{K'}:sem:permits`, `NS:{K'}:sem:fence`, `NS:{K'}:sem:gone`,
//! `NS:{K'}:sem:waiters`, the permits' holder labels `NS:{K'}:sem:holder`
//! and the channels `NS:{K'}:sem:returned:<client id>` (see
//! [Semaphores](#semaphores)).
//!
//! - Every operation is one `EVALSHA` of a Lua script (the scripts are
//!   loaded at connect; one the server lacks — after a restart, a failover,
//!   `SCRIPT FLUSH` — is sent once more with `EVAL`).
//! - **Acquire**: if the lock key holds another owner's lock it returns
//!   the holder's `PTTL` (filling
//!   [`AcquireReply::Held::expires_in`](distlock_core::AcquireReply)); if
//!   it holds the request's own owner token (an earlier attempt of the same
//!   acquisition took it, and its reply was lost), it *adopts* it: `PEXPIRE
//!   lock ttl` and the lock's own fencing token; else it computes the
//!   fencing token, `SET lock dl1:<owner>:<token> PX ttl` (the owner token
//!   is the one in the request, minted by
//!   [`LockClient`](distlock_core::LockClient)), stores the token in the
//!   fence key and returns it.
//! - **Holder label** ([`HolderId`](distlock_core::HolderId)): an
//!   acquisition that gives one also sets `NS:{K'}:holder` to
//!   `<owner>:<label>` with the lock's `PX` (an adoption sets it again);
//!   one without a label writes nothing there. Extend pushes its expiry
//!   when it is the same owner's; release and force-release delete it.
//!   Inspect shows it only when its owner is the lock's, so a label left by
//!   an earlier holder (or beside a lock taken by an older client, which
//!   never touches it) is never shown. The lock value keeps its format.
//!   Anything distlock does not write at that key is left alone and stops
//!   nothing: no label is stored or shown (acquire logs a warning).
//! - **Extend**: compares the stored value with the held lock's owner and
//!   fencing token, then `PEXPIRE`; a missing key is never recreated.
//!   Guards of one client that share a TTL renew together: one script
//!   extends up to 250 locks, each compared and answered on its own (a
//!   corrupted one alone is refused), on one server or Sentinel; in a
//!   cluster, whose locks span slots, each renews alone.
//! - **Release**: compares, `DEL`, wakes the next waiter (see Waiting), and leaves the
//!   released value with a random id of the release call in
//!   `NS:{K'}:gone` for twice the operation timeout (at most the lock's
//!   remaining TTL): the same request sent again (the cluster driver
//!   resends a request whose connection dropped) reports `Released`, as
//!   the first did, instead of `NotHeld`; a second release call still
//!   reports `NotHeld`.
//! - Every script checks its arguments, and the type and shape of every
//!   key it reads, before its first write (a script is not rolled back).
//! - **Waiting**: one wake-up per release, in arrival order, and nobody
//!   cuts in (fair handoff,
//!   [`Capabilities::fair_handoff`](distlock_core::Capabilities)). Each key has
//!   a waiter line, the sorted set `NS:{K'}:waiters` of `<client id>:<owner
//!   hex>` scored by arrival (server microseconds). A waiting attempt that
//!   is refused joins it in the acquire script (keeping its place if it
//!   has one); a granted one leaves it. A release publishes the first
//!   waiter's owner token on its client's channel
//!   `NS:{K'}:released:<client id>`, where that client wakes that waiter
//!   alone: one attempt per release, however many wait. The woken waiter
//!   stays first in the line with a **turn of 5 seconds**, measured by the
//!   server's clock: `NS:{K'}:turn` holds its member and the turn's end
//!   (server milliseconds, from `TIME`), with a `PX` of two turns so it
//!   never outlives its use; it is read only while the line has a waiter
//!   (an attempt on a free key with nobody in line reads the line alone).
//!   While the line has a waiter, a free key goes
//!   to its first waiter alone: anyone else's attempt (a newcomer, a
//!   `try_lock`, the holder that just released and came straight back) is
//!   refused, told the turn's time left
//!   ([`AcquireReply::Held::expires_in`](distlock_core::AcquireReply)), and
//!   joins the line's end if it waits. An attempt on a free key that finds
//!   the first waiter's turn over drops it from the line and serves the
//!   next; one that finds a first waiter never woken (the key came free by
//!   its holder's expiry) wakes it and gives it its turn. So a waiter woken
//!   whose client froze, or whose wake-up was lost, holds the free key up
//!   for one turn at most. A waiter whose client is gone (the publish
//!   reaches nobody) is dropped and the next one tried. A wait that ends
//!   without the lock (cancelled, out of time, failed) leaves the line with
//!   one more script, which passes the turn on to the next waiter if the
//!   key is free; and a client whose listener receives a wake-up for a
//!   waiter of its own that no longer waits runs that script for it too
//!   (a waiter's attempt that reached the server after its wait ended puts
//!   it back in the line). An attempt of an owner that already holds the
//!   lock (an earlier attempt's reply was lost) adopts it whatever the
//!   line holds. A semaphore's line wakes its waiters as before: taken off
//!   the line as they are woken, without a turn; a wake-up for a waiter
//!   that no longer waits is passed on there too (its leave script wakes
//!   the next waiter if a permit is free).
//!   The line expires with the last wait that joined it. One pub/sub
//!   connection per client, shared by all waiters and run by
//!   [`distlock_core::Listener`], subscribes the client's channel of a key
//!   before its first waiter's first attempt. A holder that crashed is
//!   covered by a timer set to its `PTTL`, and a wake-up lost with a
//!   frozen client by the other waiters' timers, set to the turn's end.
//!   No polling. If the pub/sub connection fails (closed, a
//!   SUBSCRIBE, UNSUBSCRIBE or PING that errs or times out), it is dropped
//!   and every waiter subscribes again before its next attempt.
//! - A value distlock did not write (another type, another format, a lock,
//!   counter or marker without expiry) at any of these keys gives
//!   [`ErrorKind::Corrupted`](distlock_core::ErrorKind) naming the Redis
//!   key; nothing is overwritten, deleted or given another expiry.
//!
//! ## Semaphores
//!
//! A semaphore (at most N holders of a key,
//! [`LockOptions::with_permits`](distlock_core::LockOptions::with_permits)) shares
//! nothing with the lock of the same name: its permits are a sorted set,
//! `NS:{K'}:sem:permits`, whose members are `dl1:<owner hex>:<fencing
//! token>:<limit>` and whose scores are the permits' expiry times (the
//! server's `TIME`, in milliseconds); the key itself has a PX expiry no
//! earlier than its last permit's, so a semaphore nobody uses leaves
//! nothing behind. A permit is live while its score is later than the
//! server's clock; each script sweeps the expired ones
//! (`ZREMRANGEBYSCORE`) before it writes. Each operation is one script:
//!
//! - **Acquire**: counts the live permits; live permits under another
//!   limit answer [`LimitMismatch`](distlock_core::PermitReply) (the limit
//!   is stored in every permit, so with none live the request's applies);
//!   this owner's live permit is adopted (new score, its own fencing
//!   token); with `limit` live permits the answer is
//!   [`Full`](distlock_core::PermitReply) with the time until the first
//!   runs out; else a new permit is added, its fencing token from the
//!   semaphore's own counter `NS:{K'}:sem:fence`, kept as the lock's (see
//!   below).
//! - **Extend**: this owner and fencing token's live permit gets a new
//!   score; an expired or released one is never recreated.
//! - **Release**: removes it, wakes the first waiter of the semaphore's own
//!   line `NS:{K'}:sem:waiters` on its client's channel
//!   `NS:{K'}:sem:returned:<client id>` (one wake-up per permit returned,
//!   as the lock's), and leaves
//!   a marker `<owner hex>:<fencing token>/<release id>` in the sorted set
//!   `NS:{K'}:sem:gone` (scored by its expiry, twice the operation timeout
//!   and at most the permit's remaining TTL) so that a resent release
//!   reports `Released`, as the lock's does.
//! - **Holder labels**: a permit acquired with a label stores it in the
//!   hash `NS:{K'}:sem:holder`, field `<owner hex>:<fencing token>` (so it
//!   is shown only for that permit, never for a later holder's), with a PX
//!   expiry no earlier than the permit set's (extend pushes it); a permit
//!   without a label writes nothing there. Release deletes the permit's
//!   field, and a sweep the fields of the permits it removes (the hash goes
//!   with its last field). The operator read
//!   [`inspect_permits`](distlock_core::LockAdmin::inspect_permits) lists
//!   the live permits with their labels. Anything distlock does not write
//!   there (another type, a hash without expiry) stops nothing and is left
//!   alone: no label is stored (acquire logs a warning) or shown.
//!
//! Every script checks the type, members, scores and expiry of the keys it
//! reads before its first write, as the lock's do (`Corrupted` naming the
//! Redis key). `min_replicas`, timeouts, unknown outcomes and Sentinel and
//! Cluster work as for the lock.
//!
//! ## Fencing tokens without a key per lock name forever
//!
//! The token is `max(counter + 1, server TIME in microseconds)`, and the
//! counter key expires [`fence_retention`](RedisConfig::fence_retention)
//! (default one hour, and at least twice the TTL) after the last
//! acquisition. So a lock name nobody uses any more leaves nothing behind
//! after the retention, while tokens keep growing: within the retention the
//! counter orders them; after it, the server's clock has moved past every
//! token issued before (tokens track the clock to within the number of
//! acquisitions per microsecond).
//!
//! **Assumption** (see also [Clocks](#clocks)): the Redis server's clock
//! never steps back by more than the retention (NTP slews, it does not
//! jump hours back). A bigger backward step followed by a counter expiry
//! could issue a token lower than an earlier one. Like every Redis lock,
//! tokens also restart if the server loses its data (no persistence,
//! failover to a lagging replica): `Capabilities::durable` is `false`.
//!
//! # Unknown outcomes
//!
//! A request that timed out or lost its connection may still be applied by
//! the server later. Its retries reuse its owner token, and every script
//! reads correctly when repeated: an acquire that finds the lock holding
//! its own owner token adopts it (see **Acquire** above), a release sent
//! again reports `Released` from the `gone` marker (see **Release**); the
//! same for permits (see [Semaphores](#semaphores)).
//!
//! Every operation ends within the operation timeout counted from its
//! first send, whatever it does meanwhile (connecting, `EVAL` after
//! `NOSCRIPT`, the cluster driver's resends, `WAIT` and giving back an
//! unreplicated grant); a wait's subscription within the connect and
//! operation timeouts together. A command connection on which a request
//! failed or timed out is replaced by a new one (a connection that stays
//! open but never answers would otherwise fail every request: the
//! driver reconnects only once a connection closes), so the client
//! recovers by itself when the server or the path to it comes back.
//!
//! # Clocks
//!
//! Expiry follows the server's wall clock. A lease's local deadline is
//! measured on the client's monotonic clock from the moment the request
//! was sent. The server measures the TTL on its **wall clock**: `SET … PX`
//! and `PEXPIRE` store an absolute Unix time in milliseconds (`mstime()`,
//! `gettimeofday`), and a key is expired once `mstime()` passes it (Redis
//! 7.0.9:
//! [`pexpireCommand`](https://github.com/redis/redis/blob/7.0.9/src/expire.c#L689),
//! [`SET` PX](https://github.com/redis/redis/blob/7.0.9/src/t_string.c#L176),
//! [`keyIsExpired`](https://github.com/redis/redis/blob/7.0.9/src/db.c#L1616),
//! [`mstime`](https://github.com/redis/redis/blob/7.0.9/src/server.c#L189-L202)).
//! Redis has a monotonic clock (`getMonotonicUs`, `monotonic.c`) but uses it
//! only for event-loop timers, cron and script time limits; no command or
//! script call expires a key by it, and `TIME` is the wall clock too. So
//! there is no monotonic source distlock could use for expiry.
//!
//! **Assumption**: while a lock is held, the server's wall clock does not
//! step *forward* by more than the safety margin between the guard's stop
//! signal and its lease deadline. A forward step of `d` expires every lock
//! `d` early by real time: another client can acquire it while the holder
//! still believes it holds it, for up to `d`. A backward step only keeps
//! locks longer (a crashed holder's lock outlives its TTL by the step). Run
//! the server with a time daemon that slews rather than steps once running
//! (chrony with `makestep` limited to the first updates after boot, `ntpd
//! -x`); a slew runs the clock fast by a bounded rate (ntpd: at most
//! 500 ppm, 5 ms per 10 s of TTL; chrony: its `maxslewrate`). A failover
//! moves expiry to the new primary's clock (replicas receive absolute expiry
//! times), so the same bound applies to the clock difference between the
//! primary and its replicas.
//!
//! # Cancellation
//!
//! Each operation of [`RedisLock`] is one script call. Dropping its future
//! (say under `tokio::time::timeout`) after the request went out lets the
//! server finish it: an `acquire` may have
//! taken a lock, which the next attempt with the same owner token adopts,
//! and which otherwise expires after its TTL ([`LockClient::acquire`](distlock_core::LockClient::acquire)
//! and [`Locker`](distlock_core::Locker) release such a grant); an `extend` may
//! have extended the lock, for its new TTL; a `release` may have released
//! it, and then woke the waiters (`DEL` and `PUBLISH` are one script). A
//! dropped `watch` unregisters its waiter; if its `SUBSCRIBE` was in flight,
//! the channel is unsubscribed by the idle sweep within about 10 s. Other
//! waiters are not affected.
//!
//! # TLS
//!
//! `rediss://` (and `rediss+sentinel://`, `rediss+cluster://`, to the
//! sentinels too) connects over TLS (rustls with the ring provider,
//! trusting the platform's root certificates plus `tls_ca_file`, with an
//! optional client certificate from `tls_cert_file` and `tls_key_file`)
//! when the cargo feature **`tls`** is enabled; without it a `rediss://`
//! URL is refused with a message naming the feature. Every refusal is a
//! typed error within the connect timeout that says whether the
//! certificate or the connection is the problem (a TLS URL against a
//! plaintext port, or the reverse, gets a hint saying so). The tests run
//! `rediss://` against TLS-only servers with certificates from a
//! throwaway CA (`tests/redis_backend/tls.rs`), and the whole conformance
//! suite over TLS (`tls::…` in `tests/conformance.rs`).
//!
//! # Topologies
//!
//! - **One server**: `redis://`, `rediss://` or a Unix socket.
//! - **Sentinel** (`redis+sentinel://…/SERVICE`): the client finds the
//!   primary through the sentinels and finds it again after a failover;
//!   it never writes to a replica. Through a failover, guards keep their
//!   lock or report it [`lost()`](distlock_core::LockGuard::lost), and
//!   waiters get it.
//! - **Redis Cluster** (`redis+cluster://`): each lock's keys share one
//!   slot (the hash tag, see [How it works](#how-it-works)); its scripts
//!   and `WAIT` run on that slot's node, and its waiters subscribe to the
//!   slot's shard channel there (`SSUBSCRIBE`, `SPUBLISH`). When a primary
//!   dies its replica is promoted and the clients follow.
//!
//! Replication is asynchronous: a failover to a replica that had not
//! received a grant loses it. `min_replicas=N`
//! ([`RedisConfig::min_replicas`]) makes every acquisition and extension
//! wait (`WAIT N`, bounded by half the operation timeout) until `N`
//! replicas acknowledged it. An acquisition they do not acknowledge is
//! released again and reported as
//! [`Unavailable`](distlock_core::ErrorKind::Unavailable); an extension
//! they do not acknowledge is an error too, and the lease keeps its
//! previous expiry. Without it (the default, 0), a failover can let two
//! holders overlap; fencing tokens protect the resource in that window.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod config;
mod connect;
mod connection;
mod errors;
mod eviction;
mod keys;
mod listener;
mod replies;
mod scripts;
mod semaphore;
mod sentinel;
mod tls;
mod waiters;

pub use backend::RedisLock;
pub use config::{RedisConfig, DEFAULT_FENCE_RETENTION, MAX_FENCE_RETENTION};
#[doc(hidden)]
pub use scripts::acquire_script_sha;

/// The URL schemes the `distlock` facade opens with this crate (`rediss`
/// needs the `tls` feature). [`RedisLock::connect`] also accepts `unix://`
/// and `redis+unix://` socket URLs.
pub const SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
];

/// This backend for the `distlock` facade: Redis, the [`SCHEMES`], and
/// [`RedisLock::connect`] wrapped in a [`LockClient`](distlock_core::LockClient).
pub const DESCRIPTOR: distlock_core::BackendDescriptor =
    distlock_core::BackendDescriptor::new("Redis", SCHEMES, |url| {
        Box::pin(async move {
            Ok(distlock_core::LockClient::new(
                RedisLock::connect(url).await?,
            ))
        })
    });

/// The redis driver this backend is built on, re-exported so applications
/// build a [`ConnectionManager`](redis::aio::ConnectionManager) with the same
/// version.
pub use redis;
