//! Server settings a client must cope with: string-literal settings and a
//! `SQL_ASCII` database under the literals of `pool_mode=transaction`, and
//! errors no retry can fix (a read-only server, a missing function, a
//! rejected string literal), which end a waiting acquire at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::ObservedLock;
use distlock_core::{AcquireAttempt, LockClient, LockState};

use super::support::*;

/// Look-alike and awkward keys that must each be a row of their own, the
/// same one whether values are literals or bind parameters.
const AWKWARD: &[&str] = &[
    "it's",
    "it''s",
    "\\'",
    "''",
    "'",
    "\\",
    "back\\slash\\",
    "E'\\x27'",
    "\\u0027",
    "\\U00000027",
    "'); DROP TABLE distlock_locks; --",
    "a",
    "\u{430}",  // Cyrillic a
    "\u{ff41}", // fullwidth a
    "\u{e9}",   // é precomposed
    "e\u{301}", // e + combining acute
    "\u{c5}",   // Å
    "\u{212b}", // Angstrom sign
    "\u{fb01}", // the fi ligature
    "fi",
    "zero\u{200b}width",
    "ünïcødé ключ 鍵 🔒",
    "tab\there\nnew\r\u{7f}\u{80}\u{9f}\u{a0}\u{ffff}",
    "$1 $2",
    "%_",
    "$d$",
    "x$d",
    "$d1",
    "$",
    "$$",
];

/// A client sending values as literals (`pool_mode=transaction`) and one
/// binding them, on the same rows (`query` names namespace, table and
/// settings).
async fn literal_and_bound(base: &str, query: &str) -> (Pg, Pg) {
    let literal = Pg::connect(&format!("{base}?{query}&pool_mode=transaction")).await;
    let bound = Pg::connect(&format!("{base}?{query}")).await;
    (literal, bound)
}

/// Every key of [`AWKWARD`] taken through `literal` is held, with the same
/// fencing token, as `bound` sees it, and the other way round; and no two
/// of them share a row.
async fn assert_same_rows(literal: &Pg, bound: &Pg, setting: &str) {
    let ttl = Duration::from_secs(30);
    let mut leases = Vec::new();
    for name in AWKWARD {
        let k = key(name);
        let lease = match literal.try_acquire(&k, ttl).await {
            Ok(AcquireAttempt::Acquired(lease)) => lease,
            other => panic!(
                "{setting}: {name:?} through literals: {other:?} (free, and a row of its own)"
            ),
        };
        match bound.inspect(&k).await.unwrap() {
            LockState::Held { fencing_token, .. } => {
                assert_eq!(fencing_token, lease.fencing_token(), "{setting}: {name:?}")
            }
            state => panic!(
                "{setting}: {name:?} taken with literals, but {state:?} with bind parameters"
            ),
        }
        leases.push(lease);
    }
    for lease in leases {
        let name = lease.key().as_str().to_owned();
        let lease = literal
            .extend(&lease, ttl)
            .await
            .unwrap_or_else(|e| panic!("{setting}: extending {name:?}: {e}"));
        literal
            .release(&lease)
            .await
            .unwrap_or_else(|e| panic!("{setting}: releasing {name:?}: {e}"));
        let again = take(bound, lease.key(), ttl, "released through literals").await;
        assert!(again.fencing_token() > lease.fencing_token(), "{name:?}");
        assert!(
            matches!(
                literal.try_acquire(lease.key(), ttl).await.unwrap(),
                AcquireAttempt::Held { .. }
            ),
            "{setting}: {name:?} held through bind parameters, seen through literals"
        );
        bound.release(&again).await.unwrap();
    }
}

