//! The statements of the semaphore table: one row per semaphore, its
//! permits in arrays of that row.

use std::sync::Arc;

use super::locks::{given_up, late_send, micros, GIVEN_UP_BEFORE};
use super::{line, Sql, Sweep};
use crate::config::WAITER_TABLE;
use crate::keys::qualified_table;

/// `{a}` (a row of the semaphore table) is in the form distlock writes:
/// a limit of at least 1, three arrays of one length, each permit with an
/// owner token, a fencing token between 1 and the row's counter, an expiry.
fn well_formed(a: &str) -> String {
    format!(
        "({a}.permit_limit >= 1 AND {a}.fencing >= 0
          AND cardinality({a}.owners) = cardinality({a}.fencings)
          AND cardinality({a}.owners) = cardinality({a}.expires)
          AND NOT EXISTS (SELECT 1 FROM unnest({a}.owners, {a}.fencings, {a}.expires) AS w (o, f, e)
                          WHERE w.o IS NULL OR w.o !~ '^[0-9a-f]{{32}}$'
                             OR w.f IS NULL OR w.f < 1 OR w.f > {a}.fencing OR w.e IS NULL))"
    )
}

/// The fencing token of the permit `$3` holds live at `{now}` in row `{a}`
/// (a scalar subquery: NULL if none).
fn own_permit(a: &str, now: &str) -> String {
    format!(
        "(SELECT l.f FROM unnest({a}.owners, {a}.fencings, {a}.expires) AS l (o, f, e)
          WHERE l.o = $3::text AND l.e > {now} LIMIT 1)"
    )
}

/// Whether the permit `$3`, `$4` is live in row `{a}`.
fn holds_permit(a: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM unnest({a}.owners, {a}.fencings, {a}.expires) AS l (o, f, e)
                 WHERE l.o = $3::text AND l.f = $4::bigint AND l.e > clock_timestamp())"
    )
}

/// How many permits of row `{a}` are live at `{now}`.
fn live_permits(a: &str, now: &str) -> String {
    format!("(SELECT count(*) FROM unnest({a}.expires) AS l (e) WHERE l.e > {now})")
}

/// Rewrites the permits of row `t`: those of `rows` (over `l (o, f, e,
/// n)`, `n` their place), in order, each with expiry `expiry`; of those
/// given up (see [`GIVEN_UP_BEFORE`]) only the last `{limit}` are kept, so
/// a row holds at most twice its limit.
fn permits_from(rows: &str, expiry: &str, limit: &str) -> String {
    format!(
        "(owners, fencings, expires) = (
            SELECT coalesce(array_agg(k.o ORDER BY k.n), '{{}}'),
                   coalesce(array_agg(k.f ORDER BY k.n), '{{}}'),
                   coalesce(array_agg(k.e ORDER BY k.n), '{{}}')
            FROM (SELECT l.o, l.f, l.n, {expiry} AS e,
                         count(*) FILTER (WHERE {expiry} < {GIVEN_UP_BEFORE}) OVER (ORDER BY l.n DESC) AS later
                  FROM ({rows}) AS l) AS k
            WHERE k.e >= {GIVEN_UP_BEFORE} OR k.later <= {limit})"
    )
}

/// The permits of row `t` kept by `keep`, as rows for [`permits_from`].
fn permits_of_t(keep: &str) -> String {
    format!(
        "SELECT p.o, p.f, p.e, p.n FROM unnest(t.owners, t.fencings, t.expires) WITH ORDINALITY AS p (o, f, e, n)
         WHERE {keep}"
    )
}

/// Whether row `{a}` holds a permit `$3` gave up from a send numbered `$n`
/// or later: an acquire numbered `$n` is then a late send.
fn late_permit_send(a: &str, n: u32) -> String {
    format!(
        "EXISTS (SELECT 1 FROM unnest({a}.owners, {a}.expires) AS g (o, e) WHERE {})",
        late_send("g.o = $3::text", "g.e", n)
    )
}

