//! PostgreSQL backend of distlock: locks as rows of a lease table.
//!
//! ```no_run
//! use std::time::Duration;
//! use distlock_core::{LockKey, LockOptions, Locker};
//! use distlock_postgres::PostgresLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), distlock_core::LockError> {
//! let lock = PostgresLock::connect("postgres://app:secret@127.0.0.1:5432/app?namespace=jobs").await?;
//! let locker = Locker::new(lock);
//! let key = LockKey::new("nightly-report")?;
//! if let Some(guard) = locker.try_lock(&key, &LockOptions::new(Duration::from_secs(30))).await? {
//!     // ... run the job, passing guard.fencing_token() to what it writes ...
//!     guard.release().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! [`PostgresLock`] is the raw [`LockBackend`](distlock_core::LockBackend)
//! (plus [`LockAdmin`](distlock_core::LockAdmin)); job code uses it through
//! [`LockClient`](distlock_core::LockClient) or
//! [`Locker`](distlock_core::Locker), which own owner tokens, lease
//! deadlines, waiting and renewal.
//!
//! # URL and parameters
//!
//! `postgres://user:password@host:port/database?parameters` (or
//! `postgresql://`, [`SCHEMES`]). The table of query parameters —
//! distlock's (`namespace`, `schema`, `table`, `pool_mode`, `listen_url`,
//! `retry_interval_ms`, `fence_retention_ms`, the timeouts), the TLS ones and the driver's own —
//! is on [`PostgresConfig`]; any other parameter is a configuration error
//! naming it.
//!
//! # How it works
//!
//! The client creates its table on first use (`public.distlock_locks` by
//! default). Each lock is one row per `(namespace, key)` holding the owner
//! token, a fencing counter and an expiry computed by the **database
//! clock**. Acquire, extend and release are one SQL statement each, atomic
//! on the server; keys are bind parameters (dollar-quoted literals behind a
//! transaction pooler), never SQL text. Guards of one client that share a
//! TTL renew together: one statement extends up to 500 locks (passed as
//! one JSON parameter), each checked and answered on its own. Waiters are woken by
//! `LISTEN`/`NOTIFY` on one shared connection per client (distlock-core's
//! [`Listener`](distlock_core::Listener)), one waiter per release in
//! arrival order (below), and by a timer set to the holder's remaining
//! lease in case the holder crashed; election observers hear changes of
//! holder on the same connection ([Observers](#observers)).
//!
//! ## Waiting
//!
//! Each lock and each semaphore has a waiter line on the server: rows of
//! the table [`WAITER_TABLE`] (`distlock_waiters`, in the lock table's
//! schema, created with the lock table, with its index by arrival
//! [`WAITER_INDEX`]), one per waiter, holding the lock
//! or semaphore table's name, namespace, key, the waiter's owner token
//! (`member`), the backend pid of its client's listener connection, its
//! arrival time and, for a lock's waiter that was woken, the end of its
//! turn (`turn_until`). So a release costs one acquire attempt, however many
//! wait ([`Capabilities::wakes_one_waiter`](distlock_core::Capabilities)):
//!
//! - a *waiting* attempt (one whose wait subscribed, so its client
//!   listens) that finds the key held joins the line in the acquire
//!   statement itself, keeping its place if it has one; a granted attempt
//!   leaves it in the same statement;
//! - a release wakes the first live waiter: it sends `NOTIFY` on the
//!   channel `<namespace's channel>_next_<pid>` (the waiter's listener's
//!   own) with payload `owner:key`, and the client whose waiter that is
//!   wakes it alone. A waiter whose listener pid no longer is in
//!   `pg_stat_activity` (its client is gone or reconnected) is deleted
//!   instead, up to 8 per release; a reconnected client's waiters
//!   subscribe again and store the new pid with their next attempt,
//!   keeping their place;
//! - a wait that ends without the lock (cancelled, out of time, an error)
//!   leaves the line with one more statement, run on a task when its watch
//!   drops, which wakes the next waiter if the key is free (the one leaving
//!   may have taken a wake-up with it).
//!
//! A lock's free key goes to its line's first waiter, not to whoever asks
//! first ([`Capabilities::fair_handoff`](distlock_core::Capabilities)):
//!
//! - the woken waiter of a lock stays at the head of the line with a
//!   *turn*: [`HANDOFF_TURN`] (5 s) by the database's clock
//!   (`clock_timestamp()` when it is woken). It keeps first place until
//!   it takes the key, its wait ends (it leaves, and the next waiter gets
//!   the turn), or its turn is over;
//! - an attempt on a free lock is granted only if no other waiter stands
//!   at the head of its line: waiters that are dead (as above) or whose
//!   turn is over are dropped from the line by it; a head never woken
//!   (the key came free by its holder's expiry, not a release) is woken
//!   and given its turn. Refused, the attempt's answer is the time left of
//!   the head's turn, and a waiting attempt joins the end of the line
//!   (keeping its place if it has one). Attempts that do not wait
//!   (`try_acquire`) are refused the same way while a waiter stands;
//! - an attempt by the owner who holds the lock (a retry whose earlier
//!   reply was lost) is granted again whatever the line says;
//! - a wait's first attempt that is most likely refused — another wait of
//!   the same client is in line for the key, or this client found the key
//!   taken in the last 10 s ([`CONTENDED_FOR`](distlock_core::CONTENDED_FOR):
//!   refused, or its release woke a waiter) — first sends a short statement
//!   that only joins the line when another owner holds the lock (the lock
//!   row locked and read, the waiter row written): a fraction of the full
//!   attempt's work, which the server otherwise sets up for a refusal. It
//!   never grants, so nothing is given back if its reply is lost; sent
//!   again, it keeps the place it took. With the lock free (or held by this
//!   owner, or anything unusual in the row) it writes nothing, and the full
//!   attempt follows;
//! - a wait's attempt after it was refused in line (woken at the head,
//!   most likely) first sends a short grant that takes the free key only on the
//!   requester's running turn, and leaves the line: a running turn already
//!   makes it the head (only the head is given one, and only an ended turn
//!   moves the head on), so the full attempt's judging of the line is not
//!   set up for it. It is given back if its caller leaves before the reply,
//!   as any grant; sent again after a lost reply it finds the key held by
//!   its own owner and writes nothing, and the full attempt adopts it.
//!   Without a running turn (a retry at its timer) or on a key not free,
//!   the full attempt follows; after an attempt whose outcome is unknown
//!   (which may have taken the key) the full attempt goes at once, and
//!   adopts.
//!
//! A turn's end is noticed by the next attempt on the key: a waiter
//! refused during a turn retries when it is over, and a waiter refused
//! while the key was held retries at the holder's expiry (so a woken
//! waiter that never comes — its client frozen — keeps the key from the
//! others for its turn, and at most until the released holder's expiry).
//! Permit lines take the woken waiter off the line instead, as before:
//! a permit goes to whoever asks first.
//!
//! Nothing locks a table: every statement that touches a line first locks
//! the key's row (the lock's or the semaphore's), so they take turns per
//! key. A waiter that joins while a release waits for that row is not in
//! the line the release reads (its snapshot is older); a release that finds
//! no live waiter therefore notifies the key on the namespace's channel,
//! which wakes every waiter of it, as every release did before — so no
//! wake-up is lost. Force-release and the give-back of a grant whose caller
//! left wake every waiter of the key the same way. Line rows are deleted
//! when granted, left, woken or found dead; nothing stays once the waits
//! are over, their turn's end kept with them.
//!
//! A release wakes a waiter on its client's listener connection alone
//! (the row names its pid). A wake-up there for a waiter that no longer
//! waits (its wait ended, and a request of it whose outcome was unknown
//! joined the line again after its leave) is passed on: the listener's
//! client sends the leave for it, which deletes the row and wakes the next
//! waiter if the lock or a permit is free. Without that, a lock's line
//! waited out that waiter's turn and the waiters behind it, never woken,
//! their timers (the released holder's expiry); a permit's lost the
//! wake-up.
//!
//! Limits: an attempt's statement reads the line as it was when the
//! statement started; one that waited for the key's row while a release
//! went by is refused and sent again at once (its lock row changed), but
//! one that started before a waiter joined may take a key that came free
//! by its holder's expiry (it asked before that waiter). A waiter row of a client that died, whose listener pid another
//! backend took meanwhile (a session pooler on `listen_url` keeps server
//! sessions and hands them on), takes one wake-up with it, unless that
//! backend listens for another client of the same table (which passes it
//! on); the next waiter then waits for its timer (the released holder's
//! expiry). Behind a
//! transaction pooler without `listen_url` waiters poll and never queue;
//! their client's releases still wake queued waiters of other clients. A
//! role that may not create `distlock_waiters`, or may not read, insert,
//! update and delete in it, works as before it existed (every waiter of
//! a key woken by each release; a warning at connect).
//!
//! Rolling upgrade from a version that woke every waiter (same storage
//! format): locks and permits stay exclusive. Old clients listen on the
//! namespace's channel only and never queue: a new client's release wakes
//! them only when no new client waits in line, else they wake at the
//! released holder's expiry; an old client's release wakes every waiter
//! of the key, new ones included, which then take turns as before.
//! Clients of the version before fair handoff (which queue, but take the
//! woken waiter off the line and give a free key to whoever asks first)
//! can still cut in, and a woken waiter loses its place when an old
//! client's release wakes it; exclusion is never at stake.
//!
//! ## Observers
//!
//! Observers of an election ([`Locker::observe`](distlock_core::Locker::observe),
//! through [`LockAdmin::watch_holder`](distlock_core::LockAdmin::watch_holder))
//! are woken on the namespace's `_holder` channel, payload the key, heard
//! on the waiters' listener connection: a labelled acquisition that takes
//! the lock notifies it in its statement (an unlabelled one sends nothing
//! more), as do the release of a lock its owner labelled (besides the
//! waiter it wakes), a force release and the give-back of a labelled
//! grant. Observers wait on local channels of their own, so they never
//! take a waiter's wake-up nor a place in a line, and their notifications
//! never wake a waiter (each release still costs one attempt). Expiry
//! notifies nobody: observers read at the leader's expiry. Without the
//! holder columns, or where nothing can `LISTEN` (a transaction pooler
//! without `listen_url`), observers poll
//! ([`Capabilities::holder_watch`](distlock_core::Capabilities::holder_watch)
//! false); a client of an earlier version takes and releases without
//! notifying them, so they see its changes when they next read.
//!
//! ## Semaphores
//!
//! [`PostgresLock`] is also a
//! [`SemaphoreBackend`](distlock_core::SemaphoreBackend): at most N live
//! permits of a key ([`LockOptions::with_permits`](distlock_core::LockOptions::with_permits),
//! [`LockClient::try_acquire_permit`](distlock_core::LockClient::try_acquire_permit)).
//! A semaphore is one row per `(namespace, key)` of a table of its own
//! (`distlock_semaphores` in the lock table's schema unless the
//! `semaphore_table` parameter says otherwise), so a semaphore and a lock
//! of one name share no row and no fencing counter. The row holds:
//!
//! | column | type | what |
//! |---|---|---|
//! | `namespace`, `key` | `text` | as for locks (the primary key) |
//! | `permit_limit` | `bigint` | the limit of the permits held; a request with another limit while one is live is refused (`InvalidInput` naming both); once none is live, the next request's limit is stored |
//! | `fencing` | `bigint` | the last fencing token granted to any permit of the semaphore; the row stays, so tokens keep growing |
//! | `owners`, `fencings`, `expires` | `text[]`, `bigint[]`, `timestamptz[]` | the permits, one index each, in the order granted: owner token (32 lowercase hex digits), fencing token, expiry by the database clock; a released permit stays given up, with an expiry in 1970 that encodes its attempt's send number (see [Unknown outcomes](#unknown-outcomes)); every write drops the permits that ran out, and all but the last `permit_limit` of the given-up ones |
//! | `updated_at` | `timestamptz` | the database time of the last write |
//! | `holders` | `jsonb` | the permits' holder labels, an object of owner token to label: an entry only for a permit whose holder gave a label, dropped when the permit is released or no longer live; NULL for none |
//!
//! Each permit call is one statement that writes that one row
//! (`INSERT ... ON CONFLICT DO UPDATE`, or `UPDATE`): its row lock, and
//! PostgreSQL's re-check of a row that changed while the statement waited
//! for it, make the call atomic under `READ COMMITTED` without locking
//! anything else (permits in rows of their own could not be counted in one
//! statement, whose snapshot predates the row lock). A permit attempt by an
//! owner token that holds a live permit adopts it (its fencing token, the
//! expiry reset). A row in any other form (a foreign owner, arrays of
//! different lengths, a token above the counter, a limit below 1) is
//! reported as `Corrupted` and never written. Permit waiters queue in a
//! line of their own, as lock waiters do (see [Waiting](#waiting)): a
//! returned permit wakes the first of them on the semaphore table's
//! channels ([`channel_name`] of schema, semaphore table and namespace,
//! and its `_next` channel), and two permits returned wake two. A client's
//! permit waiters listen on one more connection, opened with the first of
//! them (behind a transaction pooler without `listen_url` they poll, as
//! lock waiters do).
//!
//! ## Tables for DBAs
//!
//! The client creates its schema and tables if they are missing (the
//! semaphore table at connect as well; if that fails, locks still work and
//! semaphore calls report the error). Where applications may not `CREATE`,
//! create them once (these are the default names; `app` is the
//! application's role):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS public.distlock_locks (
//!     namespace text NOT NULL,
//!     key text NOT NULL,
//!     owner text,
//!     fencing bigint NOT NULL,
//!     expires_at timestamptz NOT NULL,
//!     holder text,
//!     holder_owner text,
//!     PRIMARY KEY (namespace, key)
//! );
//! CREATE TABLE IF NOT EXISTS public.distlock_semaphores (
//!     namespace text NOT NULL,
//!     key text NOT NULL,
//!     permit_limit bigint NOT NULL,
//!     fencing bigint NOT NULL,
//!     owners text[] NOT NULL,
//!     fencings bigint[] NOT NULL,
//!     expires timestamptz[] NOT NULL,
//!     updated_at timestamptz NOT NULL,
//!     holders jsonb,
//!     PRIMARY KEY (namespace, key)
//! );
//! CREATE TABLE IF NOT EXISTS public.distlock_format (
//!     lock_table text NOT NULL,
//!     namespace text NOT NULL,
//!     format text NOT NULL,
//!     PRIMARY KEY (lock_table, namespace)
//! );
//! CREATE TABLE IF NOT EXISTS public.distlock_waiters (
//!     lock_table text NOT NULL,
//!     namespace text NOT NULL,
//!     key text NOT NULL,
//!     member text NOT NULL,
//!     pid integer NOT NULL,
//!     arrival timestamptz NOT NULL,
//!     turn_until timestamptz,
//!     PRIMARY KEY (lock_table, namespace, key, member)
//! );
//! CREATE INDEX IF NOT EXISTS distlock_locks_fencing ON public.distlock_locks (namespace, fencing);
//! CREATE INDEX IF NOT EXISTS distlock_semaphores_fencing ON public.distlock_semaphores (namespace, fencing);
//! GRANT USAGE ON SCHEMA public TO app;
//! GRANT SELECT, INSERT, UPDATE, DELETE ON public.distlock_locks, public.distlock_semaphores TO app;
//! GRANT SELECT, INSERT ON public.distlock_format TO app;
//! GRANT SELECT, INSERT, UPDATE, DELETE ON public.distlock_waiters TO app;
//! ```
//!
//! `distlock_format` holds the format marker of each lock table and
//! namespace (see [`distlock_core::STORAGE_FORMAT`]): the first client of a
//! namespace adds its row, later ones only read it. A marker naming another
//! format is refused with [`ErrorKind::Config`](distlock_core::ErrorKind).
//! `distlock_waiters` holds the waiter lines of every lock and semaphore
//! table of the schema (see [Waiting](#waiting)); its rows come and go
//! with the waits (a waiter's row goes when it is granted, leaves, or is
//! found dead by a wake-up), so it holds at most one row per open wait,
//! plus those of waits whose client died until the key's next release.
//! The `_fencing` indexes (the table's name, cut to fit an identifier, and
//! `_fencing`) serve the sweep of idle rows (see [Fencing
//! tokens](#fencing-tokens-without-a-row-per-lock-name-forever)); a client
//! creates them with its tables, or on a table of an earlier version with
//! `CREATE INDEX CONCURRENTLY` (writes go on meanwhile), and works without
//! them if it may not (logging a warning), as it works without `DELETE`
//! (rows are then never reclaimed by that client; a warning says so). So
//! does [`WAITER_INDEX`] on `distlock_waiters`. A concurrent build that
//! failed or was cut off by the operation timeout leaves an invalid index
//! (kept up to date, never read): the next client to start drops it
//! (`DROP INDEX CONCURRENTLY`) and builds it again, unless a build is
//! working on it.
//!
//! `holder` is the label an acquisition gave
//! ([`HolderId`](distlock_core::HolderId), `LockOptions::with_holder`),
//! NULL for none, and `holder_owner` the owner token that stored it:
//! [`inspect`](distlock_core::LockAdmin::inspect) shows the label only
//! while that owner holds the lock, so a label is never shown for a later
//! holder, even one whose client predates the columns and leaves them as
//! they were. A client adds both (`ALTER TABLE ... ADD COLUMN IF NOT
//! EXISTS`, which only the table's owner may run; a catalog change, under
//! a 2 s `lock_timeout`) to a table of an earlier version; a role that may
//! not works without labels, logging a warning
//! ([`Capabilities::holder_ids`](distlock_core::Capabilities::holder_ids)
//! false, labels not stored), until the owner adds them:
//!
//! ```sql
//! ALTER TABLE public.distlock_locks ADD COLUMN IF NOT EXISTS holder text,
//!     ADD COLUMN IF NOT EXISTS holder_owner text;
//! ```
//!
//! A permit's label (`holders` of the semaphore row, keyed by the permit's
//! owner token) is shown by
//! [`inspect_permits`](distlock_core::LockAdmin::inspect_permits) only for
//! the live permit of that owner token; an entry an older client left
//! behind, or anything else in the column (not an object, a value that is
//! not a valid label), is never shown and stops no permit call. The column
//! is added to a semaphore table of an earlier version the same way (a
//! role that may not works without permit labels:
//! [`Capabilities::permit_holder_ids`](distlock_core::Capabilities::permit_holder_ids)
//! false), or by its owner:
//!
//! ```sql
//! ALTER TABLE public.distlock_semaphores ADD COLUMN IF NOT EXISTS holders jsonb;
//! ```
//!
//! The waiter table's `turn_until` is added to a table of an earlier
//! version the same way; a role that may not works as if it could not
//! write the table (every waiter of a key woken by each release, and no
//! [`fair_handoff`](distlock_core::Capabilities::fair_handoff)), until
//! the owner adds it:
//!
//! ```sql
//! ALTER TABLE public.distlock_waiters ADD COLUMN IF NOT EXISTS turn_until timestamptz;
//! ```
//!
//! ## Fencing tokens without a row per lock name forever
//!
//! A key's fencing counter lives in its row. The token is
//! `greatest(counter + 1, database clock in microseconds since the Unix
//! epoch)` (`clock_timestamp()`; a new row starts at the clock), and a row
//! nobody has held for [`fence_retention`](PostgresConfig::fence_retention)
//! (default one hour) is deleted: a lock row free or expired for the
//! retention, whose counter is more than the retention behind the clock
//! (every token is at least the clock reading of its acquisition, so its
//! last acquisition is older than that); a semaphore row once every permit
//! is. So a scheduler that locks a new name per run leaves a bounded
//! table behind, while tokens keep growing: within the retention the
//! counter orders them; after it, the clock has moved past every token
//! issued for the key (tokens track the clock to within the number of
//! acquisitions per microsecond). Adoption keeps the token it adopts.
//! A held lock or permit is never deleted, whatever its TTL, so no "twice
//! the TTL" floor is needed as on Redis, whose counter is a key apart from
//! the lock.
//!
//! The clients delete these rows themselves: at most one sweep per client
//! per interval (half the retention, between 1 s and 60 s), started by an
//! acquisition (and by the first one of each client) on a task the
//! acquisition does not wait for, which ends with the client, over one
//! connection of its own (closed after the sweep: a lock call never waits
//! for a connection the sweep holds). It deletes
//! up to 100 rows per statement, statement after statement until one
//! deletes fewer (every idle row goes in one sweep), only in
//! its client's namespace (whose clients should share one retention),
//! picking rows `FOR UPDATE SKIP LOCKED` through the `_fencing` index
//! above, with no table lock; the `DELETE` checks the conditions again on
//! the row it deletes, so a row acquired meanwhile stays. A row is gone
//! within about the retention plus one interval after its last use, as
//! long as some client acquires in its namespace.
//!
//! **Assumption** (see also [Clocks](#clocks)): the database server's clock
//! never steps back by more than the retention (a time daemon slews, it
//! does not jump hours back). A bigger backward step followed by a row's
//! deletion could issue a token lower than an earlier one of that key.
//! Before this, tokens depended on no clock: that is what the bounded
//! table costs. PostgreSQL is otherwise durable (`Capabilities::durable`
//! is `true`): a restart or a failover to a synchronous replica keeps the
//! counters, and the clock of the promoted host then counts as a step.
//! Two smaller costs, for a lock held longer than the retention (its row
//! may go as soon as it is released, the release time not being stored):
//! a release resent after a lost reply may find no row and read `NotHeld`
//! rather than `Released`, and a late send of that acquisition applied
//! after the row went takes the lock for nobody until its TTL (see
//! [Unknown outcomes](#unknown-outcomes); a give-back moves the counter to
//! the clock, so its row is kept for the retention from then).
//!
//! # Unknown outcomes
//!
//! A statement that timed out, or whose connection broke, may still be
//! applied by the server later. This backend keeps distlock's rule for
//! such requests:
//!
//! - **Adoption**: an acquire that finds the lock held, live, by its own
//!   owner token (an earlier attempt of the same acquisition whose reply was
//!   lost) gets it, in the same statement: the lock's existing fencing token,
//!   its expiry reset to the request's TTL by the database clock.
//! - **Exact give-back**: each statement runs on a task of its own that reads
//!   its reply even after the caller stopped waiting (its timeout, or a
//!   dropped future), bounded by one more operation timeout. A lock an
//!   acquire was granted after its caller left is then given back by the
//!   row version that acquire wrote, so a lock adopted or renewed since by a
//!   later attempt is never undone.
//! - **Given-up rows refuse late sends**: release and give-back keep the
//!   owner token in the row and set its expiry to a moment in 1970 that
//!   encodes the acquisition's *send number* (numbers grow with every
//!   acquire this process starts). Such a row is free for everyone, but an
//!   acquire of that owner token with a send number up to it is refused, so
//!   an earlier send that the server applies late — after the release, or
//!   after the give-back — never takes the lock for nobody. Nor does such
//!   a send of a waiting acquisition (lock or permit) join the waiter
//!   line: its wait is over, and its row would name the client's live
//!   listener (a wake-up for it is passed on, see "Waiting", at the cost
//!   of a round trip). A later
//!   acquisition with the same owner token has a greater number and is not
//!   refused. Older versions of this crate read such a row as expired.
//! - **Permits**: an attempt by the owner token that holds a live permit
//!   adopts it, so the client settles a permit attempt whose reply was lost
//!   with one more attempt of the same token and gives back what it gets
//!   (a release). Permit attempts are numbered from the same sends as lock
//!   acquires, and a released permit stays in the row given up, with its
//!   owner token and its attempt's send number encoded in its expiry as for
//!   a lock row: it counts for nothing against the limit, but a permit
//!   attempt of that owner token with a send number up to it is refused. So
//!   an earlier send applied after the release, or after the settling
//!   attempt gave back what it got, takes no permit for nobody. A row keeps
//!   the last `permit_limit` of its given-up permits (other writes of the
//!   row keep them too), so it holds at most twice its limit. A release sent
//!   again on another connection after its first send was applied finds
//!   the permit given up with its fencing token and is `Released`. Older
//!   versions of this crate read a given-up permit as expired and drop it.
//!
//! What is left: if the give-back itself cannot run (the server unreachable
//! until the operation timeout passes), or another client takes and frees
//! the row before a late send lands, that send's lock expires after its TTL.
//! For permits the same holds when the settling attempt finds the semaphore
//! full (nothing to give back, so nothing given up), or when `permit_limit`
//! later permits were given up before the late send lands.
//!
//! ## Lost connections
//!
//! A pooled connection the server closed — while idle in the pool
//! (`idle_session_timeout`, a restart, a pooler's timeouts) or while its
//! statement ran (`pg_terminate_backend`) — is closed and the statement sent
//! again on another connection: every lock statement reads correctly when
//! repeated (an acquire adopts the lock its own owner token holds, a release
//! finds the row given up with its fencing token). The caller sees an error
//! only if the server stays unreachable. Every call ends within its
//! operation timeout counted from its *first* send: a resend gets what is
//! left of it, never a timeout of its own. A lost listener connection wakes
//! its waiters, who subscribe again on a new one. Keep
//! `idle_session_timeout` above 10 s (the listener pings a quiet connection
//! every 10 s), or the listener is reopened each time it fires.
//!
//! # Clocks
//!
//! A lock's expiry is `clock_timestamp() + ttl` when the statement runs,
//! and every later statement compares it with `clock_timestamp()`: the
//! **wall clock** (`CLOCK_REALTIME`) of the database host. Client clocks
//! never matter; a client dates its lease with its own monotonic clock from
//! the moment *before* it sent the acquire, so it believes in the lock no
//! longer than the server keeps it — as long as the database's wall clock
//! advances at the rate of real time. What breaks that:
//!
//! - a forward **step** of Δ on the database host (NTP stepping, an
//!   operator's `date -s`, a VM resumed with a stale clock then corrected)
//!   expires every live lock up to Δ early: another client can acquire while
//!   the holder's guard still counts time it does not have, so two holders
//!   overlap for up to Δ. A backward step keeps locks up to Δ longer
//!   (waiters wait longer; safety is not affected);
//! - a **failover** to another host (a promoted replica) carries the
//!   expiries over, to be compared with that host's clock: the offset
//!   between the two clocks acts as a step.
//!
//! So run the database host with a disciplined clock that slews rather than
//! steps once the server is up (chrony's default `makestep` only corrects
//! at boot; ntpd's `-x`), keep replicas synchronised the same way, and if
//! a step larger than the guard's safety margin is possible, choose TTLs
//! and margins that absorb it. PostgreSQL offers no monotonic clock to SQL
//! (`now()`, `statement_timestamp()`, `clock_timestamp()` and `timeofday()`
//! all read the wall clock; the monotonic timer behind `EXPLAIN ANALYZE` is
//! not exposed), and a monotonic reading would not survive a server restart
//! or failover, which the stored expiries must; so this backend uses the
//! wall clock and states the assumption here.
//!
//! # Cancellation
//!
//! Every future of [`PostgresLock`] may be dropped at any await point (a
//! caller's timeout). A statement in flight goes on on its own task (see
//! above): the connection goes back to the pool once its reply is read, or
//! is closed if none comes within one more operation timeout; a lock an
//! acquire was granted is given back (if that fails, it expires after its
//! TTL). A dropped extend or release may or may not have taken effect.
//!
//! # TLS
//!
//! With the `tls` cargo feature (rustls with the ring provider), libpq's
//! `sslmode`, `sslrootcert`, `sslcert` and `sslkey` work as in a libpq
//! connection string, and `tls_ca_file`, `tls_cert_file`, `tls_key_file`
//! (the names every distlock backend takes) mean `sslrootcert`, `sslcert`
//! and `sslkey`; naming one file both ways is refused. A CA file is trusted
//! in addition to the platform's roots. Naming a CA or client certificate
//! without `sslmode` means `verify-full`. The listener connection uses the
//! same settings (`listen_url` too, unless it has TLS settings of its own).
//! An untrusted server certificate, one for another host name, a client
//! certificate the server refuses or lacks, a missing or unreadable file,
//! TLS asked of a server without it and plaintext refused by a TLS-only
//! server are each a [`Config`](distlock_core::ErrorKind::Config) error within
//! the connect timeout, saying whether the certificate or the connection is
//! the problem. Known limit: `verify-ca` still checks the host name (sqlx
//! 0.8.6 with rustls 0.23.24+, launchbadge/sqlx#3793), so it behaves as
//! `verify-full`. With the feature on, the default `sslmode=prefer` asks
//! every server for TLS first (one extra round trip per new connection to
//! a server without it; `sslmode=disable` skips it). distlock reads the
//! files itself and gives the driver their contents: the listener's and
//! the sweep's connections read them at every connect, the pool's new
//! connections get them as read at connect and then at each sweep (at most
//! one sweep interval old: half the fencing retention, 1 to 60 s, while
//! the client takes locks), so renewed certificates are picked up. (Given
//! a path, sqlx reads the file on a blocking thread and panics if the
//! runtime shuts down meanwhile; read by distlock, that is an error.)
//!
//! # Topologies
//!
//! The client talks to the one server its URL names (after a failover, to
//! whichever server that address then reaches; see [Clocks](#clocks) for
//! what a failover does to expiry), directly or through a connection
//! pooler.
//!
//! ## Behind a connection pooler
//!
//! No lock statement keeps session state (no advisory locks, no `SET`), but
//! the driver's prepared statements and `LISTEN` do:
//!
//! - **A plain URL** (no `pool_mode`, [`PoolMode::Auto`]): at connect the
//!   client probes whether the URL reaches a transaction pooler — with two
//!   client connections, whether one sees the other's server session, or
//!   its own transactions move to another one (see [`PoolMode::Auto`]).
//!   Found, it works as with `pool_mode=transaction` below (waiters poll
//!   unless `listen_url` is given) and logs a warning naming
//!   `pool_mode=transaction` and `listen_url`;
//!   [`PostgresLock::pool_mode`] tells. Before this, a plain URL behind
//!   PgBouncer 1.18 in transaction mode half worked: some clients ran,
//!   others failed with `42P05 prepared statement "sqlx_s_1" already
//!   exists` (an operator saw 6, then 13, of 48 `distlock run` complete) —
//!   and a statement's `Bind` could even run another client's prepared
//!   statement of the same name. A busy pooler
//!   can pass for a session pool during the probe; then the first
//!   statement that meets another client's prepared statements (`42P05`,
//!   `26000`, a `Bind` for another statement: all refused before the
//!   statement runs) switches the client to the simple protocol for good
//!   and is sent again. A direct connection or a session pool never passes
//!   for a transaction pooler.
//! - **Direct, or session pooling** (PgBouncer `pool_mode = session`):
//!   found by the probe, or said with `pool_mode=session` (no probe).
//!   Named prepared statements; waiters `LISTEN` on the same server.
//! - **Transaction (or statement) pooling** (PgBouncer `pool_mode =
//!   transaction`, PgBouncer 1.18 included): found by the probe, or said
//!   with `pool_mode=transaction` (no probe).
//!   - Statements then use the simple query protocol with the values as
//!     dollar-quoted literals (see the `sql` module: nothing in them is
//!     special, whatever `standard_conforming_strings` and `backslash_quote`
//!     say, and they reach the same rows as bind parameters, on a
//!     `SQL_ASCII` database too): a transaction pooler may run each message
//!     of a client on another server session, which breaks named prepared
//!     statements (`42P05 prepared statement "sqlx_s_1" already exists`,
//!     `26000`) and even sqlx's unnamed ones (its `Parse`/`Describe` and
//!     `Bind`/`Execute` are two round trips). It costs the server a parse
//!     and plan per statement: try-acquire + release took 3.4 to 4.5 times
//!     as long (p50) as with prepared statements on a direct connection,
//!     and 16 tasks managed 0.24 to 0.34 of the throughput (`cargo bench -p
//!     distlock-postgres --bench protocols`, three runs on a loaded 2-core VM),
//!     which is why it is not the default.
//!   - Waiters `LISTEN` on `listen_url`, pointing past the pooler
//!     (directly, or through a session-mode pool), and are woken by
//!     `NOTIFY` as on a direct connection. Without `listen_url` nothing
//!     can wake them (a `LISTEN` through the pooler would stay on a shared
//!     server session), so they poll: an acquire attempt every
//!     `retry_interval_ms` (default 100) per waiting call, and
//!     [`Capabilities::native_wait`](distlock_core::Capabilities) is false.
//!     Still correct (every attempt is the atomic acquire statement); a
//!     release is noticed on the next poll: a handoff took 57 ms at the
//!     median and 93 ms at p90, against 1.4 ms and 2.0 ms with
//!     `listen_url` (same benchmark).
//!   - PgBouncer 1.21+ with `max_prepared_statements` tracks protocol-level
//!     prepared statements itself; there `pool_mode=session` (which skips
//!     the probe) with `listen_url` keeps prepared statements (not tested
//!     here: the test machine has 1.18).
//! - A notification that reaches one of the client's pooled connections
//!   (its server session listens because someone sent `LISTEN` through the
//!   pooler) never fails an operation: it is skipped, and a statement it
//!   interrupted before running is sent again.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod config;
mod errors;
mod keys;
mod listener;
mod probe;
mod requests;
mod rows;
mod semaphore;
mod sql;
mod sweep;
mod table;

