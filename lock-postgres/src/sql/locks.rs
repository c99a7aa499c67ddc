//! The statements of the lock table (and of the namespace's format
//! marker): one row per lock, given up rows kept (so a key's fencing
//! counter keeps growing) until the sweep deletes them, the fencing
//! retention after their last acquisition (see [`super::sweep`]).

use std::sync::Arc;

use super::{index, line, Index, Sql, Sweep};
use crate::config::{FORMAT_TABLE, WAITER_INDEX, WAITER_TABLE};
use crate::keys::{qualified_table, quote_identifier};
use crate::listener::{HOLDER_SUFFIX, NEXT_SUFFIX};

/// Marks a row (or a permit, see [`super::PermitStatements`]) that an
/// owner token gave up (released, or given back by a caller that left
/// before the reply): it keeps that owner, and its expiry is as many
/// microseconds after the Unix epoch as the *send number* of the
/// acquisition (see [`Statements::acquire`]). It is long expired, so it is
/// free for everyone; but a send of that owner token numbered at most that
/// is refused ([`late_send`]), so an acquire the server applies late can
/// never take back what its owner already gave up. Real expiries are
/// `clock_timestamp() + ttl`, never before 2000.
pub(crate) const GIVEN_UP_BEFORE: &str = "'2000-01-01 00:00:00+00'::timestamptz";

/// The expiry of a row or permit given up by sends numbered up to `$n`.
pub(super) fn given_up(n: u32) -> String {
    format!("('epoch'::timestamptz + ${n}::bigint * interval '1 microsecond')")
}

/// The microseconds since the Unix epoch of the timestamp `at`: the clock
/// part of a fencing token, which is `greatest(counter + 1, this)` (see the
/// crate docs on fencing tokens).
pub(super) fn micros(at: &str) -> String {
    format!("floor(extract(epoch FROM {at}) * 1000000)::bigint")
}

/// Whether an acquire numbered `$n` is a late send: `{same_owner}` (its
/// owner token is the one of the row or permit) and `{expiry}` marks it
/// given up by that owner from a send numbered `$n` or later.
pub(super) fn late_send(same_owner: &str, expiry: &str, n: u32) -> String {
    format!(
        "({same_owner} AND {expiry} < {GIVEN_UP_BEFORE} AND {expiry} >= {})",
        given_up(n)
    )
}

/// Adds the holder columns to a lock table `{t}` created without them.
/// Adding a nullable column without a default changes only the catalog,
/// but takes the table's strongest lock: `lock_timeout` bounds the wait
/// for it (lock statements queue behind a waiting `ALTER`), and a client
/// that times out works without labels and tries again at its next start.
const ADD_HOLDER_COLUMNS: &str = "SET LOCAL lock_timeout = '2s';
    ALTER TABLE {t} ADD COLUMN IF NOT EXISTS holder text, ADD COLUMN IF NOT EXISTS holder_owner text";

/// The statements that differ on a lock table without the holder columns
/// (made by an earlier version, where this client may not add them): as
/// [`Statements`]' of the same names, without the label and observers'
/// channel parameters (nothing wakes observers there); the `holder` that
/// `inspect` answers is always NULL.
#[derive(Debug, Clone)]
pub(crate) struct Unlabelled {
    /// [`Statements::acquire`] without `$6` and `$7`.
    pub acquire: Arc<Sql>,
    /// [`Statements::acquire_queued`] without `$8` and `$9`, but with `$8`
    /// the channel of single wake-ups.
    pub acquire_queued: Arc<Sql>,
    /// [`Statements::take_turn`] without `$7` and `$8`.
    pub take_turn: Arc<Sql>,
    /// [`Statements::release`] without `$7`.
    pub release: Arc<Sql>,
    /// [`Statements::release_next`] without `$9`.
    pub release_next: Arc<Sql>,
    /// [`Statements::inspect`], `holder` NULL.
    pub inspect: Arc<Sql>,
}

/// Whom an acquire's `taken` grants a free key to.
#[derive(Debug, Clone, Copy)]
enum Takes {
    /// Anyone (a statement without the waiter line).
    Anyone,
    /// The line's head, or anyone on an empty line (`line::fair_turn`).
    Line,
    /// The requester on its running turn only (`line::TURN`).
    Turn,
}