/// The waiter line's CTEs of a permit acquire, after its `taken`: a
/// refused attempt joins the line of table `$7` with listener pid `$8`
/// (see [`line::join_or_leave`]), a granted one leaves it. `held` reads
/// the semaphore's row when refused, in its newest version (locked by the
/// refusing `taken`, so final): a late send (`$3` gave the permit up from
/// a send numbered `$6` or later) does not join, its wait being over; nor
/// does a refusal whose snapshot misses the row (inserted since: no
/// `held`), which answers no row, and the client's next attempt joins.
fn permit_line() -> String {
    format!(
        ", held AS MATERIALIZED (
            SELECT h.owners, h.expires FROM {{t}} AS h
            WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)
            FOR UPDATE
        ),
        {}",
        line::join_or_leave(
            "$7",
            "$8",
            false,
            &format!(
                "EXISTS (SELECT 1 FROM held AS h WHERE NOT {})",
                late_permit_send("h", 6)
            )
        )
    )
}

/// The holder labels of row `t` that stay: those of its permits live at
/// `{now}`, except `$3`'s (a label goes with its permit). `t.holders`
/// maps owner tokens to labels; anything else there (not an object) counts
/// as no labels.
fn labels_kept(now: &str) -> String {
    format!(
        "coalesce((SELECT jsonb_object_agg(h.k, h.v)
                   FROM jsonb_each(CASE WHEN jsonb_typeof(t.holders) = 'object' THEN t.holders END) AS h (k, v)
                   WHERE h.k <> $3::text
                     AND EXISTS (SELECT 1 FROM unnest(t.owners, t.expires) AS l (o, e)
                                 WHERE l.o = h.k AND l.e > {now})), '{{}}'::jsonb)"
    )
}

/// `$3`'s label `{label}` (a text parameter, `''` for none) as an entry of
/// `holders`.
fn label_entry(label: &str, none: &str) -> String {
    format!("CASE WHEN {label}::text = '' THEN {none} ELSE jsonb_build_object($3::text, {label}::text) END")
}

/// Adds the holder labels' column to a semaphore table `{t}` created
/// without it, as the lock table's holder columns are added.
const ADD_HOLDERS_COLUMN: &str = "SET LOCAL lock_timeout = '2s';
    ALTER TABLE {t} ADD COLUMN IF NOT EXISTS holders jsonb";

/// The statements that differ on a semaphore table without the `holders`
/// column (made by an earlier version, where this client may not add it):
/// as [`PermitStatements`]' of the same names, without the label
/// parameter; the `holder` that `inspect` answers is always NULL.
#[derive(Debug, Clone)]
pub(crate) struct UnlabelledPermits {
    /// [`PermitStatements::acquire`] without `$7`.
    pub acquire: Arc<Sql>,
    /// [`PermitStatements::acquire_queued`] without `$9`.
    pub acquire_queued: Arc<Sql>,
    /// [`PermitStatements::release`], labels untouched.
    pub release: Arc<Sql>,
    /// [`PermitStatements::release_next`], labels untouched.
    pub release_next: Arc<Sql>,
    /// [`PermitStatements::inspect`], `holder` NULL.
    pub inspect: Arc<Sql>,
}