#[tokio::test]
async fn literals_reach_the_rows_of_bind_parameters_whatever_the_string_settings() {
    let settings = [
        "backslash_quote=off",
        "standard_conforming_strings=off",
        "backslash_quote=off -c standard_conforming_strings=off -c escape_string_warning=on",
        "backslash_quote=on -c standard_conforming_strings=on",
    ];
    for setting in settings {
        let query = format!(
            "namespace={}&options={}",
            unique_name("strings"),
            percent_encode(&format!("-c {setting}"))
        );
        let (literal, bound) = literal_and_bound(&server().url(), &query).await;
        assert_same_rows(&literal, &bound, setting).await;
    }
}

#[tokio::test]
async fn literals_reach_the_rows_of_bind_parameters_on_a_sql_ascii_database() {
    let admin_client = client("sql_ascii").await;
    let database = unique_name("distlock_ascii");
    admin(
        &admin_client,
        &format!(
            "CREATE DATABASE {database} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        ),
    )
    .await;
    let url = server().url();
    let base = format!("{}/{database}", url.rsplit_once('/').unwrap().0);
    let (literal, bound) = literal_and_bound(&base, "namespace=ascii").await;
    let encoding: String = sqlx::query_scalar("SHOW server_encoding")
        .fetch_one(bound.pool())
        .await
        .unwrap();
    assert_eq!(encoding, "SQL_ASCII");
    assert_same_rows(&literal, &bound, "SQL_ASCII").await;
}

/// A waiting acquire through `lock` meets an error no retry can fix: it
/// returns it, typed as not transient and naming `code`, after one attempt.
async fn assert_permanent_at_once(lock: &Pg, code: &str, why: &str) {
    let observed = Arc::new(ObservedLock::new(lock.client.clone()));
    let waiter = LockClient::new(observed.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    let result = waiter
        .acquire(&key("k"), Duration::from_secs(30), deadline)
        .await;
    let err = match result {
        Err(e) => e,
        Ok(got) => panic!("{why}: acquired {got:?}"),
    };
    assert!(
        !err.is_transient(),
        "{why}: {code} is reported as transient ({:?}): {err}",
        err.kind()
    );
    assert!(err.to_string().contains(code), "{why}: {err}");
    assert_eq!(
        observed.attempts(),
        1,
        "{why}: the waiting acquire retried an error no retry can fix"
    );
}

#[tokio::test]
async fn a_read_only_server_ends_a_waiting_acquire_at_once() {
    let ns = unique_name("read_only");
    // The table exists: the client only runs lock statements.
    client(&ns).await;
    let lock = Pg::connect(&format!(
        "{}?namespace={ns}&options={}",
        server().url(),
        percent_encode("-c default_transaction_read_only=on")
    ))
    .await;
    assert_permanent_at_once(&lock, "25006", "a read-only transaction").await;
}

/// A client on its own table with a `BEFORE INSERT` trigger running `body`
/// (PL/pgSQL) under the function settings `set`.
async fn with_trigger(body: &str, set: &str) -> Pg {
    let ns = unique_name("trigger");
    let table = unique_name("trigger");
    let lock = Pg::connect(&format!("{}?namespace={ns}&table={table}", server().url())).await;
    let function = unique_name("broken");
    admin(
        &lock,
        &format!(
            "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql {set} AS $f$
             BEGIN {body} RETURN NEW; END $f$"
        ),
    )
    .await;
    admin(
        &lock,
        &format!(
            "CREATE TRIGGER broken BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION {function}()",
            lock.table()
        ),
    )
    .await;
    lock
}

#[tokio::test]
async fn a_missing_function_ends_a_waiting_acquire_at_once() {
    let lock = with_trigger("PERFORM distlock_no_such_function();", "").await;
    assert_permanent_at_once(&lock, "42883", "a trigger calling a missing function").await;
}

#[tokio::test]
async fn a_rejected_string_literal_ends_a_waiting_acquire_at_once() {
    let lock = with_trigger("EXECUTE $q$SELECT E'\\''$q$;", "SET backslash_quote = off").await;
    assert_permanent_at_once(&lock, "22P06", "a trigger running an unsafe string literal").await;
}
