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
//!
//! Lock lines hand the key over fairly (see the crate docs, "Waiting"): a
//! release, or a leave that finds the key free, *wakes* the first live
//! waiter and keeps it at the head with a turn (`turn_until`, the server's
//! clock plus [`HANDOFF_TURN`]) instead of taking it off the line; an
//! attempt on a free key is granted only to the line's head (or on an
//! empty line). Permit lines keep taking the woken waiter off the line.
//!
//! A statement writes the waiter rows it picked (`line`, `head`, `chosen`)
//! by joining them, and names the picked members once more as an array or
//! a scalar (`w.member = ANY (ARRAY(SELECT member FROM line))`): that is
//! what the planner uses as an index condition on the primary key, so the
//! write reads the picked rows only. With the join alone it scanned every
//! waiter of the key (a crowd of 256: three scans of 255 rows a release).

use crate::HANDOFF_TURN;

/// How many waiters a wake-up examines at most: the dead ones among them
/// (no backend has their listener connection's pid, see [`ALIVE`]) are
/// deleted, the first live one woken.
const EXAMINED: u32 = 8;

/// Creates the waiter table (`{t}` here).
pub(super) const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS {t} (
        lock_table text NOT NULL,
        namespace text NOT NULL,
        key text NOT NULL,
        member text NOT NULL,
        pid integer NOT NULL,
        arrival timestamptz NOT NULL,
        turn_until timestamptz,
        PRIMARY KEY (lock_table, namespace, key, member)
    )";

/// The index of waiter table `{t}` named `{w}` that the statements read a
/// line's first waiters by, in arrival order (its first rows, not every
/// waiter of the key sorted). With `member`, the order's tie-break: on
/// `arrival` alone the planner sorted every waiter of the key again. (A
/// look-up of one member may then walk this index's entries of the key,
/// an index-only check each, where the primary key would find it at once:
/// the planner weighs both alike.)
pub(super) const CREATE_INDEX: &str =
    "CREATE INDEX IF NOT EXISTS {w} ON {t} (lock_table, namespace, key, arrival, member)";

/// Adds the turn column to a waiter table `{t}` created without it (by
/// an earlier version): only the catalog changes, but the table's
/// strongest lock is taken, so `lock_timeout` bounds the wait for it.
pub(super) const ADD_TURN_COLUMN: &str = "SET LOCAL lock_timeout = '2s';
    ALTER TABLE {t} ADD COLUMN IF NOT EXISTS turn_until timestamptz";

/// `$1` qualified waiter table -> `exists bool`: whether it has the turn
/// column.
pub(super) const TURN_COLUMN: &str = "SELECT count(*) = 1 AS exists FROM pg_catalog.pg_attribute
    WHERE attrelid = pg_catalog.to_regclass($1) AND NOT attisdropped AND attname = 'turn_until'";

/// A turn as an SQL interval.
fn turn() -> String {
    format!("interval '{} milliseconds'", HANDOFF_TURN.as_millis())
}

/// Whether the waiter row `w` is alive: a backend (or other server
/// process) has its listener connection's pid (pid 0: a row of no
/// listener). Read from the pids of the statement's snapshot of server
/// processes, which `pg_stat_get_backend_pid` gives by id: about 5 µs a
/// row less than `pg_stat_get_activity(pid)`, which builds a row of 30
/// columns for each call (8 calls a statement in a line of 8 or more).
/// Evaluated only on the first [`EXAMINED`] rows, in a query around the
/// one that picks them: in the same select list it ran for every waiter of
/// the key before the sort (a crowd of 256 waiters paid 256 function scans
/// per statement).
const ALIVE: &str = "(w.pid > 0 AND EXISTS (SELECT 1 FROM pg_stat_get_backend_idset() AS b (id)
                                  WHERE pg_stat_get_backend_pid(b.id) = w.pid))";

/// The condition that picks, in the waiter table (`w`), the one waiter
/// that CTE `source` names (at most one row, with its `member` and
/// `arrival` as this statement read them from the line of table
/// `{table}`). By both, because both indexes then find it at once: by
/// member alone the planner, its statistics rating the two indexes alike,
/// walked every waiter of the key in the arrival index (a crowd of 256:
/// 255 index entries a look-up). Not by `ctid`: a row changed since the
/// statement's snapshot has a new one, and the write must reach it.
fn picked(table: &str, source: &str) -> String {
    format!(
        "w.lock_table = {table} AND w.namespace = $1 AND w.key = $2
              AND w.member = (SELECT member FROM {source})
              AND w.arrival = (SELECT arrival FROM {source})"
    )
}

