//! Counting semaphores: at most N live permits of a key, each a lease of
//! its own, in the semaphore table (see [`PermitStatements`] for the row
//! and the statements).
//!
//! A semaphore is its own row of its own table, so a semaphore and a lock
//! of one name share neither rows nor fencing counters; its permit waiters
//! queue in a waiter line of their own (the semaphore table's, see the
//! crate docs on waiting), and are woken one per returned permit on the
//! `LISTEN`/`NOTIFY` channels of the semaphore table, heard by a listener
//! connection of their own that opens with the first permit waiter. Behind
//! a transaction pooler without `listen_url` permit waiters poll, as lock
//! waiters do.
//!
//! Unknown outcomes follow the lock's rules: an attempt by the owner token
//! that holds a live permit adopts it (the client settles an attempt whose
//! reply was lost with one more attempt of the same token, and gives back
//! what it is granted); a release sent again after its first send was
//! applied finds the permit given up with its fencing token and is
//! `Released`, as the lock's release is. Permit attempts carry the lock's
//! send numbers, and a released permit stays given up with its attempt's
//! number (the last `limit` of them per semaphore), so a send of that
//! attempt the server applies after the release is refused, as a lock's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    ExtendReply, FencingToken, Grant, HeldLock, HolderId, Listener, LockError, LockKey, OwnerToken,
    PermitReply, PermitRequest, PermitState, ReleaseReply, ReleaseWatch, SemaphoreBackend,
    WaitLine, IN_LOCK_CALL,
};
use sqlx::postgres::{PgConnectOptions, PgRow};
use tokio::sync::OnceCell;

use crate::backend::{fencing_param, next_send, send_param, ttl_millis, Lines, PostgresLock};
use crate::config::{PostgresConfig, TlsSettings};
use crate::keys::{channel_name, qualified_table};
use crate::listener::{next_channel, Releases};
use crate::sql::{Arg, PermitStatements, Reply, Sql};
use crate::sweep::SweptTable;

/// What a client keeps for its semaphores.
pub(crate) struct Semaphores {
    sql: Arc<PermitStatements>,
    /// The quoted, schema-qualified semaphore table.
    table: String,
    /// Its name (as its waiter lines name it).
    name: String,
    /// The `NOTIFY` channel of permits given back in this namespace.
    channel: String,
    /// `None` when nothing can `LISTEN` (as for the lock's listener).
    listener: Option<Listener<Releases>>,
    table_ready: OnceCell<()>,
    /// The table has the `holders` column: permit labels are stored and
    /// shown.
    holders_ready: AtomicBool,
    /// The table, as the sweep deletes from it.
    swept: SweptTable,
}

impl Semaphores {
    /// The semaphores of `config`, their waiters listening with `listen`.
    pub(crate) fn new(
        config: &PostgresConfig,
        listen: Option<(PgConnectOptions, TlsSettings)>,
    ) -> Self {
        let (schema, table) = (config.schema(), config.semaphore_table());
        let channel = channel_name(schema, table, config.client().namespace());
        let listener = listen.map(|(listen, tls)| {
            let returns = Releases::new(
                listen,
                tls,
                channel.clone(),
                config.client().connect_timeout(),
            );
            Listener::new(returns, config.client())
        });
        let sql = Arc::new(PermitStatements::new(schema, table));
        Self {
            swept: SweptTable::new(qualified_table(schema, table), &sql.sweep.delete),
            sql,
            table: qualified_table(schema, table),
            name: table.to_owned(),
            channel,
            listener,
            table_ready: OnceCell::new(),
            holders_ready: AtomicBool::new(false),
        }
    }

    /// Whether the table has the `holders` column (checked with the
    /// table).
    pub(crate) fn holders_ready(&self) -> bool {
        self.holders_ready.load(Ordering::Relaxed)
    }

    /// The table, for the sweep, once it exists.
    pub(crate) fn swept(&self) -> Option<SweptTable> {
        self.table_ready.initialized().then(|| self.swept.clone())
    }
}