pub use backend::PostgresLock;
pub use config::{
    PoolMode, PostgresConfig, DEFAULT_FENCE_RETENTION, DEFAULT_RETRY_INTERVAL, DEFAULT_SCHEMA,
    DEFAULT_SEMAPHORE_TABLE, DEFAULT_TABLE, FORMAT_TABLE, MAX_FENCE_RETENTION, WAITER_INDEX,
    WAITER_TABLE,
};
pub use keys::{channel_name, MAX_IDENTIFIER_BYTES};
#[doc(hidden)]
pub use sql::{PermitStatementTexts, StatementTexts};
/// The driver, for building pools and connect options by hand.
pub use sqlx;

/// How long a lock's waiter that a release (or a leave, or an attempt on
/// a free key) woke keeps first place in its line while the key is free,
/// by the database's clock: see [Waiting](crate#waiting).
pub const HANDOFF_TURN: std::time::Duration = std::time::Duration::from_secs(5);
pub use sqlx::postgres::{PgConnectOptions, PgPool};

/// The URL schemes of this backend.
pub const SCHEMES: &[&str] = &["postgres", "postgresql"];

/// This backend for the `distlock` facade: PostgreSQL, the [`SCHEMES`], and
/// [`PostgresLock::connect`] wrapped in a [`LockClient`](distlock_core::LockClient).
pub const DESCRIPTOR: distlock_core::BackendDescriptor =
    distlock_core::BackendDescriptor::new("PostgreSQL", SCHEMES, |url| {
        Box::pin(async move {
            Ok(distlock_core::LockClient::new(
                PostgresLock::connect(url).await?,
            ))
        })
    });