/// The statements for one semaphore table.
///
/// A semaphore is one row `(namespace, key)` holding its limit, its fencing
/// counter (the last token granted) and its permits as three arrays of one
/// length (owner tokens, fencing tokens, expiries). Every statement writes
/// that one row: under `READ COMMITTED` its row lock, and the re-check of a
/// row changed while the statement waited for it, make each statement
/// atomic, with no lock on anything else — permits in rows of their own
/// could not be counted that way in one statement, whose snapshot predates
/// the row lock. Expired permits are dropped by every statement that
/// writes the row, except the last `permit_limit` of those given up (which
/// refuse their attempts' late sends, see [`GIVEN_UP_BEFORE`]); the row
/// itself stays, so the fencing counter keeps growing, until the sweep
/// deletes it (every permit free for the fencing retention, see
/// [`super::sweep`]).
#[derive(Debug, Clone)]
pub(crate) struct PermitStatements {
    /// Creates the table.
    pub create_table: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms, `$5` limit,
    /// `$6` send number ->
    /// `granted bool, fencing bigint, permit_limit bigint, live bigint,
    /// expires_in_ms bigint, well_formed bool`: one row `granted = true`
    /// with the permit's fencing token, or the semaphore's row as the
    /// statement's snapshot saw it (`granted = false`: its limit, how many
    /// permits are live, when the first of them runs out), or no row (a
    /// concurrent first insert the snapshot cannot see yet).
    ///
    /// Grants if no permit is live (the limit `$5` then applies), or the
    /// limit is `$5` and `$3` holds a live permit (adopted: its fencing
    /// token, its expiry reset to `$4` from now) or fewer than `$5` are live
    /// (a new permit with the next fencing token). Refused if `$3` gave up
    /// a permit from a send numbered `$6` or later (see
    /// [`GIVEN_UP_BEFORE`]), as the lock's acquire is. `$7` is the holder
    /// label (`''` for none), stored in `holders` under `$3` (also on
    /// adoption); the labels of permits no longer live go.
    pub acquire: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` TTL in ms ->
    /// `done bigint, well_formed bool`.
    pub extend: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel,
    /// `$6` the permit's send number -> `done bigint, well_formed bool,
    /// given_up bool` (`given_up`: the row as it was before has the permit
    /// given up, by an earlier send of this release). Keeps the permit
    /// given up by sends up to `$6` (see [`GIVEN_UP_BEFORE`]), drops its
    /// label, and sends `NOTIFY channel, key` when it released.
    pub release: Arc<Sql>,
    /// [`acquire`](Self::acquire) with the waiter line, plus `$7` the
    /// semaphore table's name and `$8` the backend pid of the client's
    /// listener connection (0 for an attempt that does not wait): as the
    /// lock's `acquire_queued`; the holder label is `$9`.
    pub acquire_queued: Arc<Sql>,
    /// [`release`](Self::release) that wakes one waiter, plus `$7` the
    /// semaphore table's name and `$8` the channel of single wake-ups ->
    /// also `woken bigint, woke_all bigint` (as the lock's `release_next`).
    pub release_next: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` the waiter's owner, `$4` the
    /// semaphore table's name, `$5` and `$6` the channels, `$7` the
    /// listener pid (as the lock's `leave`) -> `done bigint,
    /// woken bigint, woke_all bigint`: as the lock's `leave`, the next
    /// waiter woken if a permit is free.
    pub leave: Arc<Sql>,
    /// `$1` namespace, `$2` key -> one row, the live permits oldest first
    /// in arrays: `fencings bigint[], expires_in_ms bigint[], holders
    /// text[]` (each permit's own label: a string under its owner token in
    /// `holders`, else NULL), `permit_limit bigint, well_formed bool`.
    pub inspect: Arc<Sql>,
    /// `$1` qualified table name -> `exists bool`: whether the table has
    /// the `holders` column.
    pub holders_column: Arc<Sql>,
    /// Adds the `holders` column to a table of an earlier version (simple
    /// protocol: two statements in one implicit transaction).
    pub add_holders_column: Arc<Sql>,
    /// The statements for a table without the `holders` column.
    pub unlabelled: UnlabelledPermits,
    /// Deletes semaphore rows nobody has held a permit of for the fencing
    /// retention.
    pub sweep: Sweep,
}

