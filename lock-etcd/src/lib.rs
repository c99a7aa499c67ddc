//! The etcd v3 backend of distlock.
//!
//! ```no_run
//! use std::time::Duration;
//! use distlock_core::{Locker, LockKey, LockOptions};
//! use distlock_etcd::EtcdLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), distlock_core::LockError> {
//! let lock = EtcdLock::connect("etcd://locker:secret@127.0.0.1:2379?namespace=jobs").await?;
//! let locker = Locker::new(lock);
//! let key = LockKey::new("nightly-report")?;
//! if let Some(guard) = locker.try_lock(&key, &LockOptions::new(Duration::from_secs(30))).await? {
//!     // ... run the job; the guard renews the lease ...
//!     guard.release().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! [`EtcdLock`] is the raw [`LockBackend`](distlock_core::LockBackend) (plus
//! [`LockAdmin`](distlock_core::LockAdmin)); job code uses it through
//! [`LockClient`](distlock_core::LockClient) or [`Locker`](distlock_core::Locker),
//! which own owner tokens, lease deadlines, waiting and renewal.
//!
//! Building this crate needs `protoc` and the protobuf well-known types
//! (`google/protobuf/descriptor.proto` and friends), as the etcd client's
//! build script compiles etcd's `.proto` files:
//!
//! - Debian/Ubuntu: `apt-get install protobuf-compiler libprotobuf-dev`
//!   (the second is only a recommendation of the first);
//! - macOS: `brew install protobuf`;
//! - elsewhere: unpack a `protoc-*.zip` release from
//!   <https://github.com/protocolbuffers/protobuf/releases> and set
//!   `PROTOC=<dir>/bin/protoc` and `PROTOC_INCLUDE=<dir>/include`.
//!
//! # URL and parameters
//!
//! `etcd://[user:password@]host[:port][,host[:port]...][?parameters]`, or
//! `etcds://` for TLS to every endpoint (see [TLS](#tls)). The URL forms
//! and the table of query parameters are on [`EtcdConfig`].
//!
//! With authentication enabled in etcd, the URL's user needs a role with
//! readwrite permission on the prefix `NS/lock/` (see
//! [`EtcdLock::key_prefix`]; it covers locks, semaphores and their waiter
//! queues); a wrong password is reported as
//! [`ErrorKind::Config`](distlock_core::ErrorKind::Config).
//!
//! # How it works
//!
//! A lock is an etcd key in the client's namespace (`NS/lock/<escaped key>`)
//! attached to an etcd lease with the lock's TTL, written by a transaction
//! that succeeds only if the key does not exist. etcd deletes the key when
//! the lease runs out, by its own clock, so a crashed holder cannot wedge a
//! lock. The fencing token is the key's `create_revision`, from etcd's
//! global, durable revision counter. Waiters are woken by an etcd watch on
//! the holder's key, not by polling, in FIFO order (see [`EtcdLock`]).
//!
//! ## Waiting
//!
//! Handoff is fair ([`Capabilities::fair_handoff`](distlock_core::Capabilities::fair_handoff)):
//! a free lock goes to the first waiter in its line, never to whoever asks
//! first. The acquire transaction takes a free key only if no waiter's
//! queue entry (`NS/lock/<escaped key>/waiters/<id>`) was created before
//! the requester's own, or, for an attempt that is not in line (a
//! `try_lock`, or a holder that released and asks again), only if the line
//! is empty; one compare over the queue's key range does it (etcd 3.3 or
//! later). A refused attempt on a free key reports no expiry: the first
//! waiter is woken by its own watch, the others by theirs when they become
//! first. The woken first waiter keeps its place until it takes the lock
//! (leaving the line in the same transaction) or its wait ends (its entry
//! is deleted at once, and the next waiter moves up). Its turn has no
//! timer of its own: the queue entry lives on its client's session lease
//! of 5 s (kept alive every third of it: 0.6 keep-alives a second per
//! waiting client, whatever the handoff rate), so a client that froze or
//! died loses its entry, and its place, within 5 s, when etcd expires that
//! lease, and the next waiter is woken then (as a woken waiter's turn on
//! the other backends). A waiter that expects to be refused
//! reads first (one read-only request: no lease granted, nothing written
//! through Raft); right after it joined the line behind someone (or
//! behind another owner's lock), it is refused without a request, from
//! what its entry's own transaction read, and so is an attempt not in
//! line while one of its client's own waiters is in the line (a crowd in
//! one process: the holder that released and asks again). Each waiter's watch is
//! cancelled as soon as it moves up or leaves (gathered over 10 ms), so a
//! release is sent to the watches of waiters that wait, not to every
//! waiter that came and went lately. Semaphore permits
//! are served in their line's order among waiters, but a permit attempt
//! does not look at the line.
//!
//! A holder's label ([`HolderId`](distlock_core::HolderId)) is a sibling
//! key, `NS/lock/<escaped key>/holder`, valued `dl1:<owner token in
//! hex>/<label>`, written in the lock's own transactions (no extra round
//! trip) on the lock's lease; `inspect` shows it only while its owner
//! holds the lock. The lock's value is unchanged, so clients that predate
//! labels read locks of newer ones. Observers
//! ([`watch_holder`](distlock_core::LockAdmin::watch_holder)) share one
//! etcd watch per client and key, on the lock key's creations and
//! deletions, outside the waiter queue.
//!
//! A lock whose guard renews it goes on a lease shared by the client's
//! renewed locks (one per TTL, kept alive by one keep-alive stream), so
//! taking it costs one round trip and renewing it one small confirming
//! request, shared: the guards of one client and TTL renew together, and
//! one transaction reads up to 1,024 of their keys as at most 128 range
//! reads over runs of the sorted keys (etcd's default `--max-txn-ops`; a
//! server that refuses that many gets fewer ranges from then on; distlock
//! needs at least 8, and the conformance suite passes against a server
//! with 8), each checked on its own (created at its
//! fencing token, holding its owner's value, still on the session lease); locks
//! without renewal get a lease of their own, two round trips, so their TTL
//! is exact. See [`EtcdLock`] for the costs of each operation.
//!
//! ## Semaphores
//!
//! [`EtcdLock`] is also a [`SemaphoreBackend`](distlock_core::SemaphoreBackend)
//! (at most N holders of a key: [`LockOptions::with_permits`](distlock_core::LockOptions::with_permits)).
//! A permit is the key `NS/lock/%sem/<escaped key>/permits/<client>-<slot>`
//! (a name its client reuses once the acquisition that had it ended, or
//! its own lease's TTL passed unreleased: every
//! attempt reads the whole range, and etcd walks each key it ever had until
//! it compacts), valued `dl1:<owner token in hex>/<limit>`, on an etcd
//! lease of its own with the permit's TTL. A permit whose guard renews it goes on
//! the client's session lease of that TTL instead, as a renewed lock: a
//! holder that stops renewing it (or dies) frees it within that TTL, and
//! renewing it is one confirming request. The
//! holders are the first `limit` permits by create revision: an attempt
//! puts its permit and reads every permit in one transaction, and gives
//! it back at once (revoking its lease, or deleting it from the session
//! lease) if `limit` older ones exist; attempts at once do not conflict.
//! The fencing token is the permit's create revision; the limit is stored
//! in every permit's value, so it goes with the last permit. A permit's
//! holder label is the sibling key `NS/lock/%sem/<escaped key>/holders/<owner
//! token in hex>` (valued as a lock's label), put on the permit's lease in
//! the permit's own transaction (none without a label), moved by extend
//! and deleted by release with it;
//! [`inspect_permits`](distlock_core::LockAdmin::inspect_permits) reads
//! the permits and labels in one transaction. Costs: 3
//! round trips to take a permit (read, lease grant, transaction; 2 for a
//! renewed one: read, transaction), 1 read when every permit is taken;
//! extend as a plain lock's (2; a renewed permit's with its TTL: 1
//! confirming transaction), release 1. Waiters
//! queue FIFO under `NS/lock/%sem/<escaped key>/waiters/`; the first
//! `limit` of them watch deletions of the permits, the others the entry
//! before them. A semaphore and the lock of one name share nothing.
//!
//! TTLs are whole seconds: shorter or fractional TTLs are rounded up (1.2 s
//! becomes 2 s), and a server with default settings grants at least 2 s
//! (1.5 × its election timeout). [`EtcdLock`]'s
//! [`capabilities`](distlock_core::LockBackend::capabilities) declare a 1 s
//! minimum and 1 s granularity, so [`LockClient`](distlock_core::LockClient)
//! rounds up before asking.
//!
//! # Unknown outcomes
//!
//! A request is sent again, within the operation timeout:
//!
//! - when it never reached a server (with several endpoints), or a member
//!   refused it for want of a leader: nothing happened;
//! - when its outcome is unknown (the connection broke under it, the
//!   leader changed, no answer within a third of the timeout: a request a
//!   follower forwarded to a leader that then died is never answered) and
//!   a second send is harmless: reads, renewals, releases (a second may
//!   report "not held" for a lock the first released), and acquires (a
//!   second that finds the lock holding its own owner token knows the
//!   first won, and adopts the lock in the same transaction).
//!
//! A permit attempt sent again finds its owner's permit and adopts it (see
//! [Semaphores](#semaphores)); one whose outcome stays unknown revokes its
//! lease, which deletes the permit if the request was applied and makes it
//! fail if it is applied later (a renewed permit's attempt, on the session
//! lease, is undone by the session as a renewing acquire: the deletion
//! puts up a fence that makes the attempt, applied later, write nothing).
//!
//! A renewing acquire whose session is lost while the request is in flight
//! is refused (see [`EtcdLock`]): the lock it created goes with the
//! session lease, so no lease is dated from it.
//!
//! # Clocks
//!
//! Client clocks never matter: a client dates its lease from the moment
//! *before* it sent the request (for a lock on a session lease, from the
//! send time of the session's last confirmed keep-alive, if earlier), and
//! etcd expires the lease by its own clock. etcd's leader counts lease
//! time with the Go runtime's monotonic clock, so a step of a member's wall
//! clock moves no expiry; a newly elected leader starts every lease's TTL
//! again (plus an election timeout), so an election can only make a lock
//! outlive its TTL, never expire it early. Fencing tokens are revisions,
//! not times.
//!
//! # Cancellation
//!
//! Each future of [`EtcdLock`] may be dropped at any await point (under a
//! timeout, say). A dropped `watch`, and so a dropped waiting acquire,
//! leaves no queue entry behind. A dropped renewing acquire leaves at most
//! a lock that the session deletes a TTL after the request was sent. A
//! dropped plain acquire or `extend` leaves at most a lock, or an unused
//! lease, that etcd expires after the requested TTL (a dropped `extend`
//! may have moved the lock to a lease of that TTL, so after dropping one
//! with a shorter TTL assume the shorter one). A dropped `release` leaves
//! the lock to expire as if it had not been released. The same holds for
//! permits: a dropped permit attempt or extend leaves at most a permit, or
//! an unused lease, that etcd expires after the requested TTL (a renewing
//! permit attempt: that the session deletes a TTL after the request was
//! sent), and a dropped permit waiter leaves no queue entry.
//!
//! # TLS
//!
//! `etcds://` speaks TLS to every endpoint (cargo feature `tls`: rustls
//! with the ring provider), trusting the platform's roots plus
//! `tls_ca_file=PATH`, with a client certificate from
//! `tls_cert_file=PATH&tls_key_file=PATH` for etcd's `--client-cert-auth`
//! (see [`EtcdConfig`]).
//!
//! A certificate problem is a [`Config`](distlock_core::ErrorKind::Config)
//! error at connect that names it: the server's certificate not signed by
//! a trusted CA, not naming the host in the URL, or out of its validity
//! period; a client certificate missing or refused (etcd refuses it after
//! the TLS handshake, which the gRPC client reports only as a closed
//! connection, so a second, diagnostic handshake reads the server's
//! alert); a file that is missing, unreadable or not PEM of the right
//! kind. A TLS URL against a plaintext port, and a plaintext URL against
//! a TLS port, are [`Unavailable`](distlock_core::ErrorKind::Unavailable)
//! errors that say so. None waits longer than the connect timeout.
//!
//! # Topologies
//!
//! One member or a cluster: list every member in the URL. The client
//! spreads requests over them, sends a member's requests elsewhere when it
//! is down or cut off, and asks etcd to refuse requests at once on a
//! member without a leader (require-leader), so a request is sent again
//! (see [Unknown outcomes](#unknown-outcomes)).
//!
//! A request that fails in a way that may be a member's fault makes the
//! client check every member on a connection of its own; one that does
//! not answer a read within a third of the operation timeout is taken out
//! of the channel until it does (never the last one). A session's
//! keep-alive stream is reopened when a keep-alive goes unanswered for
//! half its period. So through a leader's death (an election), or a
//! member cut off from the client, guards keep their locks if their
//! renewals get through before the stop moment, or report
//! [`lost()`](distlock_core::LockGuard::lost) before anyone else can get the
//! lock; waiting acquires ride it out (distlock-core retries them until their
//! deadline) and get the lock once a leader exists; fencing tokens (etcd
//! revisions) keep growing, across a whole-cluster restart too. Choose a
//! TTL of a few election timeouts at least (etcd's default election
//! timeout is 1 s; a 3-member cluster elects a leader within about two).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
mod backend;
mod by_owner;
mod config;
mod connect;
mod connection;
mod errors;
mod fence;
mod health;
mod keys;
mod listener;
mod marker;
mod permit_names;
mod queue;
mod requests;
mod semaphore;
mod session;
mod slots;
#[cfg(feature = "tls")]
mod tls;
mod txn;

/// The URL schemes this backend opens (`etcds://` needs the `tls` feature).
pub const SCHEMES: &[&str] = &["etcd", "etcds"];

/// This backend for the `distlock` facade: etcd, the [`SCHEMES`], and
/// [`EtcdLock::connect`] wrapped in a [`LockClient`](distlock_core::LockClient).
pub const DESCRIPTOR: distlock_core::BackendDescriptor =
    distlock_core::BackendDescriptor::new("etcd", SCHEMES, |url| {
        Box::pin(async move {
            Ok(distlock_core::LockClient::new(
                EtcdLock::connect(url).await?,
            ))
        })
    });

pub use backend::EtcdLock;
pub use config::{EtcdConfig, DEFAULT_PORT};

/// The etcd client crate this backend is built on, for
/// [`EtcdLock::from_client`].
pub use etcd_client;
