//! The waiter lines (`distlock_waiters`): a waiting attempt joins, a grant
//! or a wait that ends leaves, a release wakes the first live waiter, and
//! nothing is left once the waits are over.
//!
//! Holders here hold for [`LONG`], and a waiter's own timer is set to the
//! holder's expiry: a waiter served within [`BOUND`] was woken by a
//! release, not by its timer.

use std::time::{Duration, Instant};

use distlock_conformance::fault::Direction;
use distlock_core::{Lease, LockError, LockKey, LockState, OwnerToken};
use distlock_postgres::{
    channel_name, PgPool, DEFAULT_SEMAPHORE_TABLE, DEFAULT_TABLE, WAITER_INDEX, WAITER_TABLE,
};
use tokio::task::JoinHandle;

use super::support::*;

/// The holders' TTL, and how long the waiters wait.
const LONG: Duration = Duration::from_secs(120);
/// Far below [`LONG`]: what a wake-up takes at most here.
const BOUND: Duration = Duration::from_secs(30);

/// A waiter line row: key, member (owner token), listener pid.
type Row = (String, String, i32);

/// A waiting call on a task of its own.
type Waiting = JoinHandle<Result<Option<Lease>, LockError>>;

/// The line rows of namespace `ns` (every key, locks and semaphores), in
/// arrival order.
async fn line(pool: &PgPool, ns: &str) -> Vec<Row> {
    sqlx::query_as(&format!(
        "SELECT key, member, pid FROM public.{WAITER_TABLE} WHERE namespace = $1 ORDER BY arrival"
    ))
    .bind(ns)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A fresh namespace whose key `k` `holder` holds for [`LONG`]; `admin`
/// reads and writes the waiter line.
struct Scene {
    ns: String,
    admin: Pg,
    holder: Pg,
    k: LockKey,
    lease: Lease,
}

impl Scene {
    /// `holder` is the one given, or a fresh client.
    async fn new(ns: String, holder: Option<Pg>) -> Self {
        let holder = match holder {
            Some(holder) => holder,
            None => client(&ns).await,
        };
        let k = key("k");
        let lease = take(&holder, &k, LONG, "free").await;
        Self {
            admin: client(&ns).await,
            ns,
            holder,
            k,
            lease,
        }
    }

    /// The line rows of the namespace.
    async fn line(&self) -> Vec<Row> {
        line(self.admin.pool(), &self.ns).await
    }

    /// Waits until the line rows are `expected` (within [`BOUND`]).
    async fn until_line(&self, expected: &[Row], why: &str) {
        let deadline = Instant::now() + BOUND;
        loop {
            let rows = self.line().await;
            if rows == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{why}: the line is {rows:?}, not {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until the line has `n` rows (within [`BOUND`]): them.
    async fn until_line_len(&self, n: usize, why: &str) -> Vec<Row> {
        let deadline = Instant::now() + BOUND;
        loop {
            let rows = self.line().await;
            if rows.len() == n {
                return rows;
            }
            assert!(Instant::now() < deadline, "{why}: the line is {rows:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `waiter` waits for `k` on a task of its own, until it is in line
    /// (the line then has `n` rows): its task and the line.
    async fn queue(&self, waiter: &Pg, n: usize, why: &str) -> (Waiting, Vec<Row>) {
        let (task_waiter, k) = (waiter.clone(), self.k.clone());
        let waiting =
            tokio::spawn(async move { task_waiter.acquire(&k, LONG, Instant::now() + LONG).await });
        let rows = self.until_line_len(n, &format!("{why} never queued")).await;
        (waiting, rows)
    }

    /// Puts `member` with listener `pid` in the line of `k`, arriving at
    /// `arrival` (SQL), as a waiting attempt would.
    async fn put_in_line(
        &self,
        db: impl sqlx::PgExecutor<'_>,
        member: &str,
        pid: i32,
        arrival: &str,
    ) {
        let line = (DEFAULT_TABLE, self.ns.as_str(), &self.k);
        put_in_line(db, line, member, pid, arrival).await;
    }

    /// The holder releases; once `waiting` of `waiter` was served, it
    /// releases too, and the line is empty.
    async fn hand_over(&self, waiting: Waiting, waiter: &Pg, why: &str) {
        self.holder.release(&self.lease).await.unwrap();
        served_then_released(waiting, waiter, why).await;
        assert!(
            self.line().await.is_empty(),
            "{why}: the line is left empty"
        );
    }
}

/// Puts `member` with listener `pid` in the line of (table, namespace,
/// key) `line`, arriving at `arrival` (SQL), as a waiting attempt would.
async fn put_in_line(
    db: impl sqlx::PgExecutor<'_>,
    line: (&str, &str, &LockKey),
    member: &str,
    pid: i32,
    arrival: &str,
) {
    let (table, ns, k) = line;
    sqlx::query(&format!(
        "INSERT INTO public.{WAITER_TABLE} (lock_table, namespace, key, member, pid, arrival)
         VALUES ($1, $2, $3, $4, $5, {arrival})"
    ))
    .bind(table)
    .bind(ns)
    .bind(k.as_str())
    .bind(member)
    .bind(pid)
    .execute(db)
    .await
    .unwrap();
}

/// Waits (within [`BOUND`]) for `waiting` to be served, then `waiter`
/// releases what it got.
async fn served_then_released(waiting: Waiting, waiter: &Pg, why: &str) {
    let lease = tokio::time::timeout(BOUND, waiting)
        .await
        .unwrap_or_else(|_| panic!("{why}: not served within {BOUND:?}"))
        .unwrap()
        .unwrap()
        .unwrap_or_else(|| panic!("{why}: gave up"));
    waiter.release(&lease).await.unwrap();
}

#[tokio::test]
async fn waits_queue_under_their_listener_pid_and_leave_nothing_behind() {
    let scene = Scene::new(unique_name("line"), None).await;
    let (first, app) = named_client(&scene.ns, "").await;
    let (first_wait, queued) = scene.queue(&first, 1, "the first waiter").await;
    let listener = backend(&scene.admin, &app, "query LIKE 'LISTEN%'").await;
    assert_eq!(queued[0].0, scene.k.as_str());
    assert_eq!(
        queued[0].2, listener,
        "the row names the waiter's listener connection"
    );
    // A second waiter queues behind, then its wait is dropped: it leaves.
    let second = client(&scene.ns).await;
    let (second_wait, both) = scene.queue(&second, 2, "the second waiter").await;
    assert_eq!(both[0], queued[0], "the first keeps its place");
    second_wait.abort();
    assert!(second_wait.await.unwrap_err().is_cancelled());
    scene.until_line(&queued, "the dropped wait left").await;
    // The first one's grant leaves the line.
    scene
        .hand_over(first_wait, &first, "the first waiter")
        .await;
}

#[tokio::test]
async fn a_dead_waiter_is_dropped_and_the_next_one_woken() {
    let scene = Scene::new(unique_name("line"), None).await;
    let waiter = client(&scene.ns).await;
    let (waiting, _) = scene.queue(&waiter, 1, "the waiter").await;
    // Ahead of it, waiters whose client is gone: no backend has their pid
    // (above any pid_max).
    for _ in 0..3 {
        let member = OwnerToken::random().to_hex();
        let an_hour_ago = "clock_timestamp() - interval '1 hour'";
        let db = scene.admin.pool();
        scene.put_in_line(db, &member, i32::MAX, an_hour_ago).await;
    }
    scene
        .hand_over(waiting, &waiter, "the live waiter behind dead ones")
        .await;
}

/// A lost listener connection: the waiter subscribes again on a new one
/// and its next attempt stores the new pid in its row, which keeps its
/// place ahead of a later waiter (the old watch's leave does not delete
/// the row of a connection that is gone).
#[tokio::test]
async fn a_waiter_whose_listener_reconnected_keeps_its_place_under_the_new_pid() {
    let scene = Scene::new(unique_name("line"), None).await;
    let (first, app) = named_client(&scene.ns, "").await;
    let second = client(&scene.ns).await;
    let (first_wait, _) = scene.queue(&first, 1, "the first waiter").await;
    let (second_wait, both) = scene.queue(&second, 2, "the second waiter").await;
    let (key, member, old) = both[0].clone();
    terminate(&scene.admin, old).await;
    let listening = format!("query LIKE 'LISTEN%' AND pid <> {old}");
    let new = backend(&scene.admin, &app, &listening).await;
    let expected = [(key, member, new), both[1].clone()];
    scene
        .until_line(&expected, "the first waiter under its new pid, first")
        .await;
    scene.holder.release(&scene.lease).await.unwrap();
    served_then_released(first_wait, &first, "the first waiter").await;
    served_then_released(second_wait, &second, "the second waiter").await;
    assert!(scene.line().await.is_empty());
}

/// A fresh namespace whose semaphore `k` (of one permit) `holder` holds
/// for [`LONG`], and `waiter` waits for a permit, on a task of its own, in
/// line: `queued` (the line rows).
struct PermitScene {
    ns: String,
    holder: Pg,
    waiter: Pg,
    k: LockKey,
    permit: Lease,
    waiting: Waiting,
    queued: Vec<Row>,
}

impl PermitScene {
    async fn new() -> Self {
        let ns = unique_name("line");
        let holder = client(&ns).await;
        let waiter = client(&ns).await;
        let k = key("k");
        let attempt = holder.try_acquire_permit(&k, 1, LONG).await.unwrap();
        let permit = attempt.lease().expect("a free permit");
        let waiting = {
            let (waiter, k) = (waiter.clone(), k.clone());
            tokio::spawn(async move {
                let deadline = Instant::now() + LONG;
                waiter.acquire_permit(&k, 1, LONG, deadline).await
            })
        };
        let deadline = Instant::now() + BOUND;
        let queued = loop {
            let rows = line(holder.pool(), &ns).await;
            if !rows.is_empty() {
                break rows;
            }
            assert!(Instant::now() < deadline, "the permit waiter never queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        Self {
            ns,
            holder,
            waiter,
            k,
            permit,
            waiting,
            queued,
        }
    }

    /// The holder releases; the waiter must be served (`why` names it),
    /// and releases, and the line is left empty.
    async fn hand_over(self, why: &str) {
        self.holder.release(&self.permit).await.unwrap();
        served_then_released(self.waiting, &self.waiter, why).await;
        assert!(line(self.holder.pool(), &self.ns).await.is_empty());
    }
}

#[tokio::test]
async fn permit_waits_queue_and_leave_nothing_behind() {
    let scene = PermitScene::new().await;
    assert_eq!(scene.queued.len(), 1);
    assert_eq!(scene.queued[0].0, scene.k.as_str());
    scene.hand_over("the permit waiter").await;
}

/// The race one statement cannot see: a waiter that joins the line while
/// a release waits for the lock's row — after the release's snapshot — is
/// not in the line that release reads. Finding nobody there, the release
/// wakes every waiter of the key, so this one is served all the same.
#[tokio::test]
async fn a_waiter_joining_while_the_release_waits_is_woken() {
    let ns = unique_name("line");
    let (holder, app) = named_client(&ns, "").await;
    let scene = Scene::new(ns, Some(holder)).await;
    let waiter = client(&scene.ns).await;
    let (waiting, queued) = scene.queue(&waiter, 1, "the waiter").await;
    let (_, member, pid) = &queued[0];
    sqlx::query(&format!(
        "DELETE FROM public.{WAITER_TABLE} WHERE namespace = $1"
    ))
    .bind(&scene.ns)
    .execute(scene.admin.pool())
    .await
    .unwrap();
    // The release takes its snapshot without the waiter's row, then waits
    // for the lock's row, while the row joins the line again.
    let mut blocker = lock_row(&scene.admin, &scene.holder, &scene.k).await;
    let release = {
        let (holder, lease) = (scene.holder.clone(), scene.lease.clone());
        tokio::spawn(async move { holder.release(&lease).await })
    };
    backend(&scene.admin, &app, "wait_event_type = 'Lock'").await;
    let now = "clock_timestamp()";
    scene.put_in_line(&mut *blocker, member, *pid, now).await;
    blocker.commit().await.unwrap();
    release.await.unwrap().unwrap();
    served_then_released(waiting, &waiter, "the waiter the release could not see").await;
    assert!(scene.line().await.is_empty());
}

/// A release wakes the first waiter on its listener's own channel (the
/// namespace's `_next` channel and the listener's backend pid: payload
/// `owner:key`), not on the shared `_next` channel, which every client's
/// listener hears (with 64 waiting clients a wake-up there woke 64
/// listeners for one); with nobody in line it notifies the key on the
/// namespace's channel, as earlier versions did, whose waiters listen
/// there.
#[tokio::test]
async fn a_release_names_its_waiter_and_otherwise_wakes_the_key() {
    let scene = Scene::new(unique_name("line"), None).await;
    let waiter = client(&scene.ns).await;
    let channel = channel_name("public", "distlock_locks", &scene.ns);
    let next = format!("{channel}_next");
    let mut heard = sqlx::postgres::PgListener::connect(&server().url())
        .await
        .unwrap();
    heard
        .listen_all([channel.as_str(), next.as_str()])
        .await
        .unwrap();
    // Nobody in line.
    scene.holder.release(&scene.lease).await.unwrap();
    let k = scene.k.as_str().to_owned();
    let n = tokio::time::timeout(BOUND, heard.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!((n.channel(), n.payload()), (channel.as_str(), k.as_str()));
    // A waiter in line.
    let lease = take(&scene.holder, &scene.k, LONG, "free").await;
    let (waiting, queued) = scene.queue(&waiter, 1, "the waiter").await;
    let own = format!("{next}_{}", queued[0].2);
    heard.listen(&own).await.unwrap();
    scene.holder.release(&lease).await.unwrap();
    let n = tokio::time::timeout(BOUND, heard.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(
        (n.channel(), n.payload()),
        (own.as_str(), format!("{}:{k}", queued[0].1).as_str())
    );
    // Nothing on the shared channel: sent in the release's transaction,
    // it would have come with the one above.
    if let Ok(n) = tokio::time::timeout(Duration::from_millis(200), heard.recv()).await {
        let n = n.unwrap();
        panic!("also heard {:?} on {}", n.payload(), n.channel());
    }
    served_then_released(waiting, &waiter, "the waiter").await;
}

/// A woken waiter that never comes keeps first place for its turn only
/// (`HANDOFF_TURN`, by the database's clock): a waiter that queued behind
/// it while its turn ran is refused until the turn is over, then its next
/// attempt drops that head and takes the key.
/// A wait's row left in the line after the wait ended, naming its
/// client's live listener: what a request of the wait whose outcome was
/// unknown leaves when the server applies it after the wait's leave (a
/// statement stalled on the server past twice the operation timeout).
const ENDED: &str = "clock_timestamp() - interval '1 hour'";

/// A release wakes a head whose wait ended (see [`ENDED`]). Its client's
/// listener, where no such waiter waits, leaves the line for it, which
/// wakes the waiter behind. Before, the line waited out the head's turn,
/// and the waiter behind, never woken, its timer (the holder's expiry).
#[tokio::test]
async fn a_wake_up_for_a_wait_that_ended_is_passed_on() {
    let scene = Scene::new(unique_name("line"), None).await;
    let waiter = client(&scene.ns).await;
    let (waiting, queued) = scene.queue(&waiter, 1, "the waiter").await;
    let ended = OwnerToken::random().to_hex();
    let db = scene.admin.pool();
    scene.put_in_line(db, &ended, queued[0].2, ENDED).await;
    scene
        .hand_over(
            waiting,
            &waiter,
            "the waiter behind a head whose wait ended",
        )
        .await;
}

/// As [`a_wake_up_for_a_wait_that_ended_is_passed_on`], on a semaphore:
/// its release takes the woken waiter off the line, so the wake-up was
/// lost, and the waiter behind waited for its timer (the permit's expiry).
#[tokio::test]
async fn a_permit_wake_up_for_a_wait_that_ended_is_passed_on() {
    let scene = PermitScene::new().await;
    let ended = OwnerToken::random().to_hex();
    let line_of_k = (DEFAULT_SEMAPHORE_TABLE, scene.ns.as_str(), &scene.k);
    let db = scene.holder.pool();
    put_in_line(db, line_of_k, &ended, scene.queued[0].2, ENDED).await;
    scene
        .hand_over("the permit waiter behind a wait that ended")
        .await;
}

#[tokio::test]
async fn a_woken_waiter_that_never_comes_loses_its_turn() {
    use sqlx::Connection;
    let scene = Scene::new(unique_name("line"), None).await;
    // The head: a member whose listener lives (a connection of this test's
    // own, which never asks for the key), arrived before everyone.
    let mut silent = sqlx::postgres::PgConnection::connect(&server().url())
        .await
        .unwrap();
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut silent)
        .await
        .unwrap();
    let head = OwnerToken::random().to_hex();
    let an_hour_ago = "clock_timestamp() - interval '1 hour'";
    let db = scene.admin.pool();
    scene.put_in_line(db, &head, pid, an_hour_ago).await;
    // The release wakes it and keeps it at the head with its turn.
    scene.holder.release(&scene.lease).await.unwrap();
    let turn_query = format!(
        "SELECT floor(extract(epoch FROM turn_until) * 1000000)::bigint
         FROM public.{WAITER_TABLE} WHERE namespace = $1 AND member = $2"
    );
    let (turn_until,): (Option<i64>,) = sqlx::query_as(&turn_query)
        .bind(&scene.ns)
        .bind(&head)
        .fetch_one(db)
        .await
        .unwrap();
    let turn_until = turn_until.expect("the woken head has a turn");
    // Nobody else takes the key: a waiter that comes now queues behind it.
    let waiter = client(&scene.ns).await;
    let (waiting, queued) = scene.queue(&waiter, 2, "the next waiter").await;
    assert_eq!(queued[0].1, head, "the woken head keeps first place");
    // Its retry, at the end of the turn, takes the key.
    let lease = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the next waiter served once the turn was over")
        .unwrap()
        .unwrap()
        .expect("the next waiter gave up");
    // Fencing tokens follow the database's clock (microseconds): the
    // grant came after the turn's end.
    let token = i64::try_from(lease.fencing_token().get()).unwrap();
    assert!(
        token >= turn_until,
        "granted ({token}) before the head's turn ended ({turn_until})"
    );
    assert!(
        scene.line().await.is_empty(),
        "the head whose turn was over is dropped, the served waiter left"
    );
    waiter.release(&lease).await.unwrap();
    drop(silent);
}

/// A wait is dropped while its attempt waits on the server for the key's
/// row (and the client's settling attempt behind it). Its leave must
/// follow the attempt: sent before the attempt committed, it reads the line
/// without the attempt's row (its snapshot is older) and leaves the row of
/// a live listener behind, a head that every later release wakes and
/// whose turn (5 s) the line then waits out.
#[tokio::test]
async fn a_wait_dropped_while_its_attempt_runs_leaves_no_row_behind() {
    let ns = unique_name("leftlate");
    let scene = Scene::new(ns.clone(), None).await;
    let (waiter, app) = named_client(&ns, "").await;
    let blocker = lock_row(&scene.admin, &scene.holder, &scene.k).await;
    let (task_waiter, k) = (waiter.clone(), scene.k.clone());
    let waiting =
        tokio::spawn(async move { task_waiter.acquire(&k, LONG, Instant::now() + LONG).await });
    let blocked = "wait_event_type = 'Lock'";
    backend(&scene.admin, &app, blocked).await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    // The settling attempt blocks on the row too, and a leave sent too
    // early would; give them a second to get there.
    let deadline = Instant::now() + Duration::from_secs(1);
    while backends(&scene.admin, &app, blocked).await.len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    blocker.commit().await.unwrap();
    scene
        .until_line(&[], "the dropped wait left the line")
        .await;
    scene.holder.release(&scene.lease).await.unwrap();
    take(
        &waiter,
        &scene.k,
        LONG,
        "free after the release, nobody in line",
    )
    .await;
}

/// A waiter table of an earlier version (no `turn_until`) gets the turn
/// column when a client starts, and its lines hand the key over fairly.
#[tokio::test]
async fn a_waiter_table_of_the_previous_version_gets_the_turn_column() {
    let admin_client = client("line-admin").await;
    let schema = unique_name("old_line");
    admin(&admin_client, &format!("CREATE SCHEMA {schema}")).await;
    // The table as it was: this version's, without the column.
    for sql in [
        format!("CREATE TABLE {schema}.{WAITER_TABLE} (LIKE public.{WAITER_TABLE} INCLUDING ALL)"),
        format!("ALTER TABLE {schema}.{WAITER_TABLE} DROP COLUMN turn_until"),
    ] {
        admin(&admin_client, &sql).await;
    }
    let lock = Pg::connect(&format!("{}?schema={schema}&namespace=old", server().url())).await;
    let (added,): (bool,) = sqlx::query_as(
        "SELECT count(*) = 1 FROM pg_attribute
         WHERE attrelid = to_regclass($1) AND NOT attisdropped AND attname = 'turn_until'",
    )
    .bind(format!("{schema}.{WAITER_TABLE}"))
    .fetch_one(admin_client.pool())
    .await
    .unwrap();
    assert!(added, "turn_until added");
    let capabilities = distlock_core::LockBackend::capabilities(&*lock.backend);
    assert!(capabilities.wakes_one_waiter && capabilities.fair_handoff);
}

/// The definition of index `index` in `schema` and whether it is valid,
/// if there is one.
async fn index_of(pool: &PgPool, schema: &str, index: &str) -> Option<(String, bool)> {
    sqlx::query_as(
        "SELECT pg_catalog.pg_get_indexdef(i.indexrelid), i.indisvalid FROM pg_catalog.pg_index AS i
         WHERE i.indexrelid = pg_catalog.to_regclass(quote_ident($1) || '.' || quote_ident($2))",
    )
    .bind(schema)
    .bind(index)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// The waiter table has an index by arrival, so a statement reads a line's
/// first waiters, not every waiter of the key: a new table gets it with
/// the table, and a table of an earlier version (without it) when a
/// client starts.
#[tokio::test]
async fn the_waiter_table_gets_its_index_by_arrival() {
    let admin_client = client("line-admin").await;
    let (fresh, old) = (unique_name("new_line"), unique_name("old_line"));
    admin(&admin_client, &format!("CREATE SCHEMA {old}")).await;
    // The table as earlier versions created it: no index but its key.
    admin(
        &admin_client,
        &format!(
            "CREATE TABLE {old}.{WAITER_TABLE} (lock_table text NOT NULL, namespace text NOT NULL,
                 key text NOT NULL, member text NOT NULL, pid integer NOT NULL,
                 arrival timestamptz NOT NULL, turn_until timestamptz,
                 PRIMARY KEY (lock_table, namespace, key, member))"
        ),
    )
    .await;
    for schema in [&fresh, &old] {
        let _lock = Pg::connect(&format!("{}?schema={schema}&namespace=ix", server().url())).await;
        let (index, _) = index_of(admin_client.pool(), schema, WAITER_INDEX)
            .await
            .unwrap_or_else(|| panic!("no index {WAITER_INDEX} in schema {schema}"));
        assert!(
            index.contains("(lock_table, namespace, key, arrival, member)"),
            "{index}"
        );
    }
}

/// A `CREATE INDEX CONCURRENTLY` that fails or is cancelled (the
/// operation timeout cancels it) leaves its index in the catalog marked
/// invalid: kept up to date, never read. A client that starts finds it
/// invalid with no build working on it, drops it and builds it again;
/// its name alone does not pass for done.
#[tokio::test]
async fn an_index_a_failed_build_left_invalid_is_built_again() {
    let admin_client = client("index-admin").await;
    let schema = unique_name("invalid_ix");
    let url = format!("{}?schema={schema}&namespace=ix", server().url());
    drop(Pg::connect(&url).await);
    let indexes = [WAITER_INDEX.to_owned(), format!("{DEFAULT_TABLE}_fencing")];
    let pool = admin_client.pool();
    for index in &indexes {
        assert_eq!(
            index_of(pool, &schema, index).await.map(|(_, valid)| valid),
            Some(true),
            "{index} after the first start"
        );
        // As a failed concurrent build leaves it.
        admin(
            &admin_client,
            &format!(
                "UPDATE pg_catalog.pg_index SET indisvalid = false
                 WHERE indexrelid = '{schema}.{index}'::regclass"
            ),
        )
        .await;
    }
    let _lock = Pg::connect(&url).await;
    for index in &indexes {
        assert_eq!(
            index_of(pool, &schema, index).await.map(|(_, valid)| valid),
            Some(true),
            "{index} was left invalid by the next client's start"
        );
    }
}

/// How many waiters the statements examine at the head of a line (the
/// crate's `EXAMINED`).
const EXAMINED: u64 = 8;

/// The line of [`a_handoff_reads_the_head_of_a_long_line_not_all_of_it`]:
/// the crowd on one key. (A table of a page or so the planner
/// reads whole rather than look one row up in an index, which is as cheap
/// there: with 64 waiters each statement reads the table's 72 rows.)
const LONG_LINE: u32 = 256;

/// The rows of the waiter table the statement whose plan is `plan` read:
/// the rows each scan of it returned and those its filters removed, times
/// the scan's loops (the text of `EXPLAIN (ANALYZE, COSTS OFF, TIMING
/// OFF, SUMMARY OFF)`).
fn waiter_rows_read(plan: &[String]) -> u64 {
    let number_after = |line: &str, label: &str| -> u64 {
        line.split(label)
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {label} in {line:?}"))
    };
    let mut total = 0;
    // The loops of the waiter-table scan whose detail lines follow.
    let mut scan_loops = None;
    for line in plan {
        if line.contains("(actual rows=") || line.contains("(never executed)") {
            scan_loops = None;
            if line.contains(&format!(" on {WAITER_TABLE} "))
                && line.contains("Scan")
                && line.contains("(actual rows=")
            {
                let loops = number_after(line, "loops=");
                total += number_after(line, "rows=") * loops;
                scan_loops = Some(loops);
            }
        } else if let Some(loops) = scan_loops {
            let detail = line.trim();
            if detail.starts_with("Rows Removed by Filter:")
                || detail.starts_with("Rows Removed by Index Recheck:")
            {
                total += number_after(detail, ": ") * loops;
            }
        }
    }
    total
}

/// A handoff's statements read the first waiters of the line and the rows
/// they write, not every waiter of the key. With 256 in line, statistics
/// taken and generic plans (what a long-lived connection ends up with),
/// the release, a newcomer's refused attempt and the woken head's grant
/// each read at most 3 x 8 rows of the waiter table. Before, the refused
/// attempt (on the free key, the head's turn running) and the grant each
/// read all of them: dropping the dead waiters among the examined ones ran
/// whether there were any or not, and matched them by member, for which
/// the planner scanned the whole table.
#[tokio::test]
async fn a_handoff_reads_the_head_of_a_long_line_not_all_of_it() {
    let scene = Scene::new(unique_name("longline"), None).await;
    let pool = scene.admin.pool();
    // A process that stays: the waiters it names are alive.
    let pid: i32 =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
            .fetch_one(pool)
            .await
            .unwrap();
    let members: Vec<String> = (1..=LONG_LINE).map(|i| format!("{i:032x}")).collect();
    for (i, member) in members.iter().enumerate() {
        let arrival = format!("'2000-01-01'::timestamptz + interval '{i} seconds'");
        scene.put_in_line(pool, member, pid, &arrival).await;
    }
    sqlx::query(&format!("ANALYZE public.{WAITER_TABLE}"))
        .execute(pool)
        .await
        .unwrap();
    let (owner, fencing, _) = row(&scene.holder, &scene.k).await.unwrap();
    let owner = owner.unwrap();

    let texts = distlock_postgres::StatementTexts::new("public", DEFAULT_TABLE);
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(&format!(
        "SET plan_cache_mode = force_generic_plan;
         PREPARE dl_release (text, text, text, bigint, text, bigint, text, text, text) AS {};
         PREPARE dl_acquire (text, text, text, bigint, bigint, text, integer, text, text) AS {}",
        texts.release, texts.acquire
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    let (ns, k) = (&scene.ns, scene.k.as_str());
    let statements = [
        (
            "the holder's release",
            format!("dl_release('{ns}', '{k}', '{owner}', {fencing}, 'dl_all', 1, '{DEFAULT_TABLE}', 'dl_next', 'dl_holder')"),
        ),
        (
            "a newcomer's refused attempt",
            format!("dl_acquire('{ns}', '{k}', '{:032x}', 10000, 1, '{DEFAULT_TABLE}', {pid}, '', 'dl_holder')", u128::MAX),
        ),
        (
            "the woken head's grant",
            format!("dl_acquire('{ns}', '{k}', '{}', 10000, 1, '{DEFAULT_TABLE}', {pid}, '', 'dl_holder')", members[0]),
        ),
    ];
    let mut too_many = Vec::new();
    for (what, execute) in statements {
        let plan: Vec<String> = sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) EXECUTE {execute}"
        ))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        let read = waiter_rows_read(&plan);
        if read > 3 * EXAMINED {
            too_many.push(format!("{what} read {read} rows:\n{}", plan.join("\n")));
        }
    }
    assert!(
        too_many.is_empty(),
        "for a line of {LONG_LINE}:\n{}",
        too_many.join("\n\n")
    );
    // They did what they were for: the head holds the lock and left the
    // line, the newcomer joined its end.
    let (now_owner, _, _) = row(&scene.holder, &scene.k).await.unwrap();
    assert_eq!(now_owner.as_deref(), Some(members[0].as_str()));
    let rows = scene.line().await;
    assert_eq!(
        rows.len(),
        members.len(),
        "the rest and the newcomer: {rows:?}"
    );
    assert_eq!(rows[0].1, members[1]);
    assert_eq!(rows.last().unwrap().1, format!("{:032x}", u128::MAX));
    sqlx::query(&format!(
        "DELETE FROM public.{WAITER_TABLE} WHERE namespace = $1"
    ))
    .bind(ns)
    .execute(pool)
    .await
    .unwrap();
}

/// A refused attempt that waited for the lock row while a grant to someone
/// else committed answers that grant: its holder and its expiry. Its
/// snapshot predates the grant, and showed the lock as released: read
/// from there, the answer was an expired lock of the old holder, and the
/// refused attempt was sent again at once.
#[tokio::test]
async fn a_refusal_that_waited_for_a_grant_answers_the_new_holder() {
    let scene = Scene::new(unique_name("waitedgrant"), None).await;
    scene.holder.release(&scene.lease).await.unwrap();
    let (ns, k) = (scene.ns.clone(), scene.k.as_str().to_owned());
    let pool = scene.admin.pool();
    let new_holder = format!("{:032x}", 7u128 << 64);
    let newcomer = format!("{:032x}", 9u128 << 64);

    // A grant in flight: the row written and locked, not committed.
    let mut grant = pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE public.{DEFAULT_TABLE} SET owner = $3, fencing = fencing + 1,
                expires_at = clock_timestamp() + interval '60 seconds'
         WHERE namespace = $1 AND key = $2"
    ))
    .bind(&ns)
    .bind(&k)
    .bind(&new_holder)
    .execute(&mut *grant)
    .await
    .unwrap();

    // The newcomer's attempt takes its snapshot, then waits for the row.
    let mut attempt_conn = pool.acquire().await.unwrap();
    let attempt_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *attempt_conn)
        .await
        .unwrap();
    let acquire = distlock_postgres::StatementTexts::new("public", DEFAULT_TABLE).acquire;
    let (task_ns, task_k, task_newcomer) = (ns.clone(), k.clone(), newcomer.clone());
    let attempt = tokio::spawn(async move {
        use sqlx::Row as _;
        let row = sqlx::query(&acquire)
            .bind(&task_ns)
            .bind(&task_k)
            .bind(&task_newcomer)
            .bind(10_000i64)
            .bind(1i64)
            .bind(DEFAULT_TABLE)
            .bind(0i32)
            .bind("")
            .bind("dl_holder")
            .fetch_one(&mut *attempt_conn)
            .await
            .unwrap();
        let answer: (bool, Option<String>, Option<i64>) = (
            row.get("acquired"),
            row.get("owner"),
            row.get("expires_in_ms"),
        );
        answer
    });
    let deadline = Instant::now() + BOUND;
    loop {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(attempt_pid)
                .fetch_one(pool)
                .await
                .unwrap();
        if waiting.as_deref() == Some("Lock") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the attempt never waited for the row"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    grant.commit().await.unwrap();

    let (acquired, owner, expires_in_ms) = tokio::time::timeout(BOUND, attempt)
        .await
        .expect("the attempt never returned")
        .unwrap();
    assert!(!acquired, "the key was granted to someone else");
    assert_eq!(owner.as_deref(), Some(new_holder.as_str()));
    let expires_in_ms = expires_in_ms.unwrap();
    assert!(
        expires_in_ms > 30_000,
        "the refusal answers the new holder's 60 s, not {expires_in_ms} ms"
    );
}

/// The statement a backend of `app` runs while it waits for a row lock.
async fn waiting_statement(admin: &Pg, app: &str) -> String {
    let pid = backend(admin, app, "wait_event_type = 'Lock'").await;
    sqlx::query_scalar("SELECT query FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(admin.pool())
        .await
        .unwrap()
}

/// The start of the statement that only joins a held lock's line: a
/// waiter's first attempt sends it while another waiter of its client is
/// in line (in a crowd of one process, the holder that released and asks
/// again), instead of the full acquire, which costs the server several
/// times as much to set up and is refused there nearly always.
const JOIN_HELD: &str = "WITH held AS MATERIALIZED";

/// `waiter` (named `app`) waits for the scene's key on a task of its own
/// while its first waiter is in line: its first attempt runs into a lock
/// of the key's row (taken here) and must be the short join. Returns the
/// first waiter's task and row, the second's task, and the row lock.
async fn second_waiter_stalled(
    scene: &Scene,
    waiter: &Pg,
    app: &str,
) -> (
    Waiting,
    Row,
    Waiting,
    sqlx::Transaction<'static, sqlx::Postgres>,
) {
    let (first, rows) = scene.queue(waiter, 1, "the first waiter").await;
    let blocker = lock_row(&scene.admin, &scene.holder, &scene.k).await;
    let (task_waiter, k) = (waiter.clone(), scene.k.clone());
    let second =
        tokio::spawn(async move { task_waiter.acquire(&k, LONG, Instant::now() + LONG).await });
    let statement = waiting_statement(&scene.admin, app).await;
    assert!(
        statement.trim_start().starts_with(JOIN_HELD),
        "the second waiter's first attempt is the short join, not: {}",
        start_of(&statement)
    );
    (first, rows[0].clone(), second, blocker)
}

#[tokio::test]
async fn a_second_waiter_of_a_client_joins_a_held_locks_line_behind_the_first() {
    let ns = unique_name("joinheld");
    let scene = Scene::new(ns.clone(), None).await;
    let (waiter, app) = named_client(&ns, "").await;
    let (first, first_row, second, blocker) = second_waiter_stalled(&scene, &waiter, &app).await;
    blocker.commit().await.unwrap();
    let rows = scene.until_line_len(2, "the second waiter joined").await;
    assert_eq!(rows[0], first_row, "the first waiter keeps the head");
    assert_eq!(rows[1].2, first_row.2, "under the same listener pid");
    // Served in order, each woken by the release before it.
    scene.holder.release(&scene.lease).await.unwrap();
    served_then_released(first, &waiter, "the first waiter").await;
    served_then_released(second, &waiter, "the second waiter").await;
    assert!(scene.line().await.is_empty());
}

/// The lock expires while the short join waits for its row: the join finds
/// nothing to queue behind and the full attempt follows. It finds the key
/// free on the first waiter's turn and wakes it (nothing else would: no
/// release notified anyone), then waits for its own.
#[tokio::test]
async fn a_second_waiter_whose_join_finds_the_lock_expired_sends_the_full_attempt() {
    let ns = unique_name("joinfree");
    let scene = Scene::new(ns.clone(), None).await;
    let (waiter, app) = named_client(&ns, "").await;
    let (first, _, second, mut blocker) = second_waiter_stalled(&scene, &waiter, &app).await;
    sqlx::query(&format!(
        "UPDATE {} SET expires_at = clock_timestamp() - interval '1 second'
         WHERE namespace = $1 AND key = $2",
        scene.holder.table()
    ))
    .bind(&scene.ns)
    .bind(scene.k.as_str())
    .execute(&mut *blocker)
    .await
    .unwrap();
    blocker.commit().await.unwrap();
    served_then_released(
        first,
        &waiter,
        "the first waiter, woken by the full attempt",
    )
    .await;
    served_then_released(second, &waiter, "the second waiter").await;
    assert!(scene.line().await.is_empty());
}

/// The short join is applied but its connection is lost before the reply:
/// the client sends it again under the same owner token (one row in line,
/// not two), and the waits are served in order.
#[tokio::test]
async fn a_join_applied_whose_reply_was_lost_is_sent_again_under_the_same_owner() {
    let ns = unique_name("joinlost");
    let scene = Scene::new(ns.clone(), None).await;
    let (proxy, proxied) = proxied().await;
    let app = unique_name("app");
    // The listener connects directly: only the statements' connection is cut.
    let waiter = Pg::connect(&format!(
        "{proxied}?namespace={ns}&application_name={app}&listen_url={}",
        distlock_conformance::url::percent_encode(&server().url())
    ))
    .await;
    let (first, first_row, second, blocker) = second_waiter_stalled(&scene, &waiter, &app).await;
    proxy.hold(Direction::ToClient);
    blocker.commit().await.unwrap();
    let deadline = Instant::now() + BOUND;
    let applied = loop {
        let rows = scene.line().await;
        if rows.len() == 2 {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "the join was never applied: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let cut_at: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(scene.admin.pool())
        .await
        .unwrap();
    proxy.drop_all();
    proxy.pass(Direction::ToClient);
    // Sent again on a new connection, which then idles with it as its last
    // statement.
    let resent = format!(
        "state = 'idle' AND backend_start > to_timestamp({cut_at}) AND query LIKE '{JOIN_HELD}%'"
    );
    backend(&scene.admin, &app, &resent).await;
    let rows = scene.line().await;
    assert_eq!(
        rows, applied,
        "sent again under the same owner, it joined once"
    );
    assert_eq!(rows[0], first_row);
    scene.holder.release(&scene.lease).await.unwrap();
    served_then_released(first, &waiter, "the first waiter").await;
    served_then_released(second, &waiter, "the second waiter").await;
    assert!(scene.line().await.is_empty());
}

/// A client whose release handed the key to a waiter of another client
/// (a crowd of many processes: the holder that asks again) sends the short
/// join first when it waits for the key again.
#[tokio::test]
async fn a_holder_whose_release_woke_a_waiter_joins_the_line_with_the_short_statement() {
    let ns = unique_name("joinagain");
    let (holder, app) = named_client(&ns, "").await;
    let scene = Scene::new(ns.clone(), Some(holder)).await;
    let other = client(&ns).await;
    let (waiting, _) = scene.queue(&other, 1, "the other client's waiter").await;
    scene.holder.release(&scene.lease).await.unwrap();
    let lease = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the waiter was woken")
        .unwrap()
        .unwrap()
        .expect("served");
    let blocker = lock_row(&scene.admin, &scene.holder, &scene.k).await;
    let (task_holder, k) = (scene.holder.clone(), scene.k.clone());
    let again =
        tokio::spawn(async move { task_holder.acquire(&k, LONG, Instant::now() + LONG).await });
    let statement = waiting_statement(&scene.admin, &app).await;
    assert!(
        statement.trim_start().starts_with(JOIN_HELD),
        "the holder's new wait starts with the short join, not: {}",
        start_of(&statement)
    );
    blocker.commit().await.unwrap();
    scene.until_line_len(1, "the holder queued again").await;
    other.release(&lease).await.unwrap();
    served_then_released(again, &scene.holder, "the holder's new wait").await;
    assert!(scene.line().await.is_empty());
}

/// The start of the woken head's grant on its turn, sent before the full
/// acquire by a wait already in line.
const TAKE_TURN: &str = "WITH turn AS MATERIALIZED";

/// A schema of its own whose waiter table records the statement that
/// deletes each of its rows, a holder of key `k` with `ttl`, and a waiter
/// queued behind it on a task of its own.
struct Recorded {
    admin: Pg,
    schema: String,
    waiter: Pg,
    holder: Pg,
    lease: Lease,
    waiting: Waiting,
}

impl Recorded {
    async fn new(ttl: Duration) -> Self {
        let admin_client = client("turn_admin").await;
        let schema = unique_name("turn");
        admin(&admin_client, &format!("CREATE SCHEMA {schema}")).await;
        let url = format!("{}?schema={schema}&namespace=turn", server().url());
        let (holder, waiter) = (Pg::connect(&url).await, Pg::connect(&url).await);
        for sql in [
            format!("CREATE TABLE {schema}.left (query text NOT NULL)"),
            format!(
                "CREATE FUNCTION {schema}.record_left() RETURNS trigger LANGUAGE plpgsql AS $f$
                 BEGIN INSERT INTO {schema}.left VALUES (current_query()); RETURN OLD; END $f$"
            ),
            format!(
                "CREATE TRIGGER record_left BEFORE DELETE ON {schema}.{WAITER_TABLE}
                 FOR EACH ROW EXECUTE FUNCTION {schema}.record_left()"
            ),
        ] {
            admin(&admin_client, &sql).await;
        }
        let k = key("k");
        let lease = take(&holder, &k, ttl, "free").await;
        let (task_waiter, task_k) = (waiter.clone(), k.clone());
        let waiting = tokio::spawn(async move {
            task_waiter
                .acquire(&task_k, LONG, Instant::now() + LONG)
                .await
        });
        let scene = Self {
            admin: admin_client,
            schema,
            waiter,
            holder,
            lease,
            waiting,
        };
        let deadline = Instant::now() + BOUND;
        while scene.in_line().await == 0 {
            assert!(Instant::now() < deadline, "the waiter never queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        scene
    }

    async fn in_line(&self) -> i64 {
        in_schema_line(&self.admin, &self.schema).await
    }

    /// Once the waiter was served (and released), the statement that took
    /// it out of the line, which it left once.
    async fn served_then_left_with(self, why: &str) -> String {
        let Self {
            admin,
            schema,
            waiter,
            waiting,
            ..
        } = self;
        served_then_released(waiting, &waiter, why).await;
        assert_eq!(in_schema_line(&admin, &schema).await, 0);
        let mut left: Vec<String> = sqlx::query_scalar(&format!("SELECT query FROM {schema}.left"))
            .fetch_all(admin.pool())
            .await
            .unwrap();
        assert_eq!(left.len(), 1, "{why}: it left the line once: {left:?}");
        left.remove(0)
    }
}

/// How many rows the waiter table of `schema` has.
async fn in_schema_line(admin: &Pg, schema: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.{WAITER_TABLE}"))
        .fetch_one(admin.pool())
        .await
        .unwrap()
}

/// The start of a text, to show in a message.
fn start_of(text: &str) -> &str {
    &text[..text.len().min(200)]
}

/// A waiter woken at the head of the line takes the key on its turn with
/// the short grant, not the full acquire, which sets up every step of
/// judging the line (dropping dead waiters, waking a head) for a grant
/// the turn already settles.
#[tokio::test]
async fn a_woken_head_takes_its_turn_with_the_short_grant() {
    let scene = Recorded::new(LONG).await;
    scene.holder.release(&scene.lease).await.unwrap();
    let left = scene.served_then_left_with("the woken head").await;
    assert!(
        left.trim_start().starts_with(TAKE_TURN),
        "the head left the line with the short grant, not: {}",
        start_of(&left)
    );
}

/// A waiter in line without a turn (its holder expired: no release woke
/// anyone, and its timer's retry comes first) finds no turn to take; the
/// full attempt follows and grants it the free key as the line's head.
#[tokio::test]
async fn a_waiter_in_line_without_a_turn_is_granted_by_the_full_attempt() {
    // Short, so that the waiter's timer (the holder's expiry) comes soon.
    let scene = Recorded::new(Duration::from_secs(1)).await;
    let left = scene
        .served_then_left_with("the waiter, at the holder's expiry")
        .await;
    assert!(
        left.trim_start().starts_with("WITH clock AS MATERIALIZED"),
        "the full acquire granted it: {}",
        start_of(&left)
    );
}

/// The woken head's grant on its turn is applied but its connection is
/// lost before the reply: sent again, it finds the key held by its own
/// owner, and the full attempt that follows adopts it (same fencing token,
/// nothing granted twice, the line left once).
#[tokio::test]
async fn a_turn_taken_whose_reply_was_lost_is_adopted_under_the_same_owner() {
    let ns = unique_name("turnlost");
    let scene = Scene::new(ns.clone(), None).await;
    // Statements and the listener each through a proxy of their own.
    let (notifications, listener_url) = proxied().await;
    let (statements, proxied) = proxied().await;
    let app = unique_name("app");
    let waiter = Pg::connect(&format!(
        "{proxied}?namespace={ns}&application_name={app}&listen_url={}",
        distlock_conformance::url::percent_encode(&listener_url)
    ))
    .await;
    let (waiting, queued) = scene.queue(&waiter, 1, "the waiter").await;
    let member = queued[0].1.clone();
    // The release gives the waiter its turn; its wake-up is held back
    // until the waiter's row is locked, so that its grant, once sent,
    // waits for that row (leaving the line) after it took the key.
    notifications.hold(Direction::ToClient);
    scene.holder.release(&scene.lease).await.unwrap();
    let mut blocker = scene.admin.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM public.{WAITER_TABLE} WHERE namespace = $1 AND member = $2 FOR UPDATE"
    ))
    .bind(&ns)
    .bind(&member)
    .execute(&mut *blocker)
    .await
    .unwrap();
    notifications.pass(Direction::ToClient);
    let statement = waiting_statement(&scene.admin, &app).await;
    assert!(
        statement.trim_start().starts_with(TAKE_TURN),
        "the woken head's grant on its turn: {}",
        start_of(&statement)
    );
    statements.hold(Direction::ToClient);
    blocker.commit().await.unwrap();
    let row = format!(
        "SELECT fencing FROM {} WHERE namespace = $1 AND key = $2 AND owner = $3
           AND expires_at > clock_timestamp()",
        scene.holder.table()
    );
    let deadline = Instant::now() + BOUND;
    let fencing: i64 = loop {
        let taken: Option<i64> = sqlx::query_scalar(&row)
            .bind(&ns)
            .bind(scene.k.as_str())
            .bind(&member)
            .fetch_optional(scene.admin.pool())
            .await
            .unwrap();
        if let Some(fencing) = taken {
            break fencing;
        }
        assert!(Instant::now() < deadline, "the grant was never applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    statements.drop_all();
    statements.pass(Direction::ToClient);
    let lease = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("served")
        .unwrap()
        .unwrap()
        .expect("granted");
    assert_eq!(
        lease.fencing_token().get(),
        fencing as u64,
        "the grant it was sent again for, adopted"
    );
    assert!(scene.line().await.is_empty(), "it left the line");
    waiter.release(&lease).await.unwrap();
    assert_eq!(
        scene.holder.inspect(&scene.k).await.unwrap(),
        LockState::Free
    );
}