/// The statements for one lock table.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `$1` schema name -> `exists bool`.
    pub schema_exists: Arc<Sql>,
    /// Creates the schema.
    pub create_schema: Arc<Sql>,
    /// `$1` qualified table name -> `exists bool`.
    pub table_exists: Arc<Sql>,
    /// Creates the table.
    pub create_table: Arc<Sql>,
    /// The quoted, qualified table of format markers.
    pub format_table: String,
    /// Creates the table of format markers.
    pub create_format_table: Arc<Sql>,
    /// `$1` lock table name, `$2` namespace -> `format text`: the marker, if
    /// any (a read, so a read-only user or server gets past it).
    pub read_format: Arc<Sql>,
    /// `$1` lock table name, `$2` namespace, `$3` this client's format ->
    /// `format text`: stores `$3` as the marker of the lock table and
    /// namespace if they have none, and returns the marker; no row when a
    /// concurrent first insert is committed but not in the statement's
    /// snapshot (sent again, it sees it).
    pub format: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms, `$5` send
    /// number, `$6` the holder label (`''` for none), `$7` the observers'
    /// channel -> `acquired bool, fencing bigint, owner text, expires_in_ms
    /// bigint, version text`: one row `acquired = true` with the fencing
    /// token and the version (`xmin`) of the row it wrote, or the holder's
    /// row (`acquired = false`), or no row (a concurrent first insert the
    /// statement's snapshot cannot see yet).
    ///
    /// Takes a free or expired lock with the next fencing token, and
    /// *adopts* a live lock held by `$3` itself (an earlier attempt of the
    /// same acquisition whose reply was lost): same fencing token, expiry
    /// reset to `$4` from now. The label is stored with the owner token
    /// that wrote it (`holder`, `holder_owner`), also on adoption; a
    /// labelled grant sends `NOTIFY $7, key` (a label is what observers
    /// follow, so an unlabelled one costs nothing more). A row
    /// that `$3` gave up with a send number
    /// of at least `$5` is refused (see [`GIVEN_UP_BEFORE`]). Send numbers
    /// grow with every acquisition a process starts, so a later
    /// acquisition with the same owner token is never refused that way.
    pub acquire: Arc<Sql>,
    /// [`acquire`](Self::acquire) with the waiter line: `$6` the lock
    /// table's name, `$7` the backend pid of the client's listener
    /// connection (0 for an attempt that does not wait), `$8` the holder
    /// label (`''` for none), `$9` the observers' channel -> also
    /// `turn_ms bigint`. Refused, a waiting `$3` joins the lock's waiter
    /// line (keeping its place); granted, it leaves it. A free key is
    /// granted only to the line's head, or on an empty line (see
    /// `line::fair_turn`); refused on a free key, the attempt drops the
    /// waiters that no longer stand, wakes a head never woken (on the
    /// channel of single wake-ups, made of `$9`: see `line`), and answers
    /// `turn_ms`, the time left of the head's turn (NULL when the key is
    /// held).
    pub acquire_queued: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` the lock table's name,
    /// `$5` the backend pid of the client's listener connection -> `owner
    /// text, fencing bigint, expires_in_ms bigint`: when another owner holds
    /// the lock (live, in a format distlock writes), `$3` joins its waiter
    /// line (keeping its place) and the holder is answered, as
    /// [`acquire_queued`](Self::acquire_queued) refusing it would; else no
    /// row and nothing written (the full attempt follows). A wait's first
    /// attempt that is most likely refused sends this first (see the crate
    /// docs, "Waiting"): its refusal here is a fraction of the full
    /// statement's work (see `line::JOIN_HELD`).
    pub join_held: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms, `$5` send
    /// number, `$6` the lock table's name, `$7` the holder label (`''` for
    /// none), `$8` the observers' channel -> `acquired bool, fencing bigint,
    /// version text`: one row when `$3` took the free key on its running
    /// turn (the woken head of the line, which leaves it), as
    /// [`acquire_queued`](Self::acquire_queued) would grant it; else no row
    /// and nothing written (the full attempt follows). A wait's attempt
    /// after it was refused in line sends this first: woken, it holds the turn,
    /// and this grant skips what the full statement sets up to judge the
    /// line (see `line::TURN`).
    pub take_turn: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` TTL in ms ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before).
    pub extend: Arc<Sql>,
    /// `$1` namespace, `$2` the locks as a JSON array of `{"n": <place>,
    /// "key": text, "owner": text, "fencing": bigint}`, `$3` TTL in ms,
    /// `$4` how many locks `$2` has -> one row of arrays in the order of
    /// `n`: `done bigint[], owner
    /// text[], fencing bigint[]`, each item as [`extend`](Self::extend)
    /// answers for its lock.
    pub extend_many: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel,
    /// `$6` the lease's send number, `$7` the observers' channel -> `done
    /// bigint, owner text, fencing bigint, given_up bool` (the row as it
    /// was before); marks the row given up (see [`GIVEN_UP_BEFORE`]) and
    /// sends `NOTIFY channel, key` when it released, and `NOTIFY $7, key`
    /// if the lock was labelled by its owner.
    pub release: Arc<Sql>,
    /// [`release`](Self::release) that wakes one waiter, plus `$7` the
    /// lock table's name, `$8` the channel of single wake-ups and `$9` the
    /// observers' channel (which a labelled lock's release notifies,
    /// whoever else it wakes) -> also
    /// `woken bigint, woke_all bigint`: when it released, gives the first
    /// live waiter of the lock's line its turn (it stays at the head) and
    /// sends `NOTIFY $8_<pid>, 'owner:key'`, or, with no live waiter,
    /// `NOTIFY $5, key` (see `line`).
    pub release_next: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` the waiter's owner, `$4` the lock
    /// table's name, `$5` the channel that wakes every waiter of a key,
    /// `$6` the channel of single wake-ups, `$7` the listener pid the wait
    /// registered with -> `done bigint, woken bigint, woke_all bigint`: a
    /// wait that ended without the lock leaves the line (unless its
    /// listener connection is gone: see `line::leave`); if the
    /// lock is free, the next waiter is woken as a release wakes it (the
    /// one leaving may have taken a wake-up with it).
    pub leave: Arc<Sql>,
    /// The quoted, qualified table of waiter lines.
    pub waiter_table: String,
    /// Creates the table of waiter lines, with its index by arrival.
    pub create_waiter_table: Arc<Sql>,
    /// The waiter table's index by arrival.
    pub waiter_index: Index,
    /// `$1` an index's quoted, qualified name -> `state text` (see
    /// `index::STATE`).
    pub index_state: Arc<Sql>,
    /// `$1` qualified table name -> `exists bool`: whether this role may
    /// read, add, change and delete its rows.
    pub table_writable: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` version, `$5` send
    /// number, `$6` channel, `$7` the observers' channel for a labelled
    /// grant (`''`: none) -> `done bigint`: for an acquire whose caller
    /// left before the reply. Marks the row given up by `$3` up to send
    /// `$5` (see [`GIVEN_UP_BEFORE`]) if it is still exactly the version
    /// `$4` that acquire wrote (nothing adopted, extended or released it
    /// since), or if nobody holds it (so that an earlier send of the
    /// acquire that the server applies later is refused); creates it so
    /// marked if there is no row. Sends `NOTIFY channel, key` when it
    /// wrote, and `NOTIFY $7, key` too unless `$7` is `''`.
    pub give_back: Arc<Sql>,
    /// `$1` namespace, `$2` key -> `held bool, owner text, fencing bigint,
    /// expires_in_ms bigint, holder text`, or no row for a key never
    /// locked. `holder` is the label only if the row's owner stored it
    /// (never one an earlier owner left, see [`acquire`](Self::acquire)).
    pub inspect: Arc<Sql>,
    /// The statements that name no holder column, for a table of an
    /// earlier version this client could not add them to.
    pub unlabelled: Unlabelled,
    /// `$1` qualified table name -> `exists bool`: whether the table has
    /// both holder columns.
    pub holder_columns: Arc<Sql>,
    /// Adds the holder columns to a table of an earlier version (simple
    /// protocol: two statements in one implicit transaction).
    pub add_holder_columns: Arc<Sql>,
    /// `$1` qualified waiter table -> `exists bool`: whether it has the
    /// turn column.
    pub turn_column: Arc<Sql>,
    /// Adds the turn column to a waiter table of an earlier version
    /// (simple protocol, as `add_holder_columns`).
    pub add_turn_column: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` channel, `$4` the observers' channel
    /// -> `done bigint, owner text, fencing bigint` (the row as it was
    /// before); frees a live lock of any owner distlock wrote and sends
    /// `NOTIFY channel, key` and `NOTIFY $4, key`.
    pub force_release: Arc<Sql>,
    /// Deletes rows nobody has held for the fencing retention.
    pub sweep: Sweep,
}

impl Statements {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified_table(schema, table);
        let w = qualified_table(schema, WAITER_TABLE);
        let waiter_index = Index::new(line::CREATE_INDEX, schema, WAITER_TABLE, WAITER_INDEX);
        let sql = |template: &str| Arc::new(Sql::with_tables(template, &t, &w));
        let format_table = qualified_table(schema, FORMAT_TABLE);
        let marker = |template: &str| Arc::new(Sql::new(template, &format_table));
        let clock = micros("clock_timestamp()");
        // The acquire: takes the lock (`taken`), or answers with the holder.
        // With `label` (the numbers of its parameter and of the observers'
        // channel), it also stores the holder label (NULL for `''`: a
        // `HolderId` is never empty) and the owner token that wrote it: an
        // older client's acquire leaves both as they were, so `inspect`
        // shows a label only where `holder_owner` is the row's owner. A
        // labelled grant notifies observers from RETURNING, evaluated only
        // for the row it wrote.
        // With `fair` (a statement with the waiter line, after
        // `line::fair_line`), a free key is taken only on the line's turn
        // (`line::fair_turn`); a live lock of the same owner is adopted
        // whatever the line.
        // With `Takes::Turn` (after `line::TURN`), a free key is taken only
        // on the requester's running turn, and nothing else is granted.
        let taken = |label: Option<(u32, u32)>, takes: Takes| {
            let free = "(t.owner IS NULL OR t.expires_at <= clock_timestamp())";
            let takeable = match takes {
                Takes::Line => format!(
                    "((t.owner = excluded.owner AND t.expires_at > clock_timestamp())
                      OR ({free} AND {}))",
                    line::fair_turn()
                ),
                Takes::Anyone => format!("({free} OR t.owner = excluded.owner)"),
                Takes::Turn => format!("({free} AND EXISTS (SELECT 1 FROM turn))"),
            };
            // A key never locked has no row (and so no turn).
            let (source, only) = match takes {
                Takes::Turn => ("SELECT", " WHERE EXISTS (SELECT 1 FROM turn)"),
                Takes::Anyone | Takes::Line => ("VALUES (", ")"),
            };
            let (columns, values, set, observed) = match label {
                Some((n, channel)) => (
                    ", holder, holder_owner",
                    format!(", nullif(${n}::text, ''), $3"),
                    ",
                            holder = excluded.holder,
                            holder_owner = excluded.holder_owner",
                    format!(", CASE WHEN ${n}::text <> '' THEN pg_notify(${channel}, t.key) END AS observed"),
                ),
                None => ("", String::new(), "", String::new()),
            };
            format!("taken AS (
                    INSERT INTO {{t}} AS t (namespace, key, owner, fencing, expires_at{columns})
                    {source} $1, $2, $3, {clock}, clock_timestamp() + $4::bigint * interval '1 millisecond'{values}{only}
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET owner = excluded.owner,
                            fencing = CASE WHEN t.owner = excluded.owner AND t.expires_at > clock_timestamp()
                                           THEN t.fencing ELSE greatest(t.fencing + 1, {clock}) END,
                            expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'{set}
                        WHERE (t.owner IS NULL OR t.owner ~ '^[0-9a-f]{{32}}$')
                          AND t.fencing >= 0
                          AND {takeable}
                          AND NOT coalesce({late}, false)
                    RETURNING t.fencing, t.xmin::text AS version{observed}
                )
                ",
                late = late_send("t.owner = excluded.owner", "t.expires_at", 5)
            )
        };
        // `turn_ms` (the expression for a refusal): the time left of the
        // line's turn when refused on a free key, else NULL. `holder`: the
        // rows a refusal reads the holder's (`h`) from, and the start of
        // their condition.
        let answer = |turn_ms: &str, holder: &str| {
            format!(
                "SELECT true AS acquired, taken.fencing AS fencing, NULL::text AS owner,
                       NULL::bigint AS expires_in_ms, taken.version AS version, NULL::bigint AS turn_ms
                FROM taken
                UNION ALL
                SELECT false, h.fencing, h.owner,
                       greatest(0, ceil(extract(epoch FROM (h.expires_at - clock_timestamp())) * 1000))::bigint,
                       NULL::text, {turn_ms}
                FROM {holder} NOT EXISTS (SELECT 1 FROM taken)"
            )
        };
        let plain = answer(
            "NULL::bigint",
            "{t} AS h WHERE h.namespace = $1 AND h.key = $2 AND",
        );
        // A refusal joins the line unless it is a late send (of `held`, in
        // `fair_after_taken`: the refusing row's newest version). Nor does
        // one whose snapshot misses the row (inserted since; no `held`):
        // it answers no row, and the client's next attempt joins.
        let may_join = format!(
            "EXISTS (SELECT 1 FROM held AS h WHERE NOT coalesce({}, false))",
            late_send("h.owner = $3", "h.expires_at", 5)
        );
        let queued = line::join_or_leave("$6", "$7", true, &may_join);
        // The channel of single wake-ups: `$8` where the acquire has no
        // label parameters, else made of the observers' channel `$9`
        // (`<channel>_holder` -> `<channel>_next`, see `listener`), so that
        // the statement keeps the parameters of earlier versions.
        let queued_acquire = |taken: &str, one: &str| {
            let (after, turn_ms) = line::fair_after_taken("$6", one);
            // The holder as `held` locked it, its newest version: a row
            // this statement's snapshot shows as it was before a grant that
            // committed while the statement waited for it would show the
            // lock expired (the refused attempt sent again at once).
            format!(
                "WITH {}, {taken}, {after}, {queued} {}",
                line::fair_line("$6"),
                answer(&turn_ms, "held AS h WHERE")
            )
        };
        // The woken head's grant on its turn: only the grant, or no row.
        let take_turn = |taken: &str| {
            format!(
                "WITH {}, {taken}, {} SELECT true AS acquired, taken.fencing AS fencing, taken.version AS version FROM taken",
                line::TURN,
                line::LEFT_ON_TURN
            )
        };
        let derived_next = format!(
            "(left($9::text, -{}) || '{NEXT_SUFFIX}')",
            HOLDER_SUFFIX.len()
        );
        let inspect = |holder: &str| {
            sql(&format!("SELECT (owner IS NOT NULL AND expires_at > clock_timestamp()) AS held, owner, fencing,
                        greatest(0, ceil(extract(epoch FROM (expires_at - clock_timestamp())) * 1000))::bigint
                            AS expires_in_ms,
                        {holder} AS holder
                 FROM {{t}} WHERE namespace = $1 AND key = $2"))
        };
        // The release; with `observers` (the number of the parameter of
        // their channel), it notifies them when its owner labelled the lock
        // (as the acquire did; RETURNING shows the released row).
        let release = |wake: &str, answer: &str, observers: Option<u32>| {
            let observed = observers
                .map(|n| format!(", CASE WHEN holder IS NOT NULL AND holder_owner = owner THEN pg_notify(${n}, key) END AS observed"))
                .unwrap_or_default();
            format!(
                "WITH done AS (
                    UPDATE {{t}}
                    SET expires_at = {up_to}
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING key{observed}
                ){wake}
                SELECT {answer},
                       h.owner AS owner, h.fencing AS fencing,
                       coalesce(h.expires_at < {GIVEN_UP_BEFORE}, false) AS given_up
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {{t}} AS h ON h.namespace = $1 AND h.key = $2",
                up_to = given_up(6)
            )
        };
        let release_all =
            "(SELECT count(*) FROM (SELECT pg_notify($5, done.key) FROM done) AS n) AS done";
        let (wake, release_one) = line::release_next("$7", "$8", line::Wake::Renew);
        let sweep = Sweep::locks(schema, table);
        Self {
            release: sql(&release("", release_all, Some(7))),
            release_next: sql(&release(&wake, &release_one, Some(9))),
            leave: sql(&line::leave(
                "h.owner IS NULL OR h.expires_at <= clock_timestamp()",
                line::Wake::Keep,
            )),
            turn_column: sql(line::TURN_COLUMN),
            add_turn_column: Arc::new(Sql::new(line::ADD_TURN_COLUMN, &w)),
            waiter_table: w.clone(),
            create_waiter_table: waiter_index.with_table(line::CREATE_TABLE),
            waiter_index,
            index_state: sql(index::STATE),
            table_writable: sql("SELECT has_table_privilege($1, 'SELECT') AND has_table_privilege($1, 'INSERT')
                    AND has_table_privilege($1, 'UPDATE') AND has_table_privilege($1, 'DELETE') AS exists"),
            create_format_table: marker(
                "CREATE TABLE IF NOT EXISTS {t} (
                    lock_table text NOT NULL,
                    namespace text NOT NULL,
                    format text NOT NULL,
                    PRIMARY KEY (lock_table, namespace)
                )",
            ),
            read_format: marker(
                "SELECT format FROM {t} WHERE lock_table = $1 AND namespace = $2",
            ),
            format: marker(
                "WITH stored AS (
                    INSERT INTO {t} (lock_table, namespace, format) VALUES ($1, $2, $3)
                    ON CONFLICT (lock_table, namespace) DO NOTHING
                    RETURNING format
                )
                SELECT format FROM stored
                UNION ALL
                SELECT format FROM {t} WHERE lock_table = $1 AND namespace = $2",
            ),
            format_table: format_table.clone(),
            schema_exists: sql(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1) AS exists",
            ),
            create_schema: Arc::new(Sql::new(
                "CREATE SCHEMA IF NOT EXISTS {t}",
                &quote_identifier(schema),
            )),
            table_exists: sql("SELECT pg_catalog.to_regclass($1) IS NOT NULL AS exists"),
            create_table: sweep.index.with_table(
                "CREATE TABLE IF NOT EXISTS {t} (
                    namespace text NOT NULL,
                    key text NOT NULL,
                    owner text,
                    fencing bigint NOT NULL,
                    expires_at timestamptz NOT NULL,
                    holder text,
                    holder_owner text,
                    PRIMARY KEY (namespace, key)
                )",
            ),
            acquire: sql(&format!("WITH {} {plain}", taken(Some((6, 7)), Takes::Anyone))),
            acquire_queued: sql(&queued_acquire(&taken(Some((8, 9)), Takes::Line), &derived_next)),
            join_held: sql(line::JOIN_HELD),
            take_turn: sql(&take_turn(&taken(Some((7, 8)), Takes::Turn))),
            unlabelled: Unlabelled {
                acquire: sql(&format!("WITH {} {plain}", taken(None, Takes::Anyone))),
                acquire_queued: sql(&queued_acquire(&taken(None, Takes::Line), "$8")),
                take_turn: sql(&take_turn(&taken(None, Takes::Turn))),
                release: sql(&release("", release_all, None)),
                release_next: sql(&release(&wake, &release_one, None)),
                inspect: inspect("NULL::text"),
            },
            holder_columns: sql("SELECT count(*) = 2 AS exists FROM pg_catalog.pg_attribute
                 WHERE attrelid = pg_catalog.to_regclass($1) AND NOT attisdropped
                   AND attname IN ('holder', 'holder_owner')"),
            add_holder_columns: sql(ADD_HOLDER_COLUMNS),
            extend: sql("WITH done AS (
                    UPDATE {t}
                    SET expires_at = clock_timestamp() + $5::bigint * interval '1 millisecond'
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM done) AS done, h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"),
            // Each lock's answer asks whether its `n` was updated with
            // one uncorrelated `IN`, which the server hashes once: a
            // count per lock read the updated rows once for each lock,
            // 250,000 rows for a batch of 500 (a key is updated at most
            // once, so the count was 0 or 1 anyway).
            // `LIMIT $4` (the batch's length) is the planner's count of
            // the batch, which it otherwise takes for 100 rows: a batch of
            // one then read the whole table twice, by two sequential scans,
            // wherever that looked cheaper than 100 index look-ups.
            extend_many: sql("WITH b AS (
                    SELECT * FROM jsonb_to_recordset($2::jsonb) AS b (n bigint, key text, owner text, fencing bigint)
                    LIMIT $4::bigint
                ), done AS (
                    UPDATE {t} AS t
                    SET expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond'
                    FROM b
                    WHERE t.namespace = $1 AND t.key = b.key AND t.owner = b.owner AND t.fencing = b.fencing
                      AND t.expires_at > clock_timestamp()
                    RETURNING b.n
                )
                SELECT coalesce(array_agg((b.n IN (SELECT d.n FROM done AS d))::int::bigint ORDER BY b.n), '{}') AS done,
                       coalesce(array_agg(h.owner ORDER BY b.n), '{}') AS owner,
                       coalesce(array_agg(h.fencing ORDER BY b.n), '{}') AS fencing
                FROM b
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = b.key"),
            // The counter moves to the clock (no token is issued), so that
            // the sweep keeps the row, and the late sends it refuses, for
            // the retention from now.
            give_back: sql(&format!("WITH done AS (
                    INSERT INTO {{t}} AS t (namespace, key, owner, fencing, expires_at)
                    VALUES ($1, $2, $3, {clock}, {up_to})
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET owner = excluded.owner, expires_at = excluded.expires_at,
                            fencing = greatest(t.fencing, excluded.fencing)
                        WHERE (t.owner = excluded.owner AND t.xmin = $4::xid)
                           OR ((t.owner IS NULL OR (t.expires_at <= clock_timestamp()
                                                    AND t.expires_at >= {GIVEN_UP_BEFORE}))
                               AND (t.owner IS NULL OR t.owner ~ '^[0-9a-f]{{32}}$')
                               AND t.fencing >= 0)
                    RETURNING t.key
                )
                SELECT count(*) AS done FROM (
                    SELECT pg_notify($6, done.key),
                           CASE WHEN $7::text <> '' THEN pg_notify($7, done.key) END
                    FROM done) AS n",
                up_to = given_up(5),
                clock = clock)),
            inspect: inspect("CASE WHEN holder_owner = owner THEN holder END"),
            force_release: sql("WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner IS NOT NULL
                      AND owner ~ '^[0-9a-f]{32}$' AND fencing >= 0
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($3, done.key), pg_notify($4, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"),
            sweep,
        }
    }
}

/// The text of the lock statements for the table `schema.table`, exactly as
/// the backend sends them over the extended protocol (`$1`, `$2`, ...
/// parameters) once its table of waiter lines exists: for the workspace
/// benchmark, which runs them over a plain sqlx pool beside the library, so
/// its baseline is the library's own SQL. Not a stable API.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct StatementTexts {
    /// `$1` namespace, `$2` key, `$3` owner (32 lowercase hex digits), `$4`
    /// TTL in ms, `$5` send number, `$6` the lock table's name, `$7` the
    /// waiter's listener pid (0: not waiting), `$8` the holder label (`''`
    /// for none), `$9` the observers' channel -> `acquired bool, fencing
    /// bigint, ...`.
    pub acquire: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel,
    /// `$6` the acquire's send number, `$7` the lock table's name, `$8` the
    /// channel of single wake-ups, `$9` the observers' channel -> `done
    /// bigint, ...`.
    pub release: String,
    /// The batched extend: `$1` namespace, `$2` the locks (a JSON array
    /// of `{n, key, owner, fencing}`), `$3` TTL in ms, `$4` how many locks
    /// `$2` has -> `done bigint[],
    /// owner text[], fencing bigint[]`, in the order of `n`.
    pub extend_many: String,
    /// The sweep's delete: `$1` namespace, `$2` retention in ms, `$3`
    /// batch size -> `done bigint`.
    pub sweep: String,
}

impl StatementTexts {
    /// The statements for the lock table `schema.table` (unquoted names).
    pub fn new(schema: &str, table: &str) -> Self {
        let statements = Statements::new(schema, table);
        Self {
            acquire: statements.acquire_queued.text.clone(),
            release: statements.release_next.text.clone(),
            extend_many: statements.extend_many.text.clone(),
            sweep: statements.sweep.delete.text.clone(),
        }
    }
}