impl PermitStatements {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified_table(schema, table);
        let w = qualified_table(schema, WAITER_TABLE);
        let sql = |template: &str| Arc::new(Sql::with_tables(template, &t, &w));
        let ttl = |n: u32| format!("${n}::bigint * interval '1 millisecond'");
        let now = "excluded.updated_at";
        // A new permit's fencing token: one time value for the permit and
        // the row's counter, so that the permit's is never above it.
        let next = format!("greatest(t.fencing + 1, {})", micros(now));
        // The permit `$3`, `$4` (extend, release).
        let this = "(p.o = $3::text AND p.f = $4::bigint)";
        // Live permits, given-up ones, and that permit.
        let keep = format!("p.e > clock_timestamp() OR p.e < {GIVEN_UP_BEFORE} OR {this}");
        let found = "FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2";
        // `label`: the label's parameter, or none for a table without
        // the `holders` column.
        let acquire = |line: &str, label: Option<&str>| {
            let (column, value, set) = match label {
                Some(label) => (
                    ", holders",
                    format!(", {}", label_entry(label, "NULL")),
                    format!(
                        "holders = {} || {},",
                        labels_kept(now),
                        label_entry(label, "'{}'::jsonb")
                    ),
                ),
                None => ("", String::new(), String::new()),
            };
            format!(
                "WITH now AS (SELECT clock_timestamp() AS at),
                taken AS (
                    INSERT INTO {{t}} AS t (namespace, key, permit_limit, fencing, owners, fencings, expires, updated_at{column})
                    SELECT $1, $2, $5::bigint, {first}, ARRAY[$3::text], ARRAY[{first}], ARRAY[now.at + {ttl4}], now.at{value}
                    FROM now
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET {set}
                            {permits},
                            fencing = CASE WHEN {own} IS NULL THEN {next} ELSE t.fencing END,
                            permit_limit = excluded.permit_limit,
                            updated_at = {now}
                        WHERE {well_formed_t}
                          AND ({live} = 0
                               OR (t.permit_limit = excluded.permit_limit
                                   AND ({own} IS NOT NULL OR {live} < excluded.permit_limit)))
                          AND NOT {late}
                    RETURNING t.fencings[cardinality(t.fencings)] AS fencing
                ){line}
                SELECT true AS granted, taken.fencing AS fencing, NULL::bigint AS permit_limit,
                       NULL::bigint AS live, NULL::bigint AS expires_in_ms, true AS well_formed
                FROM taken
                UNION ALL
                SELECT false, h.fencing, h.permit_limit, {live_h},
                       (SELECT greatest(0, ceil(extract(epoch FROM (min(l.e) - clock_timestamp())) * 1000))::bigint
                        FROM unnest(h.expires) AS l (e) WHERE l.e > clock_timestamp()),
                       coalesce({well_formed_h}, false)
                FROM {{t}} AS h
                WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)",
                ttl4 = ttl(4),
                first = micros("now.at"),
                next = next,
                permits = permits_from(
                    &format!(
                        "{} UNION ALL SELECT $3::text, coalesce({own}, {next}), excluded.expires[1], NULL",
                        permits_of_t(&format!(
                            "(p.e > {now} OR p.e < {GIVEN_UP_BEFORE}) AND p.o <> $3::text"
                        )),
                        own = own_permit("t", now),
                    ),
                    "l.e",
                    "excluded.permit_limit",
                ),
                own = own_permit("t", now),
                live = live_permits("t", now),
                live_h = live_permits("h", "clock_timestamp()"),
                well_formed_t = well_formed("t"),
                well_formed_h = well_formed("h"),
                late = late_permit_send("t", 6),
                line = line,
            )
        };
        // `labelled`: the table has the `holders` column.
        let release = |wake: &str, answer: &str, labelled: bool| {
            let set = match labelled {
                true => format!("holders = {},", labels_kept("clock_timestamp()")),
                false => String::new(),
            };
            format!(
                "WITH done AS (
                    UPDATE {{t}} AS t
                    SET {set} {permits}, updated_at = clock_timestamp()
                    WHERE t.namespace = $1 AND t.key = $2 AND {well_formed_t} AND {holds}
                    RETURNING t.key
                ){wake}
                SELECT {answer},
                       coalesce({well_formed_h}, true) AS well_formed,
                       coalesce((SELECT bool_or(l.o = $3::text AND l.f = $4::bigint AND l.e < {GIVEN_UP_BEFORE})
                                 FROM unnest(h.owners, h.fencings, h.expires) AS l (o, f, e)), false) AS given_up
                {found}",
                permits = permits_from(
                    &permits_of_t(&keep),
                    &format!(
                        "CASE WHEN l.o = $3::text AND l.f = $4::bigint THEN {} ELSE l.e END",
                        given_up(6)
                    ),
                    "t.permit_limit",
                ),
                holds = holds_permit("t"),
                well_formed_t = well_formed("t"),
                well_formed_h = well_formed("h"),
                wake = wake,
                answer = answer,
            )
        };
        let queued = permit_line();
        let notify =
            "(SELECT count(*) FROM (SELECT pg_notify($5, done.key) FROM done) AS n) AS done";
        let (wake, answer) = line::release_next("$7", "$8", line::Wake::Pop);
        // The live permits of a row in arrays, oldest first; `holder` the
        // label expression.
        let inspect = |holder: &str| {
            format!(
                "WITH now AS (SELECT clock_timestamp() AS at)
                 SELECT coalesce(array_agg(l.f ORDER BY l.f), '{{}}') AS fencings,
                        coalesce(array_agg(greatest(0, ceil(extract(epoch FROM (l.e - now.at)) * 1000))::bigint
                                           ORDER BY l.f), '{{}}') AS expires_in_ms,
                        coalesce(array_agg({holder} ORDER BY l.f), '{{}}') AS holders,
                        max(t.permit_limit) AS permit_limit,
                        coalesce(bool_and({well_formed_t}), true) AS well_formed
                 FROM now, {{t}} AS t, unnest(t.owners, t.fencings, t.expires) AS l (o, f, e)
                 WHERE t.namespace = $1 AND t.key = $2 AND l.e > now.at",
                well_formed_t = well_formed("t"),
            )
        };
        let sweep = Sweep::permits(schema, table, &well_formed("{a}"));
        Self {
            create_table: sweep.index.with_table(
                "CREATE TABLE IF NOT EXISTS {t} (
                    namespace text NOT NULL,
                    key text NOT NULL,
                    permit_limit bigint NOT NULL,
                    fencing bigint NOT NULL,
                    owners text[] NOT NULL,
                    fencings bigint[] NOT NULL,
                    expires timestamptz[] NOT NULL,
                    updated_at timestamptz NOT NULL,
                    holders jsonb,
                    PRIMARY KEY (namespace, key)
                )",
            ),
            acquire: sql(&acquire("", Some("$7"))),
            acquire_queued: sql(&acquire(&queued, Some("$9"))),
            extend: sql(&format!(
                "WITH done AS (
                    UPDATE {{t}} AS t
                    SET {permits}, updated_at = clock_timestamp()
                    WHERE t.namespace = $1 AND t.key = $2 AND {well_formed_t} AND {holds}
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM done) AS done, coalesce({well_formed_h}, true) AS well_formed
                {found}",
                // The permit was live when the row was checked: kept even
                // if it ran out since.
                permits = permits_from(
                    &permits_of_t(&keep),
                    &format!(
                        "CASE WHEN l.o = $3::text AND l.f = $4::bigint THEN clock_timestamp() + {} ELSE l.e END",
                        ttl(5)
                    ),
                    "t.permit_limit",
                ),
                holds = holds_permit("t"),
                well_formed_t = well_formed("t"),
                well_formed_h = well_formed("h"),
            )),
            release: sql(&release("", notify, true)),
            release_next: sql(&release(&wake, &answer, true)),
            inspect: sql(&inspect("CASE WHEN jsonb_typeof(t.holders -> l.o) = 'string' THEN t.holders ->> l.o END")),
            holders_column: sql("SELECT count(*) = 1 AS exists FROM pg_catalog.pg_attribute
                 WHERE attrelid = pg_catalog.to_regclass($1) AND NOT attisdropped
                   AND attname = 'holders'"),
            add_holders_column: sql(ADD_HOLDERS_COLUMN),
            unlabelled: UnlabelledPermits {
                acquire: sql(&acquire("", None)),
                acquire_queued: sql(&acquire(&queued, None)),
                release: sql(&release("", notify, false)),
                release_next: sql(&release(&wake, &answer, false)),
                inspect: sql(&inspect("NULL::text")),
            },
            leave: sql(&line::leave(
                &format!(
                    "{} < h.permit_limit",
                    live_permits("h", "clock_timestamp()")
                ),
                line::Wake::Pop,
            )),
            sweep,
        }
    }
}

