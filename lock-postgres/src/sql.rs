//! The SQL statements of the lease-table mode, built once per client for its
//! table. Every value (namespace, key, owner, fencing, TTL, channel) is a
//! bind parameter; only the validated, quoted table name is in the text.
//!
//! All times come from the database's wall clock (`clock_timestamp()`),
//! never the client's (see the crate docs on clocks). Acquire, extend and
//! release are one statement (one round trip) each, atomic on the server;
//! none keeps session state (see the crate docs on poolers for what the
//! driver does).

use crate::keys::{qualified_table, quote_identifier};

/// The statements for one lock table.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `$1` schema name -> `exists bool`.
    pub schema_exists: String,
    /// Creates the schema.
    pub create_schema: String,
    /// `$1` qualified table name -> `exists bool`.
    pub table_exists: String,
    /// Creates the table.
    pub create_table: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms ->
    /// `acquired bool, fencing bigint, owner text, expires_in_ms bigint`:
    /// one row `acquired = true` with the new fencing token, or the holder's
    /// row (`acquired = false`), or no row (a concurrent first insert the
    /// statement's snapshot cannot see yet).
    pub acquire: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` TTL in ms ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before).
    pub extend: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before);
    /// sends `NOTIFY channel, key` when it released.
    pub release: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` channel -> `done bigint`:
    /// frees the lock if `owner` holds it, whatever its fencing token, and
    /// sends `NOTIFY channel, key`. Gives back a lock granted to an acquire
    /// whose caller went away before the reply (the owner token is fresh
    /// per acquisition, so it matches that grant only).
    pub abandon: String,
    /// `$1` namespace, `$2` key -> `held bool, owner text, fencing bigint,
    /// expires_in_ms bigint`, or no row for a key never locked.
    pub inspect: String,
    /// `$1` namespace, `$2` key, `$3` channel -> `done bigint, owner text,
    /// fencing bigint` (the row as it was before); frees a live lock of any
    /// owner distlock wrote and sends `NOTIFY channel, key`.
    pub force_release: String,
}

impl Statements {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified_table(schema, table);
        Self {
            schema_exists: "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1) AS exists"
                .to_owned(),
            create_schema: format!("CREATE SCHEMA IF NOT EXISTS {}", quote_identifier(schema)),
            table_exists: "SELECT pg_catalog.to_regclass($1) IS NOT NULL AS exists".to_owned(),
            create_table: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    namespace text NOT NULL,
                    key text NOT NULL,
                    owner text,
                    fencing bigint NOT NULL,
                    expires_at timestamptz NOT NULL,
                    PRIMARY KEY (namespace, key)
                )"
            ),
            acquire: format!(
                "WITH taken AS (
                    INSERT INTO {t} AS t (namespace, key, owner, fencing, expires_at)
                    VALUES ($1, $2, $3, 1, clock_timestamp() + $4::bigint * interval '1 millisecond')
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET owner = excluded.owner,
                            fencing = t.fencing + 1,
                            expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
                        WHERE (t.owner IS NULL OR t.expires_at <= clock_timestamp())
                          AND (t.owner IS NULL OR t.owner ~ '^[0-9a-f]{{32}}$')
                          AND t.fencing >= 0
                    RETURNING t.fencing
                )
                SELECT true AS acquired, taken.fencing AS fencing, NULL::text AS owner,
                       NULL::bigint AS expires_in_ms
                FROM taken
                UNION ALL
                SELECT false, h.fencing, h.owner,
                       greatest(0, ceil(extract(epoch FROM (h.expires_at - clock_timestamp())) * 1000))::bigint
                FROM {t} AS h
                WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)"
            ),
            extend: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET expires_at = clock_timestamp() + $5::bigint * interval '1 millisecond'
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM done) AS done, h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"
            ),
            release: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($5, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"
            ),
            abandon: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner = $3
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT count(*) AS done FROM (SELECT pg_notify($4, done.key) FROM done) AS n"
            ),
            inspect: format!(
                "SELECT (owner IS NOT NULL AND expires_at > clock_timestamp()) AS held, owner, fencing,
                        greatest(0, ceil(extract(epoch FROM (expires_at - clock_timestamp())) * 1000))::bigint
                            AS expires_in_ms
                 FROM {t} WHERE namespace = $1 AND key = $2"
            ),
            force_release: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner IS NOT NULL
                      AND owner ~ '^[0-9a-f]{{32}}$' AND fencing >= 0
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($3, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"
            ),
        }
    }
}
