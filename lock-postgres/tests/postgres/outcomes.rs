//! Requests whose outcome is unknown: a reply held back while the server
//! applies the request, a connection cut under a statement, a caller that
//! left. The server may apply such a request later than its client gave up
//! on it; nothing may then be left held by nobody, and no call may outlast
//! its operation timeout counted from its first send.

use std::time::{Duration, Instant};

use distlock_conformance::fault::{Direction, Proxy};
use distlock_core::{
    AcquireReply, AcquireRequest, ErrorKind, Grant, HeldLock, Lease, LockBackend, LockError,
    LockKey, LockState, OwnerToken, PermitReply, PermitRequest, ReleaseReply, ReleaseWatch,
    SemaphoreBackend,
};
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;

use super::support::*;

fn request(k: &LockKey, owner: OwnerToken, ttl: Duration) -> AcquireRequest<'_> {
    AcquireRequest {
        key: k,
        owner,
        ttl,
        renewing: false,
        settling: false,
        holder: None,
    }
}

fn granted(reply: AcquireReply, why: &str) -> Grant {
    match reply {
        AcquireReply::Granted(grant) => grant,
        held => panic!("{why}: {held:?}"),
    }
}

/// `lock`'s backend acquires `k` for `owner` (not settling) on a task of
/// its own.
fn spawn_acquire(
    lock: &Pg,
    k: &LockKey,
    owner: OwnerToken,
    ttl: Duration,
) -> JoinHandle<Result<AcquireReply, LockError>> {
    let (lock, k) = (lock.clone(), k.clone());
    tokio::spawn(async move { lock.backend.acquire(request(&k, owner, ttl)).await })
}

/// `owner`'s wait on `k` registered with `lock`'s backend (its attempts
/// join the line from now on).
async fn watch(lock: &Pg, k: &LockKey, owner: OwnerToken) -> ReleaseWatch {
    lock.backend
        .watch(k, owner)
        .await
        .unwrap()
        .expect("a client with a listener watches")
}

