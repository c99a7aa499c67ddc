//! [`PostgresLock`]: the lease-table backend: the client and the trait
//! impls; sending a statement (timeouts, resends, the pooler-safe
//! protocol) lives in `requests`, table creation in `table`, reading rows
//! in `rows`.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    AcquireReply, AcquireRequest, Capabilities, ContendedKeys, ExtendReply, FencingToken, Grant,
    HeldLock, HolderId, Listener, LockAdmin, LockBackend, LockError, LockKey, LockState, OpenWaits,
    OwnerToken, ReleaseReply, ReleaseWatch, SemaphoreBackend, Unclaimed, WaitLine, WaitPlace,
    IN_LOCK_CALL,
};
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::sync::OnceCell;

use crate::config::{PoolMode, PostgresConfig, TlsSettings};
use crate::errors;
use crate::keys::{channel_name, qualified_table};
use crate::listener::{holder_channel, next_channel, Releases, Topic};
use crate::probe;
use crate::semaphore::Semaphores;
use crate::sql::{self, Arg, Call, GiveBack, Protocol, Sql, Statements};
use crate::sweep::{SweepJob, Sweeper, SweptTable};

/// How much later than the connect timeout the bound around connecting
/// ends (see `PostgresLock::with_config`).
const CONNECT_BOUND_SLACK: Duration = Duration::from_millis(250);

/// A lock backend on a PostgreSQL lock table.
///
/// Each lock is one row `(namespace, key, owner, fencing, expires_at,
/// holder, holder_owner)` of a
/// table the client creates on first use (`public.distlock_locks` unless
/// configured; idempotent, safe when many clients start at once; PostgreSQL
/// 13 or newer). Expiry is computed by the database clock. Acquire, extend
/// and release are one statement each; rows stay after release (marked
/// given up, see the crate docs on unknown outcomes) until nobody has held
/// them for the [fencing retention](PostgresConfig::fence_retention), when
/// the clients' sweep deletes them; fencing tokens follow the database
/// clock so they keep growing across that (see the crate docs, [Fencing
/// tokens](crate#fencing-tokens-without-a-row-per-lock-name-forever)).
///
/// No lock statement uses session state — no advisory locks, no `SET`.
/// Behind a transaction pooler (`pool_mode=transaction`, or found at
/// connect when the URL has no `pool_mode`) statements use the
/// simple query protocol, and waiters (and election observers) are woken by `LISTEN`/`NOTIFY` on one
/// extra connection per client that reaches the server directly or through
/// a session-mode pool (`listen_url`), or else poll. See the crate docs on
/// poolers, TLS, the database clock and cancellation.
///
/// Job code uses it through a [`LockClient`](distlock_core::LockClient) (or a
/// [`Locker`](distlock_core::Locker)):
///
/// ```no_run
/// use std::time::Duration;
/// use distlock_core::{LockClient, LockKey};
/// use distlock_postgres::PostgresLock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let lock = PostgresLock::connect("postgres://app:secret@127.0.0.1:5432/app?namespace=jobs").await?;
/// let client = LockClient::new(lock);
/// let key = LockKey::new("nightly-report")?;
/// if let Some(lease) = client.try_acquire(&key, Duration::from_secs(30)).await?.lease() {
///     println!("fencing token {}", lease.fencing_token());
///     client.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
pub struct PostgresLock {
    pool: PgPool,
    config: PostgresConfig,
    sql: Arc<Statements>,
    /// The simple protocol is in use: `pool_mode=transaction`, a
    /// transaction pooler found at connect, or the switch after a
    /// statement met another client's prepared statements (shared with the
    /// statements that leave a waiter line).
    simple: Arc<AtomicBool>,
    /// Waiters `LISTEN` past the main URL (`listen_url`), so they can be
    /// woken behind a transaction pooler too.
    listen_apart: bool,
    /// The LISTEN/NOTIFY channel of this namespace and table.
    channel: String,
    /// The channel that wakes observers of this namespace's locks.
    observers: String,
    table_ready: OnceCell<()>,
    /// The table of waiter lines exists: waits queue, a release wakes the
    /// first waiter alone.
    line_ready: AtomicBool,
    /// The lock table has the holder columns: labels are stored and shown.
    holder_ready: AtomicBool,
    /// The open waits of this client (see [`OpenWaits`]).
    waits: Arc<OpenWaits>,
    /// The keys this client found taken lately (see `acquire`).
    contended: ContendedKeys,
    /// `None` when nothing can `LISTEN` (a transaction pooler without
    /// `listen_url`): waiters then poll.
    listener: Option<Listener<Releases>>,
    /// Counting semaphores, in a table of their own.
    semaphores: Semaphores,
    /// When the sweep of idle rows runs; it ends with the client.
    sweeper: Sweeper,
    /// The TLS files of the pool's options (if they came from the
    /// config's URL), read by distlock: at connect, and at each sweep for
    /// the sweep's connection and the pool's new ones.
    pool_tls: TlsSettings,
    /// The lock table, as the sweep deletes from it.
    swept: SweptTable,
}