impl PostgresLock {
    /// The lines of permits, if this client has a listener.
    pub(crate) fn permit_lines(&self) -> Option<Lines<'_>> {
        let semaphores = self.semaphores();
        Some(Lines {
            line: WaitLine::Permits,
            listener: semaphores.listener.as_ref()?,
            leave: &semaphores.sql.leave,
            table: &semaphores.name,
            channel: &semaphores.channel,
        })
    }

    /// Creates the semaphore table at connect. A failure (a role that may
    /// not create tables, where a DBA created only the lock table) leaves
    /// locks working: semaphore calls try again and report it.
    pub(crate) async fn prepare_semaphores(&self) {
        if let Err(e) = self.ensure_semaphores().await {
            tracing::warn!(table = %self.semaphores().table, error = %e, "the semaphore table could not be created; semaphore calls fail until it exists");
        }
    }

    /// Creates the semaphore table once per client (cheap afterwards).
    async fn ensure_semaphores(&self) -> Result<(), LockError> {
        let semaphores = self.semaphores();
        semaphores
            .table_ready
            .get_or_try_init(|| async {
                let what = "creating the semaphore table";
                self.create_table(what, &semaphores.table, &semaphores.sql.create_table)
                    .await?;
                self.prepare_sweep_index(&semaphores.sql.sweep).await;
                self.prepare_holders_column().await;
                Ok::<_, LockError>(())
            })
            .await
            .map(|_| ())
    }

    /// Adds the `holders` column to a semaphore table that has none (one
    /// an earlier version or a DBA created), as the lock table's holder
    /// columns are added: a role that may not works without permit labels
    /// ([`Capabilities::permit_holder_ids`](distlock_core::Capabilities::permit_holder_ids)
    /// false, labels not stored, none shown), logging a warning.
    async fn prepare_holders_column(&self) {
        let semaphores = self.semaphores();
        let (check, add) = (
            &semaphores.sql.holders_column,
            &semaphores.sql.add_holders_column,
        );
        let what = "adding the holders column to the semaphore table";
        match self.add_columns(what, &semaphores.table, check, add).await {
            Ok(()) => semaphores.holders_ready.store(true, Ordering::Relaxed),
            Err(e) => {
                tracing::warn!(table = %semaphores.table, error = %e, "the semaphore table has no holders column (holders jsonb) and this role could not add it; permit holder labels are not stored (the table's owner can add it: see the distlock-postgres docs)");
            }
        }
    }

    /// The live permits of `key`'s semaphore with their labels
    /// ([`distlock_core::LockAdmin::inspect_permits`]). A label that
    /// [`HolderId`] refuses (edited by hand) is shown as none: labels are
    /// for people, never a reason to fail.
    pub(crate) async fn list_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        self.ensure_semaphores().await?;
        let semaphores = self.semaphores();
        let sql = match semaphores.holders_ready() {
            true => &semaphores.sql.inspect,
            false => &semaphores.sql.unlabelled.inspect,
        };
        let args = vec![Arg::text(self.namespace()), Arg::text(key.as_str())];
        let row = self.fetch_one(self.call(sql, args)).await?.row;
        if !self.column::<bool>(&row, "well_formed")? {
            return Err(self.foreign_row());
        }
        let fencings: Vec<i64> = self.column(&row, "fencings")?;
        let expires: Vec<i64> = self.column(&row, "expires_in_ms")?;
        let holders: Vec<Option<String>> = self.column(&row, "holders")?;
        let limit = match self.column::<Option<i64>>(&row, "permit_limit")? {
            Some(limit) => u32::try_from(limit).map_err(|_| self.foreign_row())?,
            None => return Ok(Vec::new()),
        };
        Ok(fencings
            .into_iter()
            .zip(expires)
            .zip(holders)
            .map(|((fencing, ms), holder)| PermitState {
                fencing_token: FencingToken::new(u64::try_from(fencing).unwrap_or(0)),
                expires_in: Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
                limit,
                holder: holder.and_then(|h| HolderId::new(h).ok()),
            })
            .collect())
    }

    /// The error for a semaphore row distlock did not write.
    fn foreign_row(&self) -> LockError {
        LockError::corrupted(format!(
            "the semaphore's row in namespace {:?} of {} is not in the form distlock writes; it is left untouched",
            self.namespace(),
            self.semaphores().table
        ))
    }

    /// Runs extend or release (`sql`, whose parameters after the fencing
    /// token are `last`) on `permit`: whether it held the permit, and the
    /// reply. A row distlock did not write is reported, not touched.
    async fn on_permit(
        &self,
        permit: &HeldLock<'_>,
        sql: &Arc<Sql>,
        last: Vec<Arg>,
    ) -> Result<(bool, Reply<PgRow>), LockError> {
        let fencing = fencing_param(permit)?;
        let key = permit.key;
        self.ensure_semaphores().await?;
        let mut args = vec![
            Arg::text(self.namespace()),
            Arg::text(key.as_str()),
            Arg::Text(permit.owner.to_hex()),
            Arg::Int(fencing),
        ];
        args.extend(last);
        let reply = self.fetch_one(self.call(sql, args)).await?;
        let done = self.column::<i64>(&reply.row, "done")? > 0;
        if !done && !self.column::<bool>(&reply.row, "well_formed")? {
            return Err(self.foreign_row());
        }
        Ok((done, reply))
    }
}