/// CTEs before a lock acquire's `taken`: `clock` (the time the line is
/// judged at, read once), `line` (the first waiters of table `{table}`'s
/// line, as the statement's snapshot shows them, unlocked) and `head` (its
/// first waiter that stands: alive and its turn, if woken, not over; the
/// requester `$3` always stands, whatever pid its row names, since its
/// attempt stores its current one).
pub(super) fn fair_line(table: &str) -> String {
    format!(
        "clock AS MATERIALIZED (SELECT clock_timestamp() AS at),
        line AS MATERIALIZED (
            SELECT w.member, w.arrival, w.turn_until,
                   (w.member = $3 OR {ALIVE}) AS alive,
                   coalesce(w.member <> $3 AND w.turn_until <= (SELECT at FROM clock), false) AS over
            FROM (
                SELECT w.member, w.arrival, w.turn_until, w.pid
                FROM {{w}} AS w
                WHERE w.lock_table = {table} AND w.namespace = $1 AND w.key = $2
                ORDER BY w.arrival, w.member
                LIMIT {EXAMINED}
            ) AS w
        ),
        head AS MATERIALIZED (
            SELECT member, arrival, turn_until FROM line WHERE alive AND NOT over
            ORDER BY arrival, member LIMIT 1
        )"
    )
}

/// The condition (in `taken`, of the existing row `t` in the lock table
/// `{t}`) on which a lock acquire may take a free key: the row is the
/// version the statement's snapshot shows (else the line read from that
/// snapshot may be out of date: a release since may have woken a waiter
/// this snapshot misses; refused, the attempt is sent again at once), and
/// the requester is the line's head, or no waiter stands among the first
/// ones examined (all of them dropped: the next attempt reads the rest).
pub(super) fn fair_turn() -> String {
    format!(
        "(t.xmin = (SELECT s.xmin FROM {{t}} AS s WHERE s.namespace = $1 AND s.key = $2)
          AND coalesce((SELECT h.member = $3 FROM head AS h), (SELECT count(*) FROM line) < {EXAMINED}))"
    )
}

/// CTEs after a lock acquire's `taken` and the column `turn_ms` for its
/// refusal: `held` reads the lock row's newest version (locked by `taken`,
/// so final) when refused, with the holder the refusal answers; on a free
/// key, unless the snapshot was out of date, the waiters of `line` that no
/// longer stand (dead, or their turn over) are dropped (`dropped`, also
/// when granted), and a head never woken is woken (`turned`: its turn
/// begins, `NOTIFY {one}_<pid>, 'member:key'`). `turn_ms`, NULL when the
/// key is held: the time left of the head's turn, or 0 (sent again at
/// once) when no head stands or the snapshot was out of date.
pub(super) fn fair_after_taken(table: &str, one: &str) -> (String, String) {
    let free = "coalesce((SELECT free AND fresh FROM held), false)";
    let ctes = format!(
        "held AS MATERIALIZED (
            SELECT (h.owner IS NULL OR h.expires_at <= clock_timestamp()) AS free,
                   coalesce(h.xmin = (SELECT s.xmin FROM {{t}} AS s WHERE s.namespace = $1 AND s.key = $2), false)
                       AS fresh,
                   h.owner, h.fencing, h.expires_at
            FROM {{t}} AS h
            WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)
            FOR UPDATE
        ),
        dropped AS (
            DELETE FROM {{w}} AS w USING line
            WHERE w.lock_table = {table} AND w.namespace = $1 AND w.key = $2 AND w.member = line.member
              AND w.member = ANY (ARRAY(SELECT member FROM line))
              AND (NOT line.alive OR (w.member <> $3 AND w.turn_until <= (SELECT at FROM clock)))
              AND (EXISTS (SELECT 1 FROM taken) OR {free})
              AND EXISTS (SELECT 1 FROM line WHERE NOT alive OR over)
            RETURNING 1
        ),
        turned AS (
            UPDATE {{w}} AS w SET turn_until = clock_timestamp() + {turn}
            WHERE {head}
              AND (SELECT member FROM head) <> $3 AND w.turn_until IS NULL AND {free}
            RETURNING {notify}
        )",
        head = picked(table, "head"),
        turn = turn(),
        notify = notify_one(one),
    );
    let turn_ms = format!(
        "CASE WHEN NOT coalesce((SELECT free FROM held), false) THEN NULL
              WHEN NOT (SELECT fresh FROM held) THEN 0
              WHEN EXISTS (SELECT 1 FROM turned) THEN {ms}
              ELSE coalesce((SELECT greatest(0, ceil(extract(epoch FROM (h.turn_until - clock_timestamp())) * 1000))
                             FROM head AS h WHERE h.member <> $3), 0)
         END::bigint",
        ms = HANDOFF_TURN.as_millis(),
    );
    (ctes, turn_ms)
}