impl fmt::Debug for PostgresLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresLock")
            .field("namespace", &self.config.client().namespace())
            .field("table", &self.qualified_table())
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl PostgresLock {
    /// Connects to the server in `url`
    /// (`postgres://user:password@host:port/database`, plus the query
    /// parameters of [`PostgresConfig::from_url`]) and creates the lock table
    /// if it does not exist. Without `pool_mode` in the URL, it first
    /// probes whether the URL reaches a transaction pooler (see
    /// [`PoolMode::Auto`]; [`pool_mode`](Self::pool_mode) tells).
    ///
    /// Errors: [`ErrorKind::Config`](distlock_core::ErrorKind) for a bad URL,
    /// failed authentication, missing privileges, or a TLS problem that
    /// retrying cannot fix (a missing or unreadable TLS file, an untrusted
    /// server certificate or one for another host name, a client
    /// certificate the server refused, TLS asked of a server without it, a
    /// plaintext connection refused by a TLS-only server);
    /// [`ErrorKind::Unavailable`](distlock_core::ErrorKind) if the server cannot
    /// be reached within the connect timeout.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(PostgresConfig::from_url(url)?).await
    }

    /// Connects with `config` and creates the lock table if needed.
    pub async fn with_config(config: PostgresConfig) -> Result<Self, LockError> {
        config.validate()?;
        let Some(connect) = config.connect_options().cloned() else {
            return Err(LockError::config(
                "the PostgresConfig names no server; build it with PostgresConfig::from_url or PostgresConfig::new, or use PostgresLock::from_pool",
            ));
        };
        let timeout = config.client().connect_timeout();
        // The pool gets the TLS files as read here (which checks them), and
        // again at each sweep: given paths, sqlx would read them on a
        // blocking thread inside a lock call and panic if the runtime shut
        // down meanwhile. `listen_url`'s are read at each listener connect.
        let connect = config.tls().loaded(connect).await?;
        config.listen_tls().check_files().await?;
        // sqlx retries a refused connection until its acquire timeout, then
        // says so (`PoolTimedOut`: unavailable, nothing answers there). The
        // bound for a connect that hangs ends a little later: at the same
        // moment it raced sqlx's own answer, and a server that is not
        // running was reported as a timeout about one time in three.
        let bound = timeout + CONNECT_BOUND_SLACK;
        let pool = distlock_core::with_timeout(bound, "connecting to PostgreSQL", async {
            PgPoolOptions::new()
                .max_connections(config.max_connections())
                .min_connections(0)
                .acquire_timeout(timeout)
                .idle_timeout(Some(Duration::from_secs(60)))
                // sqlx would ping every connection it hands out: one extra
                // round trip per lock call. A dead connection instead fails
                // its statement, is closed, and the statement is sent again
                // on another connection (see `fetch`).
                .test_before_acquire(false)
                .connect_with(connect)
                .await
                .map_err(|e| errors::map(e, "connecting to PostgreSQL"))
        })
        .await?;
        let mode = match config.pool_mode() {
            PoolMode::Auto => probe::detect(&pool, timeout).await?,
            mode => mode,
        };
        let pool_tls = config.tls().clone();
        let lock = Self::build(pool, config, mode, pool_tls);
        lock.ensure_table().await?;
        lock.prepare_semaphores().await;
        Ok(lock)
    }

    /// A backend on an existing pool, with `config`'s namespace, timeouts
    /// and table (its server options are not used: the pool has its own).
    /// The lock table is created on first use; waiters get one extra
    /// connection with the pool's connect options (or those of
    /// [`PostgresConfig::with_listen_options`]). The pool's acquire timeout should
    /// not exceed the connect timeout.
    ///
    /// It does not probe for a transaction pooler: [`PoolMode::Auto`] (the
    /// default) means [`PoolMode::Session`] here; say
    /// [`PoolMode::Transaction`] for a pool behind one.
    pub fn from_pool(pool: PgPool, config: PostgresConfig) -> Result<Self, LockError> {
        config.validate()?;
        let mode = config.pool_mode();
        // The pool's options are the caller's, with their own TLS settings.
        Ok(Self::build(pool, config, mode, TlsSettings::default()))
    }

    /// A backend on `pool` working in `mode` (`Auto` meaning `Session`);
    /// `pool_tls`: the TLS settings of the pool's options, if they came
    /// from the config's URL.
    fn build(pool: PgPool, config: PostgresConfig, mode: PoolMode, pool_tls: TlsSettings) -> Self {
        let channel = channel_name(config.schema(), config.table(), config.client().namespace());
        let listen_apart = config
            .listen_options()
            .map(|listen| (listen.clone(), config.listen_tls().clone()));
        let (protocol, listen) = match mode {
            PoolMode::Session | PoolMode::Auto => (
                Protocol::Extended,
                Some(
                    listen_apart
                        .unwrap_or_else(|| ((*pool.connect_options()).clone(), pool_tls.clone())),
                ),
            ),
            // A LISTEN through the pooler would stay on a shared server
            // session: only listen_url can wake waiters.
            PoolMode::Transaction => (Protocol::Simple, listen_apart),
        };
        let semaphores = Semaphores::new(&config, listen.clone());
        let listener = listen.map(|(listen, tls)| {
            let releases = Releases::new(
                listen,
                tls,
                channel.clone(),
                config.client().connect_timeout(),
            )
            .with_observers();
            Listener::new(releases, config.client())
        });
        let sql = Arc::new(Statements::new(config.schema(), config.table()));
        let backend = Self {
            semaphores,
            sweeper: Sweeper::new(config.fence_retention()),
            pool_tls,
            swept: SweptTable::new(
                qualified_table(config.schema(), config.table()),
                &sql.sweep.delete,
            ),
            sql,
            simple: Arc::new(AtomicBool::new(protocol == Protocol::Simple)),
            line_ready: AtomicBool::new(false),
            holder_ready: AtomicBool::new(false),
            waits: Arc::default(),
            contended: ContendedKeys::default(),
            listen_apart: config.listen_options().is_some(),
            listener,
            observers: holder_channel(&channel),
            channel,
            pool,
            config,
            table_ready: OnceCell::new(),
        };
        if let Some(lines) = backend.lock_lines() {
            backend.pass_on_unclaimed(lines);
        }
        if let Some(lines) = backend.permit_lines() {
            backend.pass_on_unclaimed(lines);
        }
        backend
    }

    /// How the main URL's connections are pooled, as this client works
    /// with them: [`PoolMode::Transaction`] for `pool_mode=transaction`, a
    /// transaction pooler the probe at connect found ([`PoolMode::Auto`]),
    /// or one whose shared prepared statements a statement met since;
    /// [`PoolMode::Session`] otherwise. Never `Auto`.
    pub fn pool_mode(&self) -> PoolMode {
        match self.protocol() {
            Protocol::Simple => PoolMode::Transaction,
            Protocol::Extended => PoolMode::Session,
        }
    }

    /// The protocol statements are sent with now.
    pub(crate) fn protocol(&self) -> Protocol {
        Protocol::of(&self.simple)
    }

    /// Whether waiters can be woken: a listener, not through a transaction
    /// pooler (or apart from it, on `listen_url`).
    pub(crate) fn can_listen(&self) -> bool {
        self.listener.is_some() && (self.listen_apart || self.protocol() == Protocol::Extended)
    }

    /// The settings this backend runs with.
    pub fn config(&self) -> &PostgresConfig {
        &self.config
    }

    /// The pool this backend runs its statements on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The quoted, schema-qualified name of the lock table
    /// (`"public"."distlock_locks"`), for SQL text.
    pub fn qualified_table(&self) -> String {
        qualified_table(self.config.schema(), self.config.table())
    }

    pub(crate) fn namespace(&self) -> &str {
        self.config.client.namespace()
    }

    /// Switches this client to the simple protocol for good; whether it was
    /// in use already.
    pub(crate) fn use_simple_protocol(&self) -> bool {
        self.simple.swap(true, Ordering::Relaxed)
    }

    /// The lock table's statements.
    pub(crate) fn statements(&self) -> &Arc<Statements> {
        &self.sql
    }

    /// Set once the tables exist and the format marker was checked.
    pub(crate) fn table_ready(&self) -> &OnceCell<()> {
        &self.table_ready
    }

    /// What this client keeps for its semaphores.
    pub(crate) fn semaphores(&self) -> &Semaphores {
        &self.semaphores
    }

    /// Starts a sweep of the rows nobody has held for the fencing retention
    /// (in the lock table, and the semaphore table once it exists) if one
    /// is due: see [`crate::sweep`]. Never waits for it.
    pub(crate) fn sweep_if_due(&self) {
        self.sweeper.maybe_start(|| SweepJob {
            connect: (*self.pool.connect_options()).clone(),
            tls: self.pool_tls.clone(),
            pool: (!self.pool_tls.is_empty()).then(|| self.pool.clone()),
            simple: self.simple.clone(),
            namespace: self.namespace().to_owned(),
            retention: self.config.fence_retention(),
            timeout: self.config.client().operation_timeout(),
            tables: [Some(self.swept.clone()), self.semaphores.swept()]
                .into_iter()
                .flatten()
                .collect(),
        });
    }

    /// The table of waiter lines exists (checked with the lock table).
    pub(crate) fn line_ready(&self) -> bool {
        self.line_ready.load(Ordering::Relaxed)
    }

    /// Says that the table of waiter lines exists.
    pub(crate) fn set_line_ready(&self) {
        self.line_ready.store(true, Ordering::Relaxed);
    }

    /// The lock table has the holder columns (checked with the table).
    pub(crate) fn holder_ready(&self) -> bool {
        self.holder_ready.load(Ordering::Relaxed)
    }

    /// Says that the lock table has the holder columns.
    pub(crate) fn set_holder_ready(&self) {
        self.holder_ready.store(true, Ordering::Relaxed);
    }

    /// The arguments an attempt of `owner` on `key` adds for the acquire
    /// statement with the waiter line of `table`, if the line is ready:
    /// the table's name and the pid it queues with when refused — that of
    /// `listener`'s connection if the attempt is an open wait's and not
    /// one settling a lost reply (its wait is over), else 0 (never queues).
    pub(crate) fn line_args(
        &self,
        line: WaitLine,
        listener: Option<&Listener<Releases>>,
        table: &str,
        request: (&LockKey, OwnerToken, bool),
    ) -> Option<[Arg; 2]> {
        if !self.line_ready() {
            return None;
        }
        let (key, owner, settling) = request;
        let pid = listener
            .and_then(|l| l.source().pid())
            .filter(|_| !settling && self.waits.joins(line, key, owner));
        Some([Arg::text(table), Arg::Int(pid.unwrap_or(0).into())])
    }

    /// The attempt of a waiter (listener pid `pid`) that joins the line of
    /// a lock another owner holds ([`Statements::join_held`]): the refusal,
    /// or `None` when the lock is not held that way (nothing was written;
    /// the full attempt follows). Nothing is ever granted here, so a
    /// caller that leaves before the reply has nothing to give back; a
    /// line it may have joined is left when its wait ends, as after any
    /// refused attempt.
    async fn join_held(
        &self,
        key: &LockKey,
        owner: &str,
        pid: i64,
    ) -> Result<Option<AcquireReply>, LockError> {
        let call = self.call(
            &self.sql.join_held,
            vec![
                Arg::text(self.namespace()),
                Arg::text(key.as_str()),
                Arg::text(owner),
                Arg::text(self.config.table()),
                Arg::Int(pid),
            ],
        );
        let Some(row) = self.fetch(IN_LOCK_CALL, call, None).await?.row else {
            return Ok(None);
        };
        let ms: i64 = self.column(&row, "expires_in_ms")?;
        Ok(Some(AcquireReply::Held {
            expires_in: Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        }))
    }

    /// The grant of a waiter woken at the head of `key`'s line, on its
    /// running turn ([`Statements::take_turn`]): its fencing token, or
    /// `None` when it has no running turn or the key is not free (nothing
    /// was written; the full attempt follows). A grant whose caller left
    /// before the reply is given back (`give_back`), as the full
    /// attempt's is; sent again after a lost reply, it finds the key held
    /// by its own owner and the full attempt adopts it.
    async fn take_turn(
        &self,
        key: &LockKey,
        turn: Turn<'_>,
        give_back: GiveBack,
    ) -> Result<Option<FencingToken>, LockError> {
        let mut args = vec![
            Arg::text(self.namespace()),
            Arg::text(key.as_str()),
            Arg::text(turn.owner),
            Arg::Int(turn.ttl_ms),
            Arg::Int(turn.send),
            Arg::text(self.config.table()),
        ];
        let statement = match turn.labelled {
            true => {
                args.push(Arg::text(turn.holder.map_or("", |h| h.as_str())));
                args.push(Arg::text(&self.observers));
                &self.sql.take_turn
            }
            false => &self.sql.unlabelled.take_turn,
        };
        let call = self.call(statement, args);
        let Some(row) = self.fetch(IN_LOCK_CALL, call, Some(give_back)).await?.row else {
            return Ok(None);
        };
        let fencing: Option<i64> = self.column(&row, "fencing")?;
        self.granted(fencing).map(Some)
    }

    /// `owner`'s attempt on `key` was refused: the key counts as contended
    /// for this client, and the wait (if any) was refused in line.
    fn was_refused(&self, key: &LockKey, owner: OwnerToken) {
        self.contended.found_taken(key);
        self.waits.refused(WaitLine::Lock, key, owner);
    }

    /// `owner`'s attempt on `key` was granted: it left its line, unless
    /// it was `settling` (see [`OpenWaits::granted`]).
    pub(crate) fn line_granted(
        &self,
        line: WaitLine,
        key: &LockKey,
        owner: OwnerToken,
        settling: bool,
    ) {
        self.waits.granted(line, key, owner, settling);
    }

    /// Opens `waiter`'s wait on `key` in `of`'s line: registers it under
    /// its owner token, and when its watch drops, runs `of.leave` (the
    /// statement that takes it out of the line and wakes the next waiter if
    /// the key is free) if it may be in the line.
    pub(crate) async fn watch_line(
        &self,
        of: Lines<'_>,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<ReleaseWatch, LockError> {
        let Lines {
            line,
            listener,
            leave,
            table,
            channel,
        } = of;
        let name = waiter.to_hex();
        let mut watch = listener
            .watch_as(Topic::Waiters(key.clone()), &name)
            .await?;
        if !self.line_ready() {
            return Ok(watch);
        }
        let registration = self.waits.register(line, key, waiter);
        let leaving = Leaving {
            statement: self.leave_statement(leave),
            waits: self.waits.clone(),
            line,
            key: key.clone(),
            waiter,
            registration,
            args: leave_args(
                self.namespace(),
                key.as_str(),
                name,
                table,
                channel,
                listener.source().next(),
                listener.source().pid().unwrap_or(0),
            ),
        };
        watch.leave_with(leaving.leave());
        Ok(watch)
    }

    /// The lines of locks, if this client has a listener.
    fn lock_lines(&self) -> Option<Lines<'_>> {
        Some(Lines {
            line: WaitLine::Lock,
            listener: self.listener.as_ref()?,
            leave: &self.sql.leave,
            table: self.config.table(),
            channel: &self.channel,
        })
    }

    /// The statement `leave` (of a line), as a wait's end or a pass-on
    /// sends it.
    fn leave_statement(&self, leave: &Arc<Sql>) -> LeaveStatement {
        LeaveStatement {
            pool: self.pool.clone(),
            simple: self.simple.clone(),
            timeout: self.config.client().operation_timeout(),
            leave: leave.clone(),
        }
    }

    /// Has `of`'s listener leave the line for a waiter a release woke
    /// after its wait ended (see `Releases::pass_on_unclaimed`): the
    /// wait's own leave came first, or failed, and a request of the wait
    /// whose outcome was unknown (a statement stalled on the server past
    /// its connection) joined again after it.
    fn pass_on_unclaimed(&self, of: Lines<'_>) {
        let source = of.listener.source();
        let pass_on = {
            let statement = self.leave_statement(of.leave);
            let namespace = self.namespace().to_owned();
            let table = of.table.to_owned();
            let (channel, next) = (of.channel.to_owned(), source.next().to_owned());
            let pid = source.shared_pid();
            move |key: &str, waiter: &str| {
                let pid = pid.load(Ordering::SeqCst);
                let args = leave_args(
                    &namespace,
                    key,
                    waiter.to_owned(),
                    &table,
                    &channel,
                    &next,
                    pid,
                );
                let (statement, key) = (statement.clone(), key.to_owned());
                tokio::spawn(async move {
                    match statement.send(args).await {
                        Ok(_) => {
                            tracing::debug!(key = %key, "a wake-up for a waiter that no longer waits: passed on")
                        }
                        Err(error) => {
                            tracing::debug!(key = %key, %error, "passing on a wake-up for a waiter that no longer waits failed; a later release drops its row")
                        }
                    }
                });
            }
        };
        source.pass_on_unclaimed(Unclaimed::new(of.listener.notifier().clone(), pass_on));
    }
}