/// The text of the permit statements for the semaphore table
/// `schema.table`, as [`StatementTexts`] gives the lock's: for the
/// workspace benchmark's raw permit baseline, and the sweep's for the
/// tests that read its plan. Not a stable API.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct PermitStatementTexts {
    /// `$1` namespace, `$2` key, `$3` owner (32 lowercase hex digits), `$4`
    /// TTL in ms, `$5` limit, `$6` send number, `$7` the semaphore table's
    /// name, `$8` the waiter's listener pid (0: not waiting), `$9` the
    /// holder label (`''` for none) -> `granted
    /// bool, fencing bigint, ...`.
    pub acquire: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel,
    /// `$6` the acquire's send number, `$7` the semaphore table's name,
    /// `$8` the channel of single wake-ups -> `done bigint, ...`.
    pub release: String,
    /// The sweep's delete: `$1` namespace, `$2` retention in ms, `$3`
    /// batch size -> `done bigint`.
    pub sweep: String,
}

impl PermitStatementTexts {
    /// The statements for the semaphore table `schema.table` (unquoted
    /// names).
    pub fn new(schema: &str, table: &str) -> Self {
        let statements = PermitStatements::new(schema, table);
        Self {
            acquire: statements.acquire_queued.text.clone(),
            release: statements.release_next.text.clone(),
            sweep: statements.sweep.delete.text.clone(),
        }
    }
}