/// CTEs after `taken` (the acquire's grant, empty when refused): a refused
/// attempt of owner `$3` joins the line of table `{table}` (keeping its
/// place if it has one, with the backend pid `{pid}` of its client's
/// listener connection; pid 0: an attempt that does not wait, which never
/// joins), a granted one leaves it. One statement for both, so that the
/// acquire a client prepares (and a test warms up) is the one it sends.
///
/// `examined`: the statement read the line's first waiters (CTE `line`,
/// [`fair_line`]). A granted requester among them (the head taking its
/// turn) is found by member and arrival (see [`picked`]); one beyond them
/// (an adoption) by member alone, among every arrival. One statement
/// without `line` looks it up by member.
///
/// `may_join`: the condition (SQL) under which a refused attempt joins.
/// A late send of an acquisition whose owner already gave up the lock or
/// permit (released, or given back) never joins: its wait is over (granted
/// through a later send, or left), and its row would name the client's
/// live listener: on a lock, a head woken by every release and waited out
/// for its whole turn; on a semaphore, a waiter a release wakes (and takes
/// off the line) instead of one who waits.
pub(super) fn join_or_leave(table: &str, pid: &str, examined: bool, may_join: &str) -> String {
    // The requester's arrival as `line` read it, or every arrival: a range
    // (not an equality) so that the leave stays one write, which the
    // executor sets up at every call, run or not.
    let place = match examined {
        true => {
            "AND arrival BETWEEN coalesce((SELECT arrival FROM line WHERE member = $3), '-infinity')
                              AND coalesce((SELECT arrival FROM line WHERE member = $3), 'infinity')"
        }
        false => "",
    };
    format!(
        "joined AS (
            INSERT INTO {{w}} AS w (lock_table, namespace, key, member, pid, arrival)
            SELECT {table}, $1, $2, $3, {pid}::integer, clock_timestamp()
            WHERE NOT EXISTS (SELECT 1 FROM taken) AND {pid}::integer <> 0 AND {may_join}
            ON CONFLICT (lock_table, namespace, key, member) DO UPDATE SET pid = excluded.pid
            RETURNING 1
        ),
        left_line AS (
            DELETE FROM {{w}}
            WHERE lock_table = {table} AND namespace = $1 AND key = $2 AND member = $3
              {place}
              AND EXISTS (SELECT 1 FROM taken)
            RETURNING 1
        )"
    )
}

/// A lock waiter's attempt that only joins the line of a held lock (see
/// `Statements::join_held`): the lock row is locked first (`FOR UPDATE`),
/// as every statement on the line does, and read in its newest version,
/// so a release that committed meanwhile leaves no row to join behind.
pub(super) const JOIN_HELD: &str = "WITH held AS MATERIALIZED (
        SELECT h.owner, h.fencing, h.expires_at
        FROM {t} AS h
        WHERE h.namespace = $1 AND h.key = $2 AND h.owner ~ '^[0-9a-f]{32}$' AND h.owner <> $3
          AND h.fencing >= 0 AND h.expires_at > clock_timestamp()
        FOR UPDATE
    ),
    joined AS (
        INSERT INTO {w} AS w (lock_table, namespace, key, member, pid, arrival)
        SELECT $4, $1, $2, $3, $5::integer, clock_timestamp()
        WHERE EXISTS (SELECT 1 FROM held)
        ON CONFLICT (lock_table, namespace, key, member) DO UPDATE SET pid = excluded.pid
        RETURNING 1
    )
    SELECT h.owner, h.fencing,
           greatest(0, ceil(extract(epoch FROM (h.expires_at - clock_timestamp())) * 1000))::bigint AS expires_in_ms,
           (SELECT count(*) FROM joined) AS joined
    FROM held AS h";

/// CTE `turn` of a lock's `take_turn`: the requester `$3`'s row in the
/// line of table `$6`, if its turn runs (it was woken at the head: a
/// release, or a leave or attempt that found the key free, gave it the
/// turn, and no other waiter of the line holds one then). The statement's
/// snapshot may predate a change of the line, but not one that would
/// make another waiter the head: only an ended turn moves it on.
pub(super) const TURN: &str = "turn AS MATERIALIZED (
        SELECT w.arrival FROM {w} AS w
        WHERE w.lock_table = $6 AND w.namespace = $1 AND w.key = $2 AND w.member = $3
          AND w.turn_until > clock_timestamp()
    )";

/// CTE `left_line` of a lock's `take_turn`: the head leaves the line as it
/// takes the key (found by member and arrival, see [`picked`]).
pub(super) const LEFT_ON_TURN: &str = "left_line AS (
        DELETE FROM {w} AS w
        WHERE w.lock_table = $6 AND w.namespace = $1 AND w.key = $2 AND w.member = $3
          AND w.arrival = (SELECT arrival FROM turn)
          AND EXISTS (SELECT 1 FROM taken)
        RETURNING 1
    )";