/// The leave statement's arguments (see `Statements::leave`): `waiter`'s
/// row on `key` in the line of `table`, woken on `channel` and `next`,
/// deleted only while it names the listener pid `pid`.
fn leave_args(
    namespace: &str,
    key: &str,
    waiter: String,
    table: &str,
    channel: &str,
    next: &str,
    pid: i32,
) -> Vec<Arg> {
    vec![
        Arg::text(namespace),
        Arg::text(key),
        Arg::Text(waiter),
        Arg::text(table),
        Arg::text(channel),
        Arg::text(next),
        Arg::Int(pid.into()),
    ]
}

/// The lines of locks, or of permits, as a wait sees them.
pub(crate) struct Lines<'a> {
    pub(crate) line: WaitLine,
    /// Who hears this line's wake-ups.
    pub(crate) listener: &'a Listener<Releases>,
    /// The statement that leaves it.
    pub(crate) leave: &'a Arc<Sql>,
    /// The name of the table whose rows it waits for.
    pub(crate) table: &'a str,
    /// The channel that wakes every waiter of a key.
    pub(crate) channel: &'a str,
}

/// A wait that ended: leaves its line on the server if it may be in it.
struct Leaving {
    statement: LeaveStatement,
    waits: Arc<OpenWaits>,
    line: WaitLine,
    key: LockKey,
    waiter: OwnerToken,
    registration: u64,
    args: Vec<Arg>,
}