/// Releases, through `lock`'s backend, the lock `grant` gave `owner` on `k`.
async fn release_grant(lock: &Pg, k: &LockKey, owner: OwnerToken, grant: &Grant) -> ReleaseReply {
    lock.backend
        .release(HeldLock {
            key: k,
            owner,
            fencing: grant.fencing,
            handle: grant.handle,
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn an_attempt_whose_reply_was_lost_is_adopted_by_the_next_with_its_owner_token() {
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("adopt");
    // One connection, whose acquire statement is prepared before replies
    // are held (preparing it takes a round trip of its own).
    let late = one_connection(&proxied, &ns).await;
    let direct = client(&ns).await;
    let warm = take(&late, &key("warm-up"), Duration::from_secs(5), "free").await;
    late.release(&warm).await.unwrap();
    // sqlx checks a connection given back to the pool with a round trip of
    // its own: hold replies only once that is done.
    settled(&late).await;
    let k = key("adopted");
    let owner = OwnerToken::random();

    // The first attempt reaches the server and takes the lock; its reply
    // is held back past the operation timeout.
    proxy.hold(Direction::ToClient);
    let first = late
        .backend
        .acquire(request(&k, owner, Duration::from_secs(20)))
        .await;
    let err = first.expect_err("the reply was held back");
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    let (holder, fencing, left) = row(&direct, &k)
        .await
        .expect("the first attempt wrote its row");
    assert_eq!(holder, Some(owner.to_hex()), "taken by the first attempt");
    assert!(left > 0 && left <= 20_000, "{left} ms left");

    // The next attempt with the same owner token gets that lock: the same
    // fencing token, its expiry reset to the new TTL by the database clock.
    let grant = granted(
        direct
            .backend
            .acquire(request(&k, owner, Duration::from_secs(120)))
            .await
            .unwrap(),
        "a lock held by the request's own owner token was not adopted",
    );
    assert_eq!(grant.fencing.get(), fencing as u64, "a new fencing token");
    let (holder, now_fencing, left) = row(&direct, &k).await.unwrap();
    assert_eq!(
        (holder, now_fencing),
        (Some(owner.to_hex()), fencing),
        "the adopted row changed hands"
    );
    assert!(
        left > 20_000,
        "the adopting attempt did not reset the expiry to its TTL: {left} ms left"
    );

    // The first attempt's reply arrives late, after its caller gave up on
    // it: whatever its client does then must leave the adopted lock alone.
    proxy.pass(Direction::ToClient);
    settled(&late).await;
    let (holder, now_fencing, left) = row(&direct, &k).await.unwrap();
    assert_eq!(
        (holder, now_fencing),
        (Some(owner.to_hex()), fencing),
        "the timed-out attempt's client undid the lock the next attempt adopted"
    );
    assert!(
        left > 20_000,
        "the timed-out attempt's client gave up the lock the next attempt adopted: {left} ms left"
    );
    assert_eq!(
        release_grant(&direct, &k, owner, &grant).await,
        ReleaseReply::Released
    );
}

#[tokio::test]
async fn a_first_send_applied_after_the_give_back_leaves_nothing_held() {
    // The first send of an acquire stalls on the server (a trigger waits on
    // an advisory lock the test holds) and its connection is cut, so the
    // client sends the statement again on another one. That second send
    // takes the lock, its caller leaves, and the lock is given back. Only
    // then does the first send go on: it must not take the lock again for
    // nobody.
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("late_first");
    let (lock, direct, app) = on_own_table(&proxied, &ns).await;
    let (first_send, second_send) = (rand::random::<i32>(), rand::random::<i32>());
    let mut gate = stall_inserts(&direct, &direct.table(), &[first_send, second_send]).await;
    let k = key("late");
    let owner = OwnerToken::random();
    let call = spawn_acquire(&lock, &k, owner, Duration::from_secs(60));
    let first = backend(&direct, &app, STALLED).await;
    // The connection of the first send is cut; the server goes on with it.
    proxy.drop_all();
    backend(&direct, &app, &format!("{STALLED} AND pid <> {first}")).await;
    // The caller leaves while the second send is in flight.
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    open(&mut gate, second_send).await;
    // The second send took the lock; its caller is gone, so it is given back.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match row(&direct, &k).await {
            Some((Some(_), _, left)) if left > 0 => {}
            Some(_) => break,
            None => {}
        }
        assert!(
            Instant::now() < deadline,
            "the lock granted to a caller that left was never given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Now the first send goes on, and ends.
    open(&mut gate, first_send).await;
    ended(&direct, &app, first).await;
    assert_eq!(
        direct.inspect(&k).await.unwrap(),
        LockState::Free,
        "the first send, applied after the give-back, took the lock for nobody: {:?}",
        row(&direct, &k).await
    );
    // And the lock is anybody's.
    take(&direct, &k, Duration::from_secs(5), "free").await;
}

/// Runs `op` on a row another transaction holds locked, with a 4 s
/// operation timeout; terminates the backend running it 3 s after its
/// first send was seen waiting, so the client sends it again on another
/// connection, and lets the row go 6 s after that sighting: past the
/// deadline of the first send (by at least 2 s), before that of the resend
/// if the resend had a timeout of its own (7 s). The call must have timed
/// out by then; an acquire's late grant is given back.
async fn assert_ends_by_the_first_sends_deadline(op: Op) {
    const TIMEOUT: Duration = Duration::from_secs(4);
    let ns = unique_name("resent_late");
    let admin = client(&ns).await;
    let (lock, app) = named_client(
        &ns,
        &format!("&operation_timeout_ms={}", TIMEOUT.as_millis()),
    )
    .await;
    let k = key("k");
    let lease = take(&lock, &k, Duration::from_secs(60), "free").await;
    if let Op::Acquire = op {
        lock.release(&lease).await.unwrap();
    }
    let blocker = lock_row(&admin, &lock, &k).await;
    let mut call = spawn_op(&lock, &k, Some(lease), op);
    let waiting = "wait_event_type = 'Lock'";
    let first = backend(&admin, &app, waiting).await;
    // The first send left before now: its deadline is at most 4 s away.
    let seen = Instant::now();
    tokio::time::sleep_until((seen + TIMEOUT * 3 / 4).into()).await;
    terminate(&admin, first).await;
    // The client sent the statement again.
    backend(&admin, &app, &format!("{waiting} AND pid <> {first}")).await;
    let result = tokio::select! {
        result = &mut call => {
            blocker.commit().await.unwrap();
            result
        }
        () = tokio::time::sleep_until((seen + TIMEOUT * 3 / 2).into()) => {
            blocker.commit().await.unwrap();
            call.await
        }
    };
    match result.unwrap() {
        Err(e) if e.kind() == ErrorKind::Timeout => {}
        other => panic!(
            "{op:?} sent again after a lost connection ran past the operation timeout counted from its first send \
             (it was still running when the row was let go at 1.5 times the timeout): {other:?}"
        ),
    }
    if let Op::Acquire = op {
        // The resend takes the lock once the row is let go, after its
        // caller gave up: the lock is given back.
        settled(&lock).await;
        assert_eq!(
            admin.inspect(&k).await.unwrap(),
            LockState::Free,
            "a lock granted after its caller timed out was left held"
        );
    }
}

#[tokio::test]
async fn an_acquire_sent_again_after_a_lost_connection_ends_by_its_first_sends_deadline() {
    assert_ends_by_the_first_sends_deadline(Op::Acquire).await;
}

#[tokio::test]
async fn an_extend_sent_again_after_a_lost_connection_ends_by_its_first_sends_deadline() {
    assert_ends_by_the_first_sends_deadline(Op::Extend).await;
}

#[tokio::test]
async fn a_release_sent_again_after_a_lost_connection_ends_by_its_first_sends_deadline() {
    assert_ends_by_the_first_sends_deadline(Op::Release).await;
}

/// Makes the n-th `INSERT` into `table` (the n-th send of an acquire,
/// counting every client) wait on the advisory lock `gates[n - 1]`, which
/// the returned connection holds until the test unlocks it.
async fn stall_inserts(lock: &Pg, table: &str, gates: &[i32]) -> PgConnection {
    let sequence = unique_name("sends");
    let function = unique_name("stall");
    let cases: String = gates
        .iter()
        .enumerate()
        .map(|(i, gate)| format!("WHEN {} THEN PERFORM pg_advisory_xact_lock({gate});", i + 1))
        .collect();
    admin(lock, &format!("CREATE SEQUENCE {sequence}")).await;
    admin(
        lock,
        &format!(
            "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $f$
             BEGIN
                 CASE nextval('{sequence}') {cases} ELSE NULL; END CASE;
                 RETURN NEW;
             END $f$"
        ),
    )
    .await;
    admin(
        lock,
        &format!(
            "CREATE TRIGGER stall BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {function}()"
        ),
    )
    .await;
    let mut gate = PgConnection::connect(&server().url()).await.unwrap();
    for lock in gates {
        sqlx::query(&format!("SELECT pg_advisory_lock({lock})"))
            .execute(&mut gate)
            .await
            .unwrap();
    }
    gate
}

/// Opens `gate` (see [`stall_inserts`]).
async fn open(gate_holder: &mut PgConnection, gate: i32) {
    sqlx::query(&format!("SELECT pg_advisory_unlock({gate})"))
        .execute(gate_holder)
        .await
        .unwrap();
}

/// A client through `proxied` on its own lock and semaphore tables (so that
/// a trigger can stall their inserts), with its `application_name`, and a
/// direct client on the same rows.
async fn on_own_table(proxied: &str, ns: &str) -> (Pg, Pg, String) {
    on_own_table_with(proxied, ns, "").await
}

/// As [`on_own_table`], the client's URL ending with `extra`.
async fn on_own_table_with(proxied: &str, ns: &str, extra: &str) -> (Pg, Pg, String) {
    on_own_table_timed(proxied, ns, 20_000, extra).await
}

/// As [`on_own_table_with`], the client's operation timeout `timeout_ms`.
async fn on_own_table_timed(
    proxied: &str,
    ns: &str,
    timeout_ms: u64,
    extra: &str,
) -> (Pg, Pg, String) {
    let tables = format!(
        "table={}&semaphore_table={}",
        unique_name("stalled"),
        unique_name("stalled_sem")
    );
    let app = unique_name("app");
    let lock = Pg::connect(&format!(
        "{proxied}?namespace={ns}&{tables}&application_name={app}&operation_timeout_ms={timeout_ms}{extra}"
    ))
    .await;
    let direct = Pg::connect(&format!("{}?namespace={ns}&{tables}", server().url())).await;
    (lock, direct, app)
}

/// Waits until the backend `pid` of `app` no longer runs a statement.
async fn ended(direct: &Pg, app: &str, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !backends(direct, app, &format!("pid = {pid} AND state = 'active'"))
        .await
        .is_empty()
    {
        assert!(Instant::now() < deadline, "the stalled send never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const STALLED: &str = "wait_event_type = 'Lock' AND wait_event = 'advisory'";

#[tokio::test]
async fn a_first_send_applied_after_its_lease_was_renewed_and_released_takes_nothing() {
    // The first send of an acquire stalls on the server and its connection
    // is cut; the resend takes the lock, which is renewed and released.
    // Only then does the first send go on: it must not take the lock again
    // for nobody.
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("late_after_release");
    let (lock, direct, app) = on_own_table(&proxied, &ns).await;
    let first_send = rand::random::<i32>();
    let mut gate = stall_inserts(&direct, &direct.table(), &[first_send]).await;
    let k = key("late");
    let call = spawn_op(&lock, &k, None, Op::Acquire);
    let first = backend(&direct, &app, STALLED).await;
    proxy.drop_all();
    let lease = call
        .await
        .unwrap()
        .expect("sent again after the lost connection")
        .expect("free");
    let lease = lock.extend(&lease, Duration::from_secs(60)).await.unwrap();
    lock.release(&lease).await.unwrap();
    open(&mut gate, first_send).await;
    ended(&direct, &app, first).await;
    assert_eq!(
        direct.inspect(&k).await.unwrap(),
        LockState::Free,
        "the first send, applied after the release, took the lock for nobody: {:?}",
        row(&direct, &k).await
    );
    take(&direct, &k, Duration::from_secs(5), "free").await;
}

/// A permit attempt (with `limit` permits, through a proxy, on a semaphore
/// table of its own) whose first send stalls on the server.
struct StalledPermit {
    proxy: Proxy,
    lock: Pg,
    direct: Pg,
    app: String,
    k: LockKey,
    limit: u32,
    gate: PgConnection,
    first_send: i32,
    /// The backend running the first send.
    first: i32,
}

impl StalledPermit {
    /// Starts the attempt (a waiting one if `wait`) on a task of its own and
    /// returns once its first send stalls.
    async fn start(
        ns: &str,
        limit: u32,
        wait: bool,
    ) -> (Self, JoinHandle<Result<Option<Lease>, LockError>>) {
        let (proxy, proxied) = proxied().await;
        let (lock, direct, app) = on_own_table(&proxied, &unique_name(ns)).await;
        let first_send = rand::random::<i32>();
        let gate = stall_inserts(&direct, &direct.semaphore_table(), &[first_send]).await;
        let k = key("stalled");
        let call = {
            let (lock, k) = (lock.clone(), k.clone());
            tokio::spawn(async move {
                let ttl = Duration::from_secs(30);
                if wait {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    lock.acquire_permit(&k, limit, ttl, deadline).await
                } else {
                    lock.try_acquire_permit(&k, limit, ttl)
                        .await
                        .map(|attempt| attempt.lease())
                }
            })
        };
        let first = backend(&direct, &app, STALLED).await;
        let stalled = Self {
            proxy,
            lock,
            direct,
            app,
            k,
            limit,
            gate,
            first_send,
            first,
        };
        (stalled, call)
    }

    /// How many permits are live by the database clock.
    async fn live_permits(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} AS s, unnest(s.expires) AS e
             WHERE s.namespace = $1 AND s.key = $2 AND e > clock_timestamp()",
            self.direct.semaphore_table()
        ))
        .bind(self.direct.backend.config().client().namespace())
        .bind(self.k.as_str())
        .fetch_one(self.direct.pool())
        .await
        .unwrap()
    }

    /// Lets the first send go on, waits for its end, and checks that every
    /// permit is free (a fresh client takes all `limit`); `why` names what
    /// the first send did otherwise.
    async fn finish(mut self, why: &str) {
        open(&mut self.gate, self.first_send).await;
        ended(&self.direct, &self.app, self.first).await;
        let mut leases = Vec::new();
        for n in 1..=self.limit {
            let attempt = self
                .direct
                .try_acquire_permit(&self.k, self.limit, Duration::from_secs(5))
                .await
                .unwrap();
            let lease = attempt
                .lease()
                .unwrap_or_else(|| panic!("permit {n} of {}: {why}", self.limit));
            leases.push(lease);
        }
        for lease in &leases {
            self.direct.release(lease).await.unwrap();
        }
    }
}

#[tokio::test]
async fn a_first_permit_send_applied_after_its_permit_was_renewed_and_released_takes_nothing() {
    // The permit twin of the lock case above: the first send of a permit
    // attempt stalls on the server and its connection is cut; the resend
    // takes a permit, which is renewed and released, and another client
    // takes and returns a permit (a write of the semaphore's row, which
    // keeps the given-up permit). Only then does the first send go on: it
    // must not take a permit for nobody.
    let (stalled, call) = StalledPermit::start("late_permit", 2, false).await;
    stalled.proxy.drop_all();
    let lease = call
        .await
        .unwrap()
        .expect("sent again after the lost connection")
        .expect("a free permit");
    let lock = &stalled.lock;
    let lease = lock.extend(&lease, Duration::from_secs(60)).await.unwrap();
    lock.release(&lease).await.unwrap();
    assert_eq!(stalled.live_permits().await, 0, "the permit was released");
    let other = stalled
        .direct
        .try_acquire_permit(&stalled.k, stalled.limit, Duration::from_secs(5))
        .await
        .unwrap()
        .lease()
        .expect("a free permit");
    stalled.direct.release(&other).await.unwrap();
    stalled
        .finish("the first send, applied after the release, took a permit for nobody")
        .await;
}

#[tokio::test]
async fn a_first_permit_send_applied_after_its_caller_left_takes_nothing() {
    // The first send of a waiting permit attempt stalls on the server, and
    // its caller leaves: the client settles the attempt with one more of
    // the same owner token and gives back what that gets. Then the first
    // send's connection is cut and the statement sent again, whose grant
    // (if any) is given back too. Only then does the first send go on: it
    // must not take a permit for nobody.
    let (stalled, call) = StalledPermit::start("left_permit", 3, true).await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    stalled.proxy.drop_all();
    tokio::time::timeout(Duration::from_secs(30), stalled.lock.idle())
        .await
        .expect("the attempt left by its caller was never settled");
    assert_eq!(
        stalled.live_permits().await,
        0,
        "what the attempts got was given back"
    );
    stalled
        .finish("the first send, applied after the give-back, took a permit for nobody")
        .await;
}

/// The waiter rows of namespace `ns` (every key and table).
async fn waiter_rows(direct: &Pg, ns: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM public.{} WHERE namespace = $1",
        distlock_postgres::WAITER_TABLE
    ))
    .bind(ns)
    .fetch_one(direct.pool())
    .await
    .unwrap()
}

/// Waits (at most 30 s) until namespace `ns` has waiter rows `done`
/// accepts; `why` names what never happened otherwise.
async fn until_waiter_rows(direct: &Pg, ns: &str, done: impl Fn(i64) -> bool, why: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done(waiter_rows(direct, ns).await) {
        assert!(Instant::now() < deadline, "{why}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_wait_whose_settling_attempt_was_granted_still_leaves_the_line() {
    // A wait's attempt is in flight (stalled on the server before it locks
    // the key's row) when its caller leaves: the client settles it with one
    // more attempt of the same owner token, which is granted on the wait's
    // turn (taking the wait's row out of the line) and given back, and
    // another client takes the key. Only then does the wait's own attempt
    // go on: refused, it joins the line again. When the wait ends it must
    // still leave: its row names a live listener, a head every later
    // release wakes and whose turn (5 s) the line then waits out (two such
    // rows failed the conformance case `dropped_waiters_leave_nothing_held`
    // in CI, where a holder waited 10 s for a free key).
    let ns = unique_name("settled_in_line");
    let (lock, direct, app) = on_own_table(&server().url(), &ns).await;
    let ttl = Duration::from_secs(60);
    let k = key("k");
    let holder = take(&direct, &k, ttl, "free").await;
    let owner = OwnerToken::random();
    let watch = watch(&lock, &k, owner).await;
    let attempt = |settling| AcquireRequest {
        settling,
        ..request(&k, owner, ttl)
    };
    let first = lock.backend.acquire(attempt(false)).await.unwrap();
    assert!(matches!(first, AcquireReply::Held { .. }), "{first:?}");
    assert_eq!(
        waiter_rows(&direct, &ns).await,
        1,
        "the wait joined the line"
    );
    let gate_id = rand::random::<i32>();
    let mut gate = stall_inserts(&direct, &direct.table(), &[gate_id]).await;
    let in_flight = spawn_acquire(&lock, &k, owner, ttl);
    backend(&direct, &app, STALLED).await;
    // The release gives the wait its turn; the settling attempt takes it.
    direct.release(&holder).await.unwrap();
    let settled = granted(
        lock.backend.acquire(attempt(true)).await.unwrap(),
        "the settling attempt on the wait's turn",
    );
    assert_eq!(
        release_grant(&lock, &k, owner, &settled).await,
        ReleaseReply::Released
    );
    let other = take(&direct, &k, ttl, "free once given back").await;
    open(&mut gate, gate_id).await;
    let late = in_flight.await.unwrap().unwrap();
    assert!(
        matches!(late, AcquireReply::Held { .. }),
        "the wait's own attempt, applied last, is refused: {late:?}"
    );
    assert_eq!(
        waiter_rows(&direct, &ns).await,
        1,
        "it joined the line again"
    );
    drop(watch);
    let why = "the wait ended and left its row in the line";
    until_waiter_rows(&direct, &ns, |rows| rows == 0, why).await;
    direct.release(&other).await.unwrap();
}

/// What a wait waits for: a lock, or a permit of a semaphore of one.
#[derive(Debug, Clone, Copy)]
enum WaitFor {
    Lock,
    Permit,
}

impl WaitFor {
    /// The table whose inserts hold this wait's acquisitions.
    fn table(self, lock: &Pg) -> String {
        match self {
            Self::Lock => lock.table(),
            Self::Permit => lock.semaphore_table(),
        }
    }

    /// Takes `k` (a free lock, or a free permit), through the client.
    async fn take(self, lock: &Pg, k: &LockKey) -> Lease {
        let ttl = Duration::from_secs(5);
        match self {
            Self::Lock => take(lock, k, ttl, "free").await,
            Self::Permit => {
                let attempt = lock.try_acquire_permit(k, 1, ttl).await.unwrap();
                attempt.lease().expect("a free permit")
            }
        }
    }

    /// `owner`'s wait on `k` registered with `lock`'s backend.
    async fn watch(self, lock: &Pg, k: &LockKey, owner: OwnerToken) -> ReleaseWatch {
        match self {
            Self::Lock => watch(lock, k, owner).await,
            Self::Permit => lock
                .backend
                .watch_permits(k, 1, owner)
                .await
                .unwrap()
                .expect("a client with a listener watches"),
        }
    }

    /// `lock`'s backend acquires `k` for `owner` on a task of its own: the
    /// grant, or `None` if refused.
    fn spawn(
        self,
        lock: &Pg,
        k: &LockKey,
        owner: OwnerToken,
        ttl: Duration,
    ) -> JoinHandle<Result<Option<Grant>, LockError>> {
        let (lock, k) = (lock.clone(), k.clone());
        tokio::spawn(async move {
            Ok(match self {
                Self::Lock => match lock.backend.acquire(request(&k, owner, ttl)).await? {
                    AcquireReply::Granted(grant) => Some(grant),
                    _ => None,
                },
                Self::Permit => {
                    let permit = PermitRequest {
                        key: &k,
                        owner,
                        ttl,
                        limit: 1,
                        renewing: false,
                        settling: false,
                        holder: None,
                    };
                    match lock.backend.acquire_permit(permit).await? {
                        PermitReply::Granted(grant) => Some(grant),
                        _ => None,
                    }
                }
            })
        })
    }

    /// Releases, through `lock`'s backend, what `grant` gave `owner` on `k`.
    async fn release(
        self,
        lock: &Pg,
        k: &LockKey,
        owner: OwnerToken,
        grant: &Grant,
    ) -> ReleaseReply {
        match self {
            Self::Lock => release_grant(lock, k, owner, grant).await,
            Self::Permit => {
                let permit = HeldLock {
                    key: k,
                    owner,
                    fencing: grant.fencing,
                    handle: grant.handle,
                };
                lock.backend.release_permit(permit).await.unwrap()
            }
        }
    }
}

/// A wait's first send stalls on the server and its connection is cut;
/// the resend takes the lock (or permit), which is released (the wait is
/// over). Only then does the first send go on: refused as a late send, it
/// must not join the line either. Its row would name the client's live
/// listener (connected directly here, so it outlives the cut): on a lock,
/// a head every later release wakes and whose turn (5 s) the line then
/// waits out; on a semaphore, where a release takes the waiter it wakes
/// off the line, a release that wakes nobody who waits.
/// `earlier_row`: the key's row exists before (an earlier holder's), so
/// the first send's snapshot shows it; else its snapshot misses the row
/// the resend inserted.
async fn late_waiting_send_stays_out_of_line(wait_for: WaitFor, earlier_row: bool) {
    let (proxy, proxied) = proxied().await;
    let ns = unique_name("late_waiter");
    let listen = format!(
        "&listen_url={}",
        distlock_conformance::url::percent_encode(&server().url())
    );
    let (lock, direct, app) = on_own_table_with(&proxied, &ns, &listen).await;
    let first_send = rand::random::<i32>();
    let k = key("late");
    if earlier_row {
        let earlier = wait_for.take(&direct, &k).await;
        direct.release(&earlier).await.unwrap();
    }
    let mut gate = stall_inserts(&direct, &wait_for.table(&direct), &[first_send]).await;
    let owner = OwnerToken::random();
    let watch = wait_for.watch(&lock, &k, owner).await;
    let call = wait_for.spawn(&lock, &k, owner, Duration::from_secs(60));
    let first = backend(&direct, &app, STALLED).await;
    proxy.drop_all();
    let grant = call
        .await
        .unwrap()
        .expect("sent again after the lost connection")
        .expect("the resend on a free key is granted");
    assert_eq!(
        wait_for.release(&lock, &k, owner, &grant).await,
        ReleaseReply::Released
    );
    drop(watch);
    open(&mut gate, first_send).await;
    ended(&direct, &app, first).await;
    assert_eq!(
        waiter_rows(&direct, &ns).await,
        0,
        "the first send ({wait_for:?}), applied after the release, joined the line (earlier row: {earlier_row})"
    );
    wait_for.take(&direct, &k).await;
}

#[tokio::test]
async fn a_waiting_first_send_applied_after_its_lease_was_released_does_not_join_the_line() {
    late_waiting_send_stays_out_of_line(WaitFor::Lock, true).await;
}

#[tokio::test]
async fn a_waiting_first_send_that_missed_the_row_it_met_does_not_join_the_line() {
    late_waiting_send_stays_out_of_line(WaitFor::Lock, false).await;
}

#[tokio::test]
async fn a_waiting_first_permit_send_applied_after_its_permit_was_released_does_not_join_the_line()
{
    late_waiting_send_stays_out_of_line(WaitFor::Permit, true).await;
}

#[tokio::test]
async fn a_waiting_first_permit_send_that_missed_the_row_it_met_does_not_join_the_line() {
    late_waiting_send_stays_out_of_line(WaitFor::Permit, false).await;
}

/// A wait's first send stalls on the server (before it locks the key's
/// row) past twice the client's operation timeout: the client gives it up
/// (its connection closed; PostgreSQL runs the statement on), sends the
/// attempt again, which joins the line, and the wait ends (its deadline),
/// leaving the line. Only then does the first send go on: refused, it
/// joins the line after the wait's leave, under the client's live
/// listener. The next release wakes that row; its client passes the
/// wake-up on, and the waiter behind it is served. Before, the line
/// waited out the row's turn, and the waiter behind, never woken, its
/// timer (the holder's expiry).
#[tokio::test]
async fn a_waiting_send_applied_after_its_wait_left_the_line_costs_a_pass_on() {
    let ns = unique_name("stalled_past_wait");
    let (lock, direct, app) = on_own_table_timed(&server().url(), &ns, 1_000, "").await;
    let (long, k) = (Duration::from_secs(120), key("k"));
    let holder = take(&direct, &k, long, "free").await;
    let first_send = rand::random::<i32>();
    let mut gate = stall_inserts(&direct, &direct.table(), &[first_send]).await;
    let wait = {
        let (lock, k) = (lock.clone(), k.clone());
        tokio::spawn(async move {
            lock.acquire(&k, long, Instant::now() + Duration::from_secs(5))
                .await
        })
    };
    let first = backend(&direct, &app, STALLED).await;
    let ended_wait = wait.await.unwrap();
    assert!(
        !matches!(ended_wait, Ok(Some(_))),
        "the wait ends without the held lock: {ended_wait:?}"
    );
    // Its leave is awaited (at most 2 s) before the wait returns; on a
    // loaded machine it may end after that.
    until_waiter_rows(
        &direct,
        &ns,
        |rows| rows == 0,
        "the wait never left the line",
    )
    .await;
    open(&mut gate, first_send).await;
    ended(&direct, &app, first).await;
    assert_eq!(
        waiter_rows(&direct, &ns).await,
        1,
        "the first send, applied after the wait left, joined the line"
    );
    // A waiter of another client, behind that row.
    let waiting = {
        let (direct, k) = (direct.clone(), k.clone());
        tokio::spawn(async move { direct.acquire(&k, long, Instant::now() + long).await })
    };
    until_waiter_rows(
        &direct,
        &ns,
        |rows| rows >= 2,
        "the next waiter never queued",
    )
    .await;
    direct.release(&holder).await.unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the waiter behind the row of the ended wait was woken")
        .unwrap()
        .unwrap()
        .expect("the waiter is served");
    direct.release(&lease).await.unwrap();
    assert_eq!(waiter_rows(&direct, &ns).await, 0, "nothing left in line");
}