/// What a wake-up does with the waiter it wakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wake {
    /// Takes it off the line (permit lines).
    Pop,
    /// Keeps it at the head and gives it a new turn, whatever its last (a
    /// lock's release).
    Renew,
    /// Keeps it at the head, with its turn if it has one running, else a
    /// new one; a waiter whose turn is over is dropped as a dead one is (a
    /// lock's leave, which may find the woken head on its way).
    Keep,
}

/// CTEs `line`, `chosen`, `popped` and `turned`: when `when` holds
/// (evaluated before the line is read), the first live waiter of table
/// `{table}`'s line (other than `except`) is chosen and woken as `wake`
/// says (`turned`: those given a turn, none for [`Wake::Pop`]), and the
/// dead waiters examined before and after it deleted. Rows another
/// statement is deleting are skipped (`SKIP LOCKED`), as are rows deleted
/// since this statement's snapshot.
pub(super) fn wake_next(when: &str, table: &str, except: Option<&str>, wake: Wake) -> String {
    let except = except
        .map(|member| format!("AND w.member <> {member}"))
        .unwrap_or_default();
    let (over, popped, unless_running) = match wake {
        Wake::Pop => (
            "false",
            "line.member IN (SELECT member FROM chosen)",
            "AND false",
        ),
        Wake::Renew => ("false", "false", ""),
        Wake::Keep => (
            "coalesce(w.turn_until <= clock_timestamp(), false)",
            "line.over",
            "AND w.turn_until IS NULL",
        ),
    };
    format!(
        "line AS MATERIALIZED (
            SELECT w.member, w.arrival, w.pid, {ALIVE} AS alive, {over} AS over
            FROM (
                SELECT w.member, w.arrival, w.pid, w.turn_until
                FROM {{w}} AS w
                WHERE w.lock_table = {table} AND w.namespace = $1 AND w.key = $2 {except} AND ({when})
                ORDER BY w.arrival, w.member
                LIMIT {EXAMINED}
                FOR UPDATE SKIP LOCKED
            ) AS w
        ),
        chosen AS MATERIALIZED (
            SELECT member, arrival, pid FROM line WHERE alive AND NOT over ORDER BY arrival, member LIMIT 1
        ),
        popped AS (
            DELETE FROM {{w}} AS w USING line
            WHERE w.lock_table = {table} AND w.namespace = $1 AND w.key = $2
              AND w.member = ANY (ARRAY(SELECT member FROM line))
              AND w.member = line.member AND (NOT line.alive OR {popped})
              AND EXISTS (SELECT 1 FROM line WHERE NOT alive OR {popped})
            RETURNING 1
        ),
        turned AS (
            UPDATE {{w}} AS w SET turn_until = clock_timestamp() + {turn}
            WHERE {chosen} {unless_running}
            RETURNING w.member, w.pid
        )",
        turn = turn(),
        chosen = picked(table, "chosen"),
    )
}

/// The column expression that notifies the waiter [`wake_next`] woke (see
/// [`woken_from`]): the one it took off the line, or gave a turn.
fn woken_by(wake: Wake, one: &str) -> String {
    match wake {
        Wake::Pop => woken_from("chosen", one),
        Wake::Renew | Wake::Keep => woken_from("turned", one),
    }
}

/// A column expression after [`wake_next`]: notifies each waiter of CTE
/// `source` (columns `member`, `pid`) on channel `{one}_<pid>`, its
/// client's listener's own (payload: its owner, `:`, the key), so no
/// other client's listener (nor server backend) wakes for it; how many
/// (0 or 1).
fn woken_from(source: &str, one: &str) -> String {
    format!(
        "(SELECT count(*) FROM (SELECT {notify} FROM {source} AS w) AS n)",
        notify = notify_one(one)
    )
}

/// Notifies the waiter row `w` on its listener's own channel `{one}_<pid>`
/// (payload: its owner, `:`, the key).
fn notify_one(one: &str) -> String {
    format!("pg_notify({one} || '_' || w.pid::text, w.member || ':' || $2)")
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
pub(super) fn release_next(table: &str, one: &str, wake: Wake) -> (String, String) {
    let released = "EXISTS (SELECT 1 FROM done)";
    (
        format!(", {}", wake_next(released, table, None, wake)),
        format!(
            "(SELECT count(*) FROM done) AS done, {} AS woken, {} AS woke_all",
            woken_by(wake, one),
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
///
/// `wake` says what becomes of the next waiter ([`Wake::Pop`] for permit
/// lines, [`Wake::Keep`] for lock lines).
pub(super) fn leave(free: &str, wake: Wake) -> String {
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
        line = wake_next(when, "$4", Some("$3"), wake),
        woken = woken_by(wake, "$6"),
        woke_all = woke_all(when, "$5"),
    )
}