/// A line's leave statement, ready to send (see `PostgresLock::leave_statement`).
#[derive(Clone)]
struct LeaveStatement {
    pool: PgPool,
    simple: Arc<AtomicBool>,
    timeout: Duration,
    leave: Arc<Sql>,
}

impl LeaveStatement {
    /// Sends it with `args` (see [`leave_args`]) on a task of its own, as
    /// every statement (see `sql::send`).
    async fn send(&self, args: Vec<Arg>) -> Result<sql::Reply, sql::Missed> {
        let call = Call::new(Protocol::of(&self.simple), &self.leave, args);
        sql::send_alone(&self.pool, call, self.timeout).await
    }
}

impl Leaving {
    async fn leave(self) {
        let key = &self.key;
        if !self
            .waits
            .ended(self.line, key, self.waiter, self.registration)
        {
            return;
        }
        // Best effort: a row left behind is taken off the line (to no
        // avail) by a later release, which costs the other waiters that
        // wake-up: they fall back to their timers (or, if the release wakes
        // it, the listener passes the wake-up on).
        match self.statement.send(self.args).await {
            Ok(_) => tracing::trace!(key = %key, "a wait that ended left its waiter line"),
            Err(error) => {
                tracing::debug!(key = %key, %error, "leaving the waiter line failed; a later release drops the row");
            }
        }
    }
}

