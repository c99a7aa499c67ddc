//! The sweep: deleting rows that nobody has held for the fencing retention
//! (see the crate docs, "Fencing tokens without a row per lock name
//! forever"), a small batch per statement, in one namespace.
//!
//! A row goes only when its counter is more than the retention behind the
//! database clock (`fencing < clock - retention`, in microseconds, as
//! tokens are) *and* nothing in it is live or expired within the
//! retention. Every token is at least the clock reading of its acquisition,
//! so the first condition says the last acquisition is older than the
//! retention, and that the clock has moved past every token issued for the
//! key — the next one, `greatest(counter + 1, clock)` on a new row, is
//! greater as long as the clock does not step back by more than the
//! retention. The index on `(namespace, fencing)` finds such rows without
//! reading the ones in use.
//!
//! Rows are picked `FOR UPDATE SKIP LOCKED` (a row an acquire is writing is
//! left for the next sweep, and no sweep waits for another), and the
//! `DELETE` checks the conditions again on the row it deletes: under `READ
//! COMMITTED` a row changed after the statement's snapshot is re-read, so a
//! row acquired meanwhile is never deleted. That check is one opaque
//! condition, so whatever the table's statistics say, the delete finds the
//! batch's rows by their primary key and reads no others. An acquire that
//! meets a row the sweep is deleting waits for it, then inserts a new row.
//! The clock is read once, when the statement starts
//! (`statement_timestamp()`, not `clock_timestamp()`, whose volatility
//! would keep the index out of the plan): a moment too early only keeps
//! rows longer.

use std::sync::Arc;

use super::locks::micros;
use super::{Index, Sql};
use crate::keys::{fencing_index_name, qualified_table};

/// The index of table `{t}` named `{w}` that the sweep reads.
const CREATE_INDEX: &str = "CREATE INDEX IF NOT EXISTS {w} ON {t} (namespace, fencing)";

/// How many rows one sweep statement deletes at most.
pub(crate) const BATCH: i64 = 100;

/// The sweep's statements for one table (of locks or of semaphores).
#[derive(Debug, Clone)]
pub(crate) struct Sweep {
    /// The table's index on `(namespace, fencing)`.
    pub index: Index,
    /// `$1` namespace, `$2` retention in ms, `$3` batch size -> `done
    /// bigint`: deletes up to `$3` rows of namespace `$1` nobody has held
    /// for `$2` (see the module docs).
    pub delete: Arc<Sql>,
}

impl Sweep {
    /// For the lock table `schema.table`.
    pub(crate) fn locks(schema: &str, table: &str) -> Self {
        // Free or expired for the retention, in the form distlock writes
        // (a row it did not write is left untouched, as every statement
        // leaves it).
        Self::new(
            schema,
            table,
            "{a}.expires_at < statement_timestamp() - $2::bigint * interval '1 millisecond'
             AND ({a}.owner IS NULL OR {a}.owner ~ '^[0-9a-f]{32}$') AND {a}.fencing >= 0",
        )
    }

    /// For the semaphore table `schema.table`; `well_formed` says, of a row
    /// `{a}`, that distlock wrote it.
    pub(crate) fn permits(schema: &str, table: &str, well_formed: &str) -> Self {
        // No permit live or expired within the retention (given-up ones
        // expired in 1970).
        let idle = format!(
            "NOT EXISTS (SELECT 1 FROM unnest({{a}}.expires) AS l (e)
                         WHERE l.e >= statement_timestamp() - $2::bigint * interval '1 millisecond')
             AND {well_formed}"
        );
        Self::new(schema, table, &idle)
    }

    /// `idle` holds of a row `{a}` that may go once its counter is old
    /// enough.
    fn new(schema: &str, table: &str, idle: &str) -> Self {
        let t = qualified_table(schema, table);
        let cut = format!("{} - $2::bigint * 1000", micros("statement_timestamp()"));
        let reclaimable = |a: &str| {
            format!(
                "{a}.namespace = $1 AND {a}.fencing < {cut} AND ({})",
                idle.replace("{a}", a)
            )
        };
        Self {
            index: Index::new(CREATE_INDEX, schema, table, &fencing_index_name(table)),
            delete: Arc::new(Sql::new(
                &format!(
                    "WITH doomed AS (
                        SELECT c.namespace, c.key FROM {{t}} AS c
                        WHERE {candidate}
                        LIMIT $3::bigint
                        FOR UPDATE SKIP LOCKED
                    ),
                    gone AS (
                        DELETE FROM {{t}} AS d USING doomed
                        WHERE d.namespace = doomed.namespace AND d.key = doomed.key
                          AND CASE WHEN {recheck} THEN true ELSE false END
                        RETURNING 1
                    )
                    SELECT count(*) AS done FROM gone",
                    candidate = reclaimable("c"),
                    // One opaque condition, not conditions the planner can
                    // find rows by: written plainly, statistics taken while
                    // the namespace had no rows made it scan every idle row
                    // of the namespace for each row of the batch (a nested
                    // loop over the `_fencing` index), and a sweep of
                    // 10,000 rows took seconds. So the batch's rows drive
                    // the delete, each found by its primary key.
                    recheck = reclaimable("d"),
                ),
                &t,
            )),
        }
    }
}
