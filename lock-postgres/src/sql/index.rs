//! The indexes distlock keeps beside its tables' primary keys (the sweep's
//! index by fencing counter, the waiter table's index by arrival). A table
//! this client creates gets its index in the same implicit transaction
//! (instant on an empty table); a table that exists without it (made by an
//! earlier version, or by a DBA) gets it at connect with `CREATE INDEX
//! CONCURRENTLY`, which lets writes go on meanwhile.
//!
//! A concurrent build that fails or is cancelled (the operation timeout
//! cancels its statement) leaves the index in the catalog marked invalid:
//! maintained on every write, never read. Its name alone would then pass
//! for done, so the state is read from `pg_index`, and an invalid index
//! that no build is working on is dropped (`DROP INDEX CONCURRENTLY`) and
//! built again.

use std::sync::Arc;

use super::Sql;
use crate::keys::{qualified_table, quote_identifier};

/// One index of one of distlock's tables.
#[derive(Debug, Clone)]
pub(crate) struct Index {
    /// The quoted, qualified name (for `to_regclass`).
    pub name: String,
    /// Builds it on a table that exists without it, without blocking
    /// writes to the table.
    pub create: Arc<Sql>,
    /// Drops it, without blocking writes to the table (an invalid one
    /// a failed build left).
    pub drop: Arc<Sql>,
    /// `CREATE INDEX IF NOT EXISTS {w} ON {t} (...)`.
    definition: &'static str,
    /// The quoted, qualified table, for `{t}`.
    table: String,
    /// The quoted name, for `{w}` (unqualified: an index is created in its
    /// table's schema).
    quoted: String,
}

impl Index {
    /// The index `name` of the table `schema.table`, defined by
    /// `definition` (`CREATE INDEX IF NOT EXISTS {w} ON {t} (...)`: `{w}`
    /// the index, `{t}` the table).
    pub(crate) fn new(definition: &'static str, schema: &str, table: &str, name: &str) -> Self {
        let (table, quoted) = (qualified_table(schema, table), quote_identifier(name));
        let name = qualified_table(schema, name);
        let concurrently = definition.replacen("CREATE INDEX", "CREATE INDEX CONCURRENTLY", 1);
        Self {
            create: Arc::new(Sql::with_tables(&concurrently, &table, &quoted)),
            drop: Arc::new(Sql::new("DROP INDEX CONCURRENTLY IF EXISTS {t}", &name)),
            name,
            definition,
            table,
            quoted,
        }
    }

    /// `create_table` (a `CREATE TABLE IF NOT EXISTS {t}` of the index's
    /// table) followed by the plain creation of this index, in one
    /// implicit transaction.
    pub(crate) fn with_table(&self, create_table: &str) -> Arc<Sql> {
        Arc::new(Sql::with_tables(
            &format!("{create_table}; {}", self.definition),
            &self.table,
            &self.quoted,
        ))
    }
}

/// `$1` the quoted, qualified index name -> `state text`: `missing`,
/// `valid`, `building` (invalid while a build may be working on it:
/// another client's `CREATE INDEX CONCURRENTLY`; in this database, as
/// OIDs are per database; a build whose table this role may not see
/// counts), or `invalid` (a build failed or was cancelled).
pub(crate) const STATE: &str = "SELECT CASE
        WHEN i.indexrelid IS NULL THEN 'missing'
        WHEN i.indisvalid THEN 'valid'
        WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_stat_progress_create_index AS p
                     WHERE p.datname = pg_catalog.current_database()
                       AND (p.index_relid = i.indexrelid OR p.relid IS NULL)) THEN 'building'
        ELSE 'invalid'
    END AS state
    FROM (VALUES (1)) AS one (x)
    LEFT JOIN pg_catalog.pg_index AS i ON i.indexrelid = pg_catalog.to_regclass($1)";