/// The acquisitions (of locks and permits) this process started, each
/// numbered for the statement that carries it (see `Statements::acquire`).
static SENDS: AtomicI64 = AtomicI64::new(0);

/// A send number greater than every one this process used so far.
pub(crate) fn next_send() -> i64 {
    SENDS.fetch_add(1, Ordering::SeqCst) + 1
}

/// The send number of the acquisition that granted `lock` (its handle,
/// see `next_send`), for its release to refuse that acquisition's late
/// sends.
pub(crate) fn send_param(lock: &HeldLock<'_>) -> Arg {
    Arg::Int(i64::try_from(lock.handle).unwrap_or(0))
}

/// The most locks one batched extend statement renews.
const EXTEND_BATCH: usize = 500;

/// `lock`'s fencing token as a bigint (every token this backend grants is one).
pub(crate) fn fencing_param(lock: &HeldLock<'_>) -> Result<i64, LockError> {
    i64::try_from(lock.fencing.get()).map_err(|_| {
        LockError::invalid_input("the lease's fencing token is out of PostgreSQL's bigint range")
    })
}

/// A TTL as whole milliseconds for SQL (the capabilities round TTLs to
/// 1 ms and bound them far below `i64::MAX` ms).
pub(crate) fn ttl_millis(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}

/// What a woken waiter's [`PostgresLock::take_turn`] sends besides the
/// key: as its acquire's.
struct Turn<'a> {
    owner: &'a str,
    ttl_ms: i64,
    send: i64,
    /// The table has the holder columns (the labelled statement).
    labelled: bool,
    holder: Option<&'a HolderId>,
}

