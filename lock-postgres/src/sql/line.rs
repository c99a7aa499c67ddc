//! The waiter line: SQL shared by the lock and permit statements that
//! join it, leave it and wake its first waiter (see the crate docs,
//! "Waiting").
//!
//! A line is the rows of the waiter table (`{w}`) for one lock or
//! semaphore table, namespace `$1` and key `$2`, ordered by arrival. Every
//! statement that touches a line first locks the lock's (or semaphore's)
//! row — an acquire by its `ON CONFLICT`, a release by its `UPDATE`, a
//! leave by `FOR UPDATE` — so they run one after another per key and read
//! whether the key is free from its newest version. A waiter row that a
//! statement's snapshot is too old to see (joined while the statement
//! waited for that row lock) is covered by the fallback: a wake-up that
//! finds no live waiter notifies the key on the channel that wakes every
//! waiter of it.

/// How many waiters a wake-up examines at most: the dead ones among them
/// (no backend has their listener connection's pid; `pg_stat_get_activity`
/// reads all backends for -1, hence `pid > 0`) are deleted, the first live
/// one woken.
const EXAMINED: u32 = 8;

/// Creates the waiter table (`{t}` here).
pub(super) const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS {t} (
        lock_table text NOT NULL,
        namespace text NOT NULL,
        key text NOT NULL,
        member text NOT NULL,
        pid integer NOT NULL,
        arrival timestamptz NOT NULL,
        PRIMARY KEY (lock_table, namespace, key, member)
    )";

/// CTEs after `taken` (the acquire's grant, empty when refused): a refused
/// attempt of owner `$3` joins the line of table `{table}` (keeping its
/// place if it has one, with the backend pid `{pid}` of its client's
/// listener connection; pid 0: an attempt that does not wait, which never
/// joins), a granted one leaves it. One statement for both, so that the
/// acquire a client prepares (and a test warms up) is the one it sends.
pub(super) fn join_or_leave(table: &str, pid: &str) -> String {
    format!(
        "joined AS (
            INSERT INTO {{w}} AS w (lock_table, namespace, key, member, pid, arrival)
            SELECT {table}, $1, $2, $3, {pid}::integer, clock_timestamp()
            WHERE NOT EXISTS (SELECT 1 FROM taken) AND {pid}::integer <> 0
            ON CONFLICT (lock_table, namespace, key, member) DO UPDATE SET pid = excluded.pid
            RETURNING 1
        ),
        left_line AS (
            DELETE FROM {{w}}
            WHERE lock_table = {table} AND namespace = $1 AND key = $2 AND member = $3
              AND EXISTS (SELECT 1 FROM taken)
            RETURNING 1
        )"
    )
}

/// CTEs `line`, `chosen` and `popped`: when `when` holds (evaluated before
/// the line is read), the first live waiter of table `{table}`'s line
/// (other than `except`) is taken off it, with the dead waiters examined
/// before and after it. Rows another statement is deleting are skipped
/// (`SKIP LOCKED`), as are rows deleted since this statement's snapshot.
pub(super) fn wake_next(when: &str, table: &str, except: Option<&str>) -> String {
    let except = except
        .map(|member| format!("AND w.member <> {member}"))
        .unwrap_or_default();
    format!(
        "line AS MATERIALIZED (
            SELECT w.member, w.arrival, w.pid,
                   (w.pid > 0 AND EXISTS (SELECT 1 FROM pg_stat_get_activity(w.pid))) AS alive
            FROM {{w}} AS w
            WHERE w.lock_table = {table} AND w.namespace = $1 AND w.key = $2 {except} AND ({when})
            ORDER BY w.arrival, w.member
            LIMIT {EXAMINED}
            FOR UPDATE SKIP LOCKED
        ),
        chosen AS MATERIALIZED (
            SELECT member, pid FROM line WHERE alive ORDER BY arrival, member LIMIT 1
        ),
        popped AS (
            DELETE FROM {{w}} AS w USING line
            WHERE w.lock_table = {table} AND w.namespace = $1 AND w.key = $2
              AND w.member = line.member
              AND (NOT line.alive OR line.member IN (SELECT member FROM chosen))
            RETURNING 1
        )"
    )
}

/// A column expression after [`wake_next`]: notifies the waiter taken off
/// the line on channel `{one}_<pid>`, its client's listener's own (payload:
/// its owner, `:`, the key), so no other client's listener (nor server
/// backend) wakes for it; how many (0 or 1).
pub(super) fn woken(one: &str) -> String {
    format!(
        "(SELECT count(*) FROM (SELECT pg_notify({one} || '_' || f.pid::text, f.member || ':' || $2) FROM chosen AS f) AS n)"
    )
}

/// A column expression after [`wake_next`]: when `when` holds and no live
/// waiter was found, notifies the key on channel `{all}`, which wakes
/// every waiter of it (see the module docs); how many (0 or 1).
pub(super) fn woke_all(when: &str, all: &str) -> String {
    format!(
        "(SELECT count(*) FROM (SELECT pg_notify({all}, $2) WHERE ({when}) AND NOT EXISTS (SELECT 1 FROM chosen)) AS n)"
    )
}

/// What a release that wakes one waiter adds to the plain release (after
/// its `done` CTE, which returns the released row): CTEs, and the columns
/// `done`, `woken` and `woke_all` — the line of table `{table}`, the
/// channel of single wake-ups `{one}`, and `$5` the channel that wakes
/// every waiter of a key.
pub(super) fn release_next(table: &str, one: &str) -> (String, String) {
    let released = "EXISTS (SELECT 1 FROM done)";
    (
        format!(", {}", wake_next(released, table, None)),
        format!(
            "(SELECT count(*) FROM done) AS done, {} AS woken, {} AS woke_all",
            woken(one),
            woke_all(released, "$5")
        ),
    )
}

/// The leave statement (see `Statements::leave`), the key free when
/// `free` holds of its row `h` (in the table `{t}`), which it locks first.
/// It deletes the waiter's row only if it names the listener pid `$7` the
/// wait registered with, and that connection lives: a watch dropped
/// because its listener connection was lost is a wait about to subscribe
/// again, on a new connection, whose next attempt stores the new pid in
/// the row that kept its place (a row whose wait did end goes with the
/// next release that finds its pid gone).
pub(super) fn leave(free: &str) -> String {
    let when = "coalesce((SELECT free FROM held), true)";
    format!(
        "WITH held AS MATERIALIZED (
            SELECT ({free}) AS free
            FROM {{t}} AS h WHERE h.namespace = $1 AND h.key = $2
            FOR UPDATE
        ),
        gone AS (
            DELETE FROM {{w}}
            WHERE lock_table = $4 AND namespace = $1 AND key = $2 AND member = $3
              AND pid = $7::integer AND EXISTS (SELECT 1 FROM pg_stat_get_activity(pid))
            RETURNING 1
        ),
        {line}
        SELECT (SELECT count(*) FROM gone) AS done, {woken} AS woken, {woke_all} AS woke_all",
        line = wake_next(when, "$4", Some("$3")),
        woken = woken("$6"),
        woke_all = woke_all(when, "$5"),
    )
}