#[async_trait]
impl SemaphoreBackend for PostgresLock {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        let key = request.key;
        self.ensure_semaphores().await?;
        self.sweep_if_due();
        let limit = i64::from(request.limit);
        let send = next_send();
        let semaphores = self.semaphores();
        let mut args = vec![
            Arg::text(self.namespace()),
            Arg::text(key.as_str()),
            Arg::Text(request.owner.to_hex()),
            Arg::Int(ttl_millis(request.ttl)),
            Arg::Int(limit),
            Arg::Int(send),
        ];
        let waiting = (key, request.owner, request.settling);
        let line = semaphores.listener.as_ref();
        let (sql, unlabelled) = (&semaphores.sql, &semaphores.sql.unlabelled);
        let labelled = semaphores.holders_ready();
        let queued = self.line_args(WaitLine::Permits, line, &semaphores.name, waiting);
        let statement = match (queued, labelled) {
            (Some(line), _) => {
                args.extend(line);
                match labelled {
                    true => &sql.acquire_queued,
                    false => &unlabelled.acquire_queued,
                }
            }
            (None, true) => &sql.acquire,
            (None, false) => &unlabelled.acquire,
        };
        if labelled {
            // The last parameter (`$7`, or `$9` after the line's).
            args.push(Arg::text(request.holder.map_or("", |h| h.as_str())));
        }
        let call = self.call(statement, args);
        let Some(row) = self.fetch(IN_LOCK_CALL, call, None).await?.row else {
            // The semaphore's first row, inserted concurrently, is not in
            // this statement's snapshot yet: try again soon.
            return Ok(PermitReply::Full {
                expires_in: Some(Duration::ZERO),
            });
        };
        let fencing: Option<i64> = self.column(&row, "fencing")?;
        if self.column::<bool>(&row, "granted")? {
            self.line_granted(WaitLine::Permits, key, request.owner, request.settling);
            // New, or adopted from an earlier attempt of this owner token.
            // The send number goes with the lease, for its release.
            let grant = Grant::new(self.granted(fencing)?, request.ttl);
            return Ok(PermitReply::Granted(grant.with_handle(send as u64)));
        }
        if !self.column::<bool>(&row, "well_formed")? {
            return Err(self.foreign_row());
        }
        let stored: i64 = self.column(&row, "permit_limit")?;
        let live: i64 = self.column(&row, "live")?;
        if live > 0 && stored != limit {
            let stored = u32::try_from(stored).map_err(|_| self.foreign_row())?;
            return Ok(PermitReply::LimitMismatch { stored });
        }
        let expires_in = if live < limit {
            // Permits came back after this statement's snapshot.
            Some(Duration::ZERO)
        } else {
            let ms: Option<i64> = self.column(&row, "expires_in_ms")?;
            ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
        };
        Ok(PermitReply::Full { expires_in })
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let sql = &self.semaphores().sql.extend;
        let last = vec![Arg::Int(ttl_millis(ttl))];
        Ok(match self.on_permit(&permit, sql, last).await? {
            // The handle (the send number) stays with the lease.
            (true, _) => {
                ExtendReply::Extended(Grant::new(permit.fencing, ttl).with_handle(permit.handle))
            }
            (false, _) => ExtendReply::NotHeld,
        })
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let semaphores = self.semaphores();
        let channel = Arg::text(&semaphores.channel);
        // Permit sends up to this lease's are refused from now on.
        let send = send_param(&permit);
        let (labelled, unlabelled) = (&semaphores.sql, &semaphores.sql.unlabelled);
        let statements = match semaphores.holders_ready() {
            true => (&labelled.release_next, &labelled.release),
            false => (&unlabelled.release_next, &unlabelled.release),
        };
        let (sql, last) = if self.line_ready() {
            let next = Arg::Text(next_channel(&semaphores.channel));
            let table = Arg::text(&semaphores.name);
            (statements.0, vec![channel, send, table, next])
        } else {
            (statements.1, vec![channel, send])
        };
        let (done, reply) = self.on_permit(&permit, sql, last).await?;
        // Sent again after a lost reply: an earlier send that released the
        // permit left it given up with this fencing token.
        let given_up = || self.column::<bool>(&reply.row, "given_up");
        Ok(if done || (reply.resent && given_up()?) {
            ReleaseReply::Released
        } else {
            ReleaseReply::NotHeld
        })
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        _limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        match self.permit_lines() {
            // As for locks: nothing to hear through a transaction pooler
            // found since connect, so waiters poll.
            Some(lines) if self.can_listen() => self.watch_line(lines, key, waiter).await.map(Some),
            _ => Ok(None),
        }
    }
}