#[async_trait]
impl LockBackend for PostgresLock {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            min_ttl: Duration::from_millis(1),
            ttl_granularity: Duration::from_millis(1),
            native_wait: self.can_listen(),
            wakes_one_waiter: self.can_listen() && self.line_ready(),
            // A free key goes to the line's head (see the crate docs,
            // "Waiting").
            fair_handoff: self.can_listen() && self.line_ready(),
            retry_interval: self.config.retry_interval(),
            durable: true,
            extend_batch: EXTEND_BATCH,
            // Known once the table was checked (at connect; for a client
            // made with `from_pool`, at its first call).
            holder_ids: self.holder_ready(),
            holder_watch: self.can_listen() && self.holder_ready(),
            // Known once the semaphore table was checked (as above).
            permit_holder_ids: self.semaphores().holders_ready(),
            ..Capabilities::default()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        let key = request.key;
        let ttl_ms = ttl_millis(request.ttl);
        self.ensure_table().await?;
        self.sweep_if_due();
        let owner = request.owner.to_hex();
        let send = next_send();
        // Read once: the statement and its arguments must agree.
        let labelled = self.holder_ready();
        // The statement's caller may leave (a timeout, a dropped future)
        // before its reply: then what it was granted is given back.
        let give_back = GiveBack {
            sql: self.sql.clone(),
            protocol: self.protocol(),
            namespace: self.namespace().to_owned(),
            key: key.as_str().to_owned(),
            owner: owner.clone(),
            send,
            channel: self.channel.clone(),
            observers: (labelled && request.holder.is_some()).then(|| self.observers.clone()),
        };
        let mut args = vec![
            Arg::text(self.namespace()),
            Arg::text(key.as_str()),
            Arg::Text(owner.clone()),
            Arg::Int(ttl_ms),
            Arg::Int(send),
        ];
        let waiting = (key, request.owner, request.settling);
        let line = self.listener.as_ref();
        // Asked before `line_args` puts this wait in line. A wait's first
        // attempt that is most likely refused only joins the line behind
        // the holder if there is one (`join_held`): behind another wait of
        // this client, or on a key this client found taken lately.
        // One already in line whose last attempt was refused was most
        // likely woken at its head (a timer's retry is the other case): it
        // takes its turn first (`take_turn`). After an attempt whose
        // outcome is unknown (which may have taken the key), the full
        // attempt goes at once: it adopts.
        let place = self.waits.place(WaitLine::Lock, key, request.owner);
        let expects_refusal = match place {
            WaitPlace::Joining { behind_others } => {
                behind_others || self.contended.is_contended(key)
            }
            WaitPlace::NotWaiting | WaitPlace::InLine { .. } => false,
        };
        let queued = self.line_args(WaitLine::Lock, line, self.config.table(), waiting);
        let queued_line = queued.is_some();
        if let Some([_, Arg::Int(pid)]) = &queued {
            if *pid != 0 && expects_refusal {
                if let Some(held) = self.join_held(key, &owner, *pid).await? {
                    self.was_refused(key, request.owner);
                    return Ok(held);
                }
            }
            if *pid != 0 && place == (WaitPlace::InLine { refused: true }) {
                let turn = Turn {
                    owner: &owner,
                    ttl_ms,
                    send,
                    labelled,
                    holder: request.holder,
                };
                if let Some(fencing) = self.take_turn(key, turn, give_back.clone()).await? {
                    self.line_granted(WaitLine::Lock, key, request.owner, request.settling);
                    let grant = Grant::new(fencing, request.ttl);
                    return Ok(AcquireReply::Granted(grant.with_handle(send as u64)));
                }
            }
        }
        let statement = match (queued, labelled) {
            (Some(line), labelled) => {
                args.extend(line);
                match labelled {
                    true => &self.sql.acquire_queued,
                    false => &self.sql.unlabelled.acquire_queued,
                }
            }
            (None, true) => &self.sql.acquire,
            (None, false) => &self.sql.unlabelled.acquire,
        };
        if labelled {
            // No label: '' (a HolderId is never empty), stored as NULL.
            args.push(Arg::text(request.holder.map_or("", |h| h.as_str())));
            args.push(Arg::text(&self.observers));
        } else if queued_line {
            // The labelled statement makes it of the observers' channel.
            args.push(Arg::Text(next_channel(&self.channel)));
        }
        let call = self.call(statement, args);
        let reply = self.fetch(IN_LOCK_CALL, call, Some(give_back)).await?;
        let Some(row) = reply.row else {
            // Someone inserted the first row for this key concurrently and
            // this statement's snapshot cannot see it yet: try again soon.
            tracing::trace!(key = %key, "lock held (just created by another client)");
            return Ok(AcquireReply::Held {
                expires_in: Some(Duration::ZERO),
            });
        };
        let acquired: bool = self.column(&row, "acquired")?;
        let fencing: Option<i64> = self.column(&row, "fencing")?;
        if acquired {
            self.line_granted(WaitLine::Lock, key, request.owner, request.settling);
            // Taken, or adopted from an earlier attempt with this owner
            // token whose reply was lost (same fencing token, TTL reset).
            let grant = Grant::new(self.granted(fencing)?, request.ttl);
            return Ok(AcquireReply::Granted(grant.with_handle(send as u64)));
        }
        let holder: Option<String> = self.column(&row, "owner")?;
        self.check_row(holder.as_deref(), fencing, None)?;
        if fencing.is_none() {
            return Err(LockError::corrupted(format!(
                "the row for lock {:?} in {} has no fencing counter; it is left untouched",
                key.as_str(),
                self.qualified_table()
            )));
        }
        // Refused on a free key by the waiter line: retry when the head's
        // turn is over (if nothing wakes this waiter first).
        let turn_ms: Option<i64> = self.column(&row, "turn_ms")?;
        let expires_in = match holder {
            _ if turn_ms.is_some() => {
                turn_ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
            }
            // The row changed after this statement's snapshot (or, for this
            // owner token, is one it gave up): retry soon.
            None => Some(Duration::ZERO),
            Some(holder) if holder == owner => Some(Duration::ZERO),
            Some(_) => {
                let ms: Option<i64> = self.column(&row, "expires_in_ms")?;
                ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
            }
        };
        self.was_refused(key, request.owner);
        Ok(AcquireReply::Held { expires_in })
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let ttl_ms = ttl_millis(ttl);
        let fencing = fencing_param(&lock)?;
        self.ensure_table().await?;
        let key = lock.key;
        let owner = lock.owner.to_hex();
        let call = self.call(
            &self.sql.extend,
            vec![
                Arg::text(self.namespace()),
                Arg::text(key.as_str()),
                Arg::Text(owner),
                Arg::Int(fencing),
                Arg::Int(ttl_ms),
            ],
        );
        let row = self.fetch_one(call).await?.row;
        Ok(if self.held_by(&lock, &row)? {
            // The handle (the acquisition's send number) stays with the
            // lease, for its release to refuse that acquisition's late sends.
            ExtendReply::Extended(Grant::new(lock.fencing, ttl).with_handle(lock.handle))
        } else {
            ExtendReply::NotHeld
        })
    }

    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        // A token out of bigint range (never issued here) is that lock's
        // error alone; the others go in one statement.
        let fencings: Vec<_> = locks.iter().map(fencing_param).collect();
        let batch: Vec<_> = locks
            .iter()
            .zip(&fencings)
            .enumerate()
            .filter_map(|(n, (lock, fencing))| {
                let fencing = fencing.as_ref().ok()?;
                Some(serde_json::json!({
                    "n": n, "key": lock.key.as_str(), "owner": lock.owner.to_hex(), "fencing": fencing,
                }))
            })
            .collect();
        let mut answers = if batch.is_empty() {
            Vec::new()
        } else {
            self.ensure_table().await?;
            let length = i64::try_from(batch.len()).unwrap_or(i64::MAX);
            let call = self.call(
                &self.sql.extend_many,
                vec![
                    Arg::text(self.namespace()),
                    Arg::Text(serde_json::Value::Array(batch).to_string()),
                    Arg::Int(ttl_millis(ttl)),
                    Arg::Int(length),
                ],
            );
            let row = self.fetch_one(call).await?.row;
            let done: Vec<i64> = self.column(&row, "done")?;
            let owners: Vec<Option<String>> = self.column(&row, "owner")?;
            let tokens: Vec<Option<i64>> = self.column(&row, "fencing")?;
            let sent = fencings.iter().filter(|f| f.is_ok()).count();
            if done.len() != sent || owners.len() != sent || tokens.len() != sent {
                return Err(LockError::corrupted(format!(
                    "the batched extend of {sent} locks answered for {} of them",
                    done.len()
                )));
            }
            done.into_iter().zip(owners).zip(tokens).collect()
        }
        .into_iter();
        Ok(locks
            .iter()
            .zip(fencings)
            .map(|(lock, fencing)| {
                fencing?;
                let ((done, owner), token) = answers.next().ok_or_else(|| {
                    LockError::corrupted(
                        "the batched extend answered for fewer locks than it was sent",
                    )
                })?;
                Ok(match self.held_as(lock, done, owner.as_deref(), token)? {
                    true => ExtendReply::Extended(
                        Grant::new(lock.fencing, ttl).with_handle(lock.handle),
                    ),
                    false => ExtendReply::NotHeld,
                })
            })
            .collect())
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let fencing = fencing_param(&lock)?;
        self.ensure_table().await?;
        let key = lock.key;
        let owner = lock.owner.to_hex();
        let mut args = vec![
            Arg::text(self.namespace()),
            Arg::text(key.as_str()),
            Arg::Text(owner),
            Arg::Int(fencing),
            Arg::text(&self.channel),
            // Acquire sends up to this lease's are refused from now on.
            send_param(&lock),
        ];
        // Each read once: the statement and its arguments must agree.
        let (line, labelled) = (self.line_ready(), self.holder_ready());
        if line {
            args.extend([
                Arg::text(self.config.table()),
                Arg::Text(next_channel(&self.channel)),
            ]);
        }
        let statement = match (line, labelled) {
            (true, true) => &self.sql.release_next,
            (false, true) => &self.sql.release,
            (true, false) => &self.sql.unlabelled.release_next,
            (false, false) => &self.sql.unlabelled.release,
        };
        if labelled {
            args.push(Arg::text(&self.observers));
        }
        let call = self.call(statement, args);
        let reply = self.fetch_one(call).await?;
        if line && self.column::<i64>(&reply.row, "woken").unwrap_or(0) > 0 {
            // Handed to a waiter: this client's next wait on it queues.
            self.contended.found_taken(key);
        }
        // A resent release whose earlier attempt freed the row (its reply
        // was lost) finds it given up with this lock's fencing token.
        let released = (reply.resent && self.freed_with(&lock, &reply.row)?)
            || self.held_by(&lock, &reply.row)?;
        Ok(if released {
            ReleaseReply::Released
        } else {
            ReleaseReply::NotHeld
        })
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        match self.lock_lines() {
            // Nothing to hear through a transaction pooler found since
            // connect: waiters poll.
            Some(lines) if self.can_listen() => self.watch_line(lines, key, waiter).await.map(Some),
            _ => Ok(None),
        }
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        Some(self)
    }

    fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        Some(self)
    }
}

