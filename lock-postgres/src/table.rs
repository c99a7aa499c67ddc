//! Creating the tables a client needs and checking the namespace's format
//! marker, once per client, within the operation timeout, safe when many
//! clients start at once.

use std::sync::Arc;

use distlock_core::{read_storage_format, LockError, STORAGE_FORMAT};
use sqlx::Row;

use crate::backend::PostgresLock;
use crate::errors;
use crate::sql::{self, Arg, Call, Protocol, Sweep};

/// An index's state in the catalog (`index::STATE`).
enum IndexState {
    Missing,
    Valid,
    /// Invalid while a concurrent build may be working on it.
    Building,
    /// Invalid, and no build is working on it: a failed or cancelled one
    /// left it.
    Invalid,
}

impl PostgresLock {
    /// Whether the catalog query `call` answers `exists = true`.
    pub(crate) async fn exists(&self, what: &str, call: Call) -> Result<bool, LockError> {
        self.catalog(what, call, "exists").await
    }

    /// The `column` of the one row the catalog query `call` answers.
    async fn catalog<T>(&self, what: &str, call: Call, column: &str) -> Result<T, LockError>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        match self.fetch(what, call, None).await?.row {
            Some(row) => row.try_get(column).map_err(|e| errors::map(e, what)),
            None => Err(LockError::corrupted(format!(
                "{what}: the catalog query returned no row"
            ))),
        }
    }

    /// Creates schema and table, and checks the format marker of the table
    /// and namespace, once per client (cheap afterwards).
    pub(crate) async fn ensure_table(&self) -> Result<(), LockError> {
        self.table_ready()
            .get_or_try_init(|| async {
                let (what, table) = ("creating the lock table", self.qualified_table());
                self.create_table(what, &table, &self.statements().create_table)
                    .await?;
                self.prepare_sweep_index(&self.statements().sweep).await;
                self.prepare_holder_columns(&table).await;
                self.check_format().await?;
                self.prepare_line().await;
                Ok::<_, LockError>(())
            })
            .await
            .map(|_| ())
    }

    /// Creates the table of waiter lines (or adds the turn column to one
    /// an earlier version made), and checks that this role may write it.
    /// If not (a role that may not create tables, where a DBA created only
    /// the others, no grant on it, or a role that may not alter it),
    /// waiters are woken as before this table existed: every waiter of a
    /// key at each release.
    async fn prepare_line(&self) {
        let (what, table) = (
            "creating the table of waiter lines",
            &self.statements().waiter_table,
        );
        let ready = async {
            self.create_table(what, table, &self.statements().create_waiter_table)
                .await?;
            // A table of an earlier version lacks the turn column.
            let statements = self.statements();
            let (column, add) = (&statements.turn_column, &statements.add_turn_column);
            self.add_columns(
                "adding the turn column to the table of waiter lines",
                table,
                column,
                add,
            )
            .await?;
            self.prepare_waiter_index().await;
            let check = self.call(&self.statements().table_writable, vec![Arg::text(table)]);
            self.exists(
                "checking the privileges on the table of waiter lines",
                check,
            )
            .await
        };
        match ready.await {
            Ok(true) => self.set_line_ready(),
            Ok(false) => {
                tracing::warn!(table = %table, "this role may not read, insert, update and delete in the table of waiter lines; a release wakes every waiter of its key");
            }
            Err(e) => {
                tracing::warn!(table = %table, error = %e, "the table of waiter lines could not be created; a release wakes every waiter of its key");
            }
        }
    }

    /// Creates the waiter table's index by arrival on a table that has
    /// none (an earlier version made it). Without it (a role that may not
    /// create it) a statement reads every waiter of its key to find the
    /// first ones.
    async fn prepare_waiter_index(&self) {
        let statements = self.statements();
        self.prepare_index(
            "creating the index of waiter lines",
            &statements.waiter_index,
            "each wake-up reads every waiter of its key",
        )
        .await;
    }

    /// Creates the index the sweep of idle rows reads on a table that has
    /// none (one an earlier version or a DBA created). A role that may not
    /// create it works without: the sweep then reads the namespace's rows
    /// through the primary key.
    pub(crate) async fn prepare_sweep_index(&self, sweep: &Sweep) {
        self.prepare_index(
            "creating the index of idle rows",
            &sweep.index,
            "the sweep reads more of the table without it",
        )
        .await;
    }

    /// Builds `index` on its table (`CREATE INDEX CONCURRENTLY`: writes to
    /// the table go on meanwhile) unless it is valid or being built (a
    /// table this client created got it with the table); one a failed or
    /// cancelled build left invalid is dropped and built again. If it
    /// cannot, logs a warning that says what happens `without` it, and the
    /// client works on (the next client to start tries again).
    async fn prepare_index(&self, what: &str, index: &sql::Index, without: &str) {
        let ready = async {
            match self.index_state(what, index).await? {
                IndexState::Valid | IndexState::Building => return Ok(()),
                IndexState::Invalid => {
                    tracing::info!(index = %index.name, "{what}: dropping the index a failed build left invalid, to build it again");
                    self.fetch(
                        what,
                        Call::new(Protocol::Simple, &index.drop, Vec::new()),
                        None,
                    )
                    .await?;
                }
                IndexState::Missing => {}
            }
            let create = Call::new(Protocol::Simple, &index.create, Vec::new());
            match self.fetch(what, create, None).await {
                Ok(_) => Ok(()),
                // Another client may have built it meanwhile.
                Err(e) => match self.index_state(what, index).await {
                    Ok(IndexState::Valid | IndexState::Building) => Ok(()),
                    _ => Err(e),
                },
            }
        };
        if let Err(e) = self.config().client().timed(what, ready).await {
            tracing::warn!(index = %index.name, error = %e, "{what} failed; {without}");
        }
    }

    /// What the catalog says of `index`.
    async fn index_state(&self, what: &str, index: &sql::Index) -> Result<IndexState, LockError> {
        let call = self.call(&self.statements().index_state, vec![Arg::text(&index.name)]);
        let state: String = self.catalog(what, call, "state").await?;
        match state.as_str() {
            "missing" => Ok(IndexState::Missing),
            "valid" => Ok(IndexState::Valid),
            "building" => Ok(IndexState::Building),
            "invalid" => Ok(IndexState::Invalid),
            other => Err(LockError::corrupted(format!(
                "{what}: the catalog query answered the index state {other:?}"
            ))),
        }
    }

    /// Adds the holder columns to a lock table that has none (one an
    /// earlier version or a DBA created; a table this client created got
    /// them with the table). `ALTER TABLE` needs the table's owner: a role
    /// that may not (or that waited too long for the table's lock) works
    /// without labels, logging a warning ([`Capabilities::holder_ids`]
    /// false, labels not stored, `inspect` shows none), and tries again
    /// when it next starts.
    ///
    /// [`Capabilities::holder_ids`]: distlock_core::Capabilities::holder_ids
    async fn prepare_holder_columns(&self, table: &str) {
        let what = "adding the holder columns to the lock table";
        let statements = self.statements();
        let (check, add) = (&statements.holder_columns, &statements.add_holder_columns);
        match self.add_columns(what, table, check, add).await {
            Ok(()) => self.set_holder_ready(),
            Err(e) => {
                tracing::warn!(table = %table, error = %e, "the lock table has no holder columns (holder text, holder_owner text) and this role could not add them; holder labels are not stored (the table's owner can add them: see the distlock-postgres docs)");
            }
        }
    }

    /// Adds columns to `table` unless `check` (`$1` the table -> `exists
    /// bool`) finds them, with `add` (two statements, sent once), within
    /// the operation timeout; errors say `what`. Another client adding
    /// them at the same moment counts as added.
    pub(crate) async fn add_columns(
        &self,
        what: &str,
        table: &str,
        check: &Arc<sql::Sql>,
        add: &Arc<sql::Sql>,
    ) -> Result<(), LockError> {
        let present = || self.exists(what, self.call(check, vec![Arg::text(table)]));
        let ready = async {
            if present().await? {
                return Ok(());
            }
            // Sent once: no statement to cache.
            let add = Call::new(Protocol::Simple, add, Vec::new());
            match self.fetch(what, add, None).await {
                Ok(_) => Ok(()),
                // Another client may have added them meanwhile.
                Err(e) => match present().await {
                    Ok(true) => Ok(()),
                    _ => Err(e),
                },
            }
        };
        self.config().client().timed(what, ready).await
    }

    /// Stores the format marker of this lock table and namespace if there
    /// is none, and refuses one naming another format (see
    /// [`distlock_core::read_storage_format`]). Single statements, no
    /// session state: safe behind a transaction pooler and when clients
    /// start at once (an insert that finds a marker returns it).
    async fn check_format(&self) -> Result<(), LockError> {
        let what = "checking the distlock format marker";
        let table = &self.statements().format_table;
        self.create_table(what, table, &self.statements().create_format_table)
            .await?;
        let location = format!(
            "in {table}, row (lock_table {:?}, namespace {:?})",
            self.config().table(),
            self.config().client().namespace()
        );
        let table_and_namespace = || {
            vec![
                Arg::text(self.config().table()),
                Arg::text(self.config().client().namespace()),
            ]
        };
        // Read first: only the first client of a namespace writes.
        let mut call = self.call(&self.statements().read_format, table_and_namespace());
        // No row from the write: a concurrent client's marker committed
        // after this statement's snapshot; the next send sees it.
        for _ in 0..3 {
            let Some(row) = self.fetch(what, call, None).await?.row else {
                let mut store = table_and_namespace();
                store.push(Arg::text(&STORAGE_FORMAT.to_string()));
                call = self.call(&self.statements().format, store);
                continue;
            };
            let stored: String = row.try_get("format").map_err(|e| errors::map(e, what))?;
            return read_storage_format(what, &location, stored.as_bytes());
        }
        Err(LockError::unavailable(format!(
            "{what}: the marker {location} was neither stored nor found; try again"
        )))
    }

    /// Creates the table `qualified` with `create` (and the schema) unless
    /// it exists, within the operation timeout; errors say `what`.
    pub(crate) async fn create_table(
        &self,
        what: &str,
        qualified: &str,
        create: &Arc<sql::Sql>,
    ) -> Result<(), LockError> {
        let created = self.create_table_untimed(what, qualified, create);
        self.config().client().timed(what, created).await
    }

    pub(crate) async fn create_table_untimed(
        &self,
        what: &str,
        qualified: &str,
        create: &Arc<sql::Sql>,
    ) -> Result<(), LockError> {
        let exists = self.call(&self.statements().table_exists, vec![Arg::text(qualified)]);
        if self.exists(what, exists).await? {
            return Ok(());
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.create_table_once(what, create).await {
                Ok(()) => {
                    tracing::debug!(table = %qualified, "table ready");
                    return Ok(());
                }
                // Another client created it at the same moment: try again,
                // IF NOT EXISTS then sees it.
                Err(e) if errors::is_concurrent_create(&e) && attempt < 5 => {
                    tracing::debug!(table = %qualified, "table created concurrently; checking again");
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(crate) async fn create_table_once(
        &self,
        what: &str,
        create: &Arc<sql::Sql>,
    ) -> Result<(), LockError> {
        let schema = self.call(
            &self.statements().schema_exists,
            vec![Arg::text(self.config().schema())],
        );
        if !self.exists(what, schema).await? {
            // Sent once: no statement to cache.
            let call = Call::new(
                Protocol::Simple,
                &self.statements().create_schema,
                Vec::new(),
            );
            self.fetch(what, call, None).await?;
        }
        let call = Call::new(Protocol::Simple, create, Vec::new());
        self.fetch(what, call, None).await?;
        Ok(())
    }
}