#[async_trait]
impl LockAdmin for PostgresLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        self.ensure_table().await?;
        let statement = match self.holder_ready() {
            true => &self.sql.inspect,
            false => &self.sql.unlabelled.inspect,
        };
        let call = self.call(
            statement,
            vec![Arg::text(self.namespace()), Arg::text(key.as_str())],
        );
        let Some(row) = self.fetch(IN_LOCK_CALL, call, None).await?.row else {
            return Ok(LockState::Free);
        };
        let held: bool = self.column(&row, "held")?;
        let owner: Option<String> = self.column(&row, "owner")?;
        let fencing: i64 = self.column(&row, "fencing")?;
        let expires_in_ms: i64 = self.column(&row, "expires_in_ms")?;
        let holder: Option<String> = self.column(&row, "holder")?;
        self.check_row(owner.as_deref(), Some(fencing), None)?;
        if !held {
            return Ok(LockState::Free);
        }
        Ok(LockState::Held {
            expires_in: u64::try_from(expires_in_ms).ok().map(Duration::from_millis),
            fencing_token: FencingToken::new(u64::try_from(fencing).unwrap_or(0)),
            holder: holder.map(|h| self.holder_label(key, &h)).transpose()?,
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.ensure_table().await?;
        let call = self.call(
            &self.sql.force_release,
            vec![
                Arg::text(self.namespace()),
                Arg::text(key.as_str()),
                Arg::text(&self.channel),
                Arg::text(&self.observers),
            ],
        );
        let row = self.fetch_one(call).await?.row;
        let done: i64 = self.column(&row, "done")?;
        let owner: Option<String> = self.column(&row, "owner")?;
        let fencing: Option<i64> = self.column(&row, "fencing")?;
        self.check_row(owner.as_deref(), fencing, None)?;
        Ok(done > 0)
    }

    /// Observers hear the holder channel on the waiters' listener
    /// connection, on local channels of their own (see `listener`): they
    /// never take a waiter's wake-up nor a place in a line. Nothing wakes
    /// them on a table without the holder columns, nor where nothing can
    /// `LISTEN`: they poll there.
    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        // The table check tells whether it has the holder columns.
        self.ensure_table().await?;
        match &self.listener {
            Some(listener) if self.can_listen() && self.holder_ready() => {
                listener.watch(Topic::Holder(key.clone())).await.map(Some)
            }
            _ => Ok(None),
        }
    }

    async fn inspect_permits(
        &self,
        key: &LockKey,
    ) -> Result<Vec<distlock_core::PermitState>, LockError> {
        self.list_permits(key).await
    }
}
