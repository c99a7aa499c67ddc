//! Waiting on etcd: wake-ups come from etcd watches (not polling), in FIFO
//! order through the waiter queue, at a constant cost per handoff, and
//! leave no queue entries behind.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    acquire, any_server, assert_queue_empties, connect, grpc_received, grpc_started, keys_under,
    observed, own_server, proposals_committed, proxy_for, raw_client, requests_between, through,
    unique_key,
};
use distlock_conformance::fault::Direction;
use distlock_conformance::naming::unique_name;
use distlock_conformance::server::ServerProcess;
use distlock_conformance::{Call, ObservedLock};
use distlock_core::{AcquireAttempt, Lease, LockClient, LockError, LockKey, LockOptions, Locker};
use tokio::task::JoinHandle;

/// A waiter blocked for 2 s makes at most 2 attempts: it is woken by the
/// watch, not by polling. The operation timeout is shorter than the wait,
/// so the watch stream must outlive it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_the_server_not_polling() {
    let server = any_server();
    let url = format!("{}?operation_timeout_ms=500", server.url());
    let holder = connect(&url).await;
    let (attempts, waiter) = observed(&url).await;
    let k = unique_key("wake");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;

    let task = {
        let waiter = waiter.clone();
        let k = k.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            waiter.acquire(&k, Duration::from_secs(30), deadline).await
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(attempts.attempts_in_line(), 1, "no polling while held");
    holder.release(&held).await.expect("release");
    let lease = task
        .await
        .unwrap()
        .expect("acquire")
        .expect("acquired before the deadline");
    assert!(lease.fencing_token() > held.fencing_token());
    let n = attempts.attempts_in_line();
    assert!(n <= 2, "{n} attempts");
    waiter.release(&lease).await.unwrap();
}

/// A holder that stops renewing (crashed) is noticed when etcd expires its
/// lease: the deletion wakes the waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_lease_expiry() {
    let server = any_server();
    let holder = connect(&server.url()).await;
    let (attempts, waiter) = observed(&server.url()).await;
    let k = unique_key("expiry");
    let held = acquire(&holder, &k, Duration::from_secs(2)).await;
    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(20);
    let lease = waiter
        .acquire(&k, Duration::from_secs(5), deadline)
        .await
        .expect("acquire")
        .expect("acquired after expiry");
    assert!(lease.fencing_token() > held.fencing_token());
    assert!(attempts.attempts_in_line() <= 2);
}

/// gRPC requests per handoff with `waiters` waiters, each in its own client:
/// a holder releases, the first waiter acquires, holds briefly and releases,
/// the next acquires, and so on. Counts every request etcd received from
/// the moment every waiter waits until the last one released (background
/// deletes and revokes included; each watch created or cancelled), divided
/// by the number of handoffs.
async fn requests_per_handoff(server: &ServerProcess, waiters: usize) -> BTreeMap<String, f64> {
    let holder = connect(&server.url()).await;
    let k = unique_key("handoff");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    let mut clients = Vec::new();
    for _ in 0..waiters {
        clients.push(observed(&server.url()).await);
    }
    let tasks: Vec<_> = clients
        .iter()
        .map(|(_, client)| {
            let client = client.clone();
            let k = k.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(60);
                let lease = client
                    .acquire(&k, Duration::from_secs(30), deadline)
                    .await
                    .expect("acquire")
                    .expect("acquired before the deadline");
                tokio::time::sleep(Duration::from_millis(30)).await;
                client.release(&lease).await.expect("release");
                lease.fencing_token()
            })
        })
        .collect();
    // Every waiter has made its first attempt (so it is subscribed and queued).
    while clients.iter().any(|(c, _)| c.attempts_in_line() == 0) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = grpc_received(server.addr()).await;
    holder.release(&held).await.expect("release the holder");
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.push(task.await.expect("waiter task"));
    }
    // Background deletes and revokes.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = grpc_received(server.addr()).await;
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), waiters, "every waiter acquired once");
    for (client, _) in &clients {
        let attempts = client.attempts_in_line();
        assert!(attempts <= 3, "a waiter made {attempts} attempts");
    }
    requests_between(&before, &after)
        .into_iter()
        .map(|(method, n)| (method, n as f64 / waiters as f64))
        .collect()
}

/// A waiter whose guard renews its lock (the default), queued behind a
/// holder, reads before it attempts, as a plain one does: its refused
/// attempt writes nothing through Raft (an etcd transaction that could
/// write is proposed and committed even when its compare fails, an fsync
/// per refusal in a crowd). Its first attempt, before it queues, is a
/// `try_lock`'s transaction (etcd declares `attempt_before_watch`: a free
/// key needs no queue entry); while it waits, the client's only write is
/// its queue entry, and a `try_lock` of the same client, not in line while
/// its waiter is, reads too. Then it takes the lock once the holder
/// releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewing_waiters_refused_attempt_writes_nothing() {
    // A server of its own: every proposal counted is this test's.
    let server = own_server();
    let holder = connect(&server.url()).await;
    let (attempts, client) = observed(&server.url()).await;
    let locker = Locker::new(client);
    let ttl = Duration::from_secs(30);
    // Warm-up: the client's session leases (the lock TTL's, and the
    // queue's) are granted before the count.
    let warm = unique_key("renewing-refusal-warm");
    let guard = locker
        .try_lock(&warm, &LockOptions::new(ttl))
        .await
        .expect("warm-up try_lock")
        .expect("the warm-up key is free");
    guard.release().await.expect("warm-up release");
    let held_warm = acquire(&holder, &warm, ttl).await;
    let gave_up = locker
        .acquire(
            &warm,
            &LockOptions::new(ttl).with_wait(Duration::from_millis(300)),
        )
        .await
        .expect("warm-up wait");
    assert!(gave_up.is_none(), "the warm-up key is held");
    holder.release(&held_warm).await.expect("warm-up release");
    until_no_waiter_entries(&server).await;

    let k = unique_key("renewing-refusal");
    let held = acquire(&holder, &k, ttl).await;
    // Background revokes and deletes of the warm-up are done.
    let before = settled_proposals(server.addr()).await;
    let before_attempts = attempts.attempts_in_line();
    let waiter = {
        let locker = locker.clone();
        let k = k.clone();
        tokio::spawn(async move {
            locker
                .acquire(
                    &k,
                    &LockOptions::new(ttl).with_wait(Duration::from_secs(60)),
                )
                .await
        })
    };
    until_in_line(&attempts, before_attempts).await;
    let after = settled_proposals(server.addr()).await;
    // etcd declares `attempt_before_watch`: the waiter's first attempt,
    // not yet in line, is a transaction etcd commits through Raft although
    // its compare fails (a `try_lock`'s cost); then its queue entry; its
    // attempt in line reads first and writes nothing.
    assert_eq!(
        after - before,
        2.0,
        "proposals while a renewing waiter tried, queued and was refused (its first try and its queue entry: 2)"
    );
    let tried = locker
        .try_lock(&k, &LockOptions::new(ttl))
        .await
        .expect("try_lock");
    assert!(tried.is_none(), "the key is held");
    assert_eq!(
        settled_proposals(server.addr()).await,
        after,
        "proposals of a try_lock refused while the same client's waiter is in line"
    );
    holder.release(&held).await.expect("release the holder");
    let guard = served(waiter).await;
    guard.release().await.expect("release");
}

/// A client whose attempt found a key taken reads before it writes on that
/// key for a while: its next attempt not in line, refused again, commits
/// no Raft proposal (a crowd of many processes: the holder that released
/// and queues again tries first). Once the key is free, the read lets the
/// attempt through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_clients_next_attempt_on_the_key_reads_first() {
    // A server of its own: every proposal counted is this test's.
    let server = own_server();
    let holder = connect(&server.url()).await;
    let locker = Locker::new(connect(&server.url()).await);
    let options = LockOptions::new(Duration::from_secs(30));
    // Warm-up: the client's session lease is granted before the count.
    let warm = unique_key("contended-warm");
    let guard = locker
        .try_lock(&warm, &options)
        .await
        .expect("warm-up try_lock")
        .expect("the warm-up key is free");
    guard.release().await.expect("warm-up release");
    let k = unique_key("contended");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    let refused = locker.try_lock(&k, &options).await.expect("try_lock");
    assert!(refused.is_none(), "the key is held");
    let before = settled_proposals(server.addr()).await;
    let refused = locker.try_lock(&k, &options).await.expect("try_lock");
    assert!(refused.is_none(), "the key is held");
    assert_eq!(
        settled_proposals(server.addr()).await,
        before,
        "proposals of a try_lock refused again on a key the client found held"
    );
    holder.release(&held).await.expect("release");
    let guard = locker
        .try_lock(&k, &options)
        .await
        .expect("try_lock")
        .expect("a free key is taken after the read");
    guard.release().await.expect("release");
}

/// A waiter whose queue entry's own transaction found someone ahead (here
/// the lock held) is refused at its next attempt without a request: that
/// transaction read what a probe would, and the waiter's task watches from
/// its revision on. Its requests: the first attempt (not in line yet) and
/// the entry's transaction; not a third, read-only one. Woken by the
/// release, it then takes the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_refused_by_its_entrys_look_up_sends_no_probe() {
    let (server, holder, attempts, client) = counted_scene().await;
    let ttl = Duration::from_secs(30);
    // Warm-up: the client's session leases (the lock's and the queue's).
    let warm = unique_key("joined-refusal-warm");
    let held_warm = acquire(&holder, &warm, ttl).await;
    let gave_up = client
        .acquire(&warm, ttl, Instant::now() + Duration::from_millis(300))
        .await
        .expect("warm-up wait");
    assert!(gave_up.is_none(), "the warm-up key is held");
    holder.release(&held_warm).await.expect("warm-up release");
    until_no_waiter_entries(&server).await;

    let k = unique_key("joined-refusal");
    let held = acquire(&holder, &k, ttl).await;
    let before_attempts = attempts.attempts_in_line();
    let before = grpc_started(server.addr()).await;
    let waiter = waiting_for(&client, &k, ttl);
    until_in_line(&attempts, before_attempts).await;
    let counted = requests_between(&before, &grpc_started(server.addr()).await);
    let kv = requests_of(&counted, &["Txn", "Range", "Put", "DeleteRange"]);
    assert_eq!(
        kv, 2,
        "requests while a waiter tried, queued and was refused (its first try and its entry): {counted:?}"
    );
    holder.release(&held).await.expect("release the holder");
    let lease = served(waiter).await;
    client.release(&lease).await.expect("release");
}

/// An attempt not in line (here a `try_lock`) while one of its own
/// client's waiters is in the key's line is refused without a request:
/// that waiter's entry is there while its seat is registered. Once the
/// waiter took the lock and let it go, the client's next try goes to the
/// server and takes the free key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_behind_its_own_clients_waiter_is_refused_without_a_request() {
    let (server, holder, attempts, client) = counted_scene().await;
    let ttl = Duration::from_secs(30);
    let k = unique_key("own-waiter-ahead");
    let held = acquire(&holder, &k, ttl).await;
    let waiter = waiting_for(&client, &k, ttl);
    // In line once an attempt claimed its seat.
    until_in_line(&attempts, 0).await;
    let before = grpc_started(server.addr()).await;
    let tried = client.try_acquire(&k, ttl).await.expect("try_acquire");
    assert!(
        matches!(tried, AcquireAttempt::Held { .. }),
        "a try behind the client's own waiter: {tried:?}"
    );
    let counted = requests_between(&before, &grpc_started(server.addr()).await);
    let kv = requests_of(
        &counted,
        &["Txn", "Range", "Put", "DeleteRange", "LeaseGrant"],
    );
    assert_eq!(kv, 0, "requests of the refused try: {counted:?}");

    holder.release(&held).await.expect("release the holder");
    let lease = served(waiter).await;
    client.release(&lease).await.expect("release");
    let again = acquire(&client, &k, ttl).await;
    client.release(&again).await.expect("release");
}

/// A waiter whose predecessor took the lock watches the lock key before
/// its look-up, so the look-up that finds it first covers the time up to
/// the watch: no read after the watch is confirmed, even while the store
/// moves on all the time (here writers put other keys without pause).
/// A line of eighteen handed along sends at most one `Range` (the watch
/// check): the code before sent one in about one handoff of six (1 to 3
/// in lines of twelve); this code sent none in most runs and one in a
/// loaded CI run (a waiter moved up without its predecessor's deletion
/// in hand, which still reads as before: one read more, nothing wrong).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_whose_predecessor_took_the_lock_sends_at_most_one_watch_check() {
    let (server, holder, attempts, client) = counted_scene().await;
    let ttl = Duration::from_secs(30);
    let k = unique_key("successors");
    let held = acquire(&holder, &k, ttl).await;
    let mut line = Vec::new();
    for _ in 0..LINE {
        let before = attempts.attempts_in_line();
        let (client, k) = (client.clone(), k.clone());
        line.push(tokio::spawn(async move {
            let lease = client
                .acquire(&k, ttl, Instant::now() + Duration::from_secs(60))
                .await
                .expect("acquire")
                .expect("acquired in turn");
            client.release(&lease).await.expect("release");
            lease.fencing_token()
        }));
        // In line (entry put, watch confirmed) before the next one joins.
        until_in_line(&attempts, before).await;
    }
    let writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut writers = Vec::new();
    for _ in 0..4 {
        let (mut raw, writing) = (raw_client(&server.url()).await, writing.clone());
        let other = unique_name("moves-the-store");
        writers.push(tokio::spawn(async move {
            while writing.load(std::sync::atomic::Ordering::Relaxed) {
                raw.put(other.as_str(), "x", None).await.expect("raw put");
            }
        }));
    }
    let before = grpc_started(server.addr()).await;
    holder.release(&held).await.expect("release the holder");
    let mut tokens = Vec::new();
    for waiter in line {
        tokens.push(waiter.await.expect("waiter task"));
    }
    let counted = requests_between(&before, &grpc_started(server.addr()).await);
    writing.store(false, std::sync::atomic::Ordering::Relaxed);
    for writer in writers {
        writer.await.expect("writer");
    }
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "served in line order: {tokens:?}"
    );
    assert!(
        counted.get("Put").copied().unwrap_or(0) > 0,
        "the writers moved the store on: {counted:?}"
    );
    let checks = counted.get("Range").copied().unwrap_or(0);
    assert!(
        checks <= 1,
        "{checks} watch checks in {LINE} handoffs: {counted:?}"
    );
}

/// The line of `a_successor_whose_predecessor_took_the_lock_sends_at_most_one_watch_check`.
const LINE: usize = 18;

/// Waits until `attempts` counted an attempt in line past `before` (its
/// waiter queued and claimed its seat).
async fn until_in_line(attempts: &ObservedLock, before: u64) {
    while attempts.attempts_in_line() == before {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `client` waits for `k` (up to 60 s) on a task of its own.
fn waiting_for(
    client: &LockClient,
    k: &LockKey,
    ttl: Duration,
) -> JoinHandle<Result<Option<Lease>, LockError>> {
    let (client, k) = (client.clone(), k.clone());
    tokio::spawn(async move {
        client
            .acquire(&k, ttl, Instant::now() + Duration::from_secs(60))
            .await
    })
}

/// What `waiter` ([`waiting_for`]) acquired once the holder released.
async fn served<T>(waiter: JoinHandle<Result<Option<T>, LockError>>) -> T {
    waiter
        .await
        .expect("waiter task")
        .expect("acquire")
        .expect("acquired once the holder released")
}

/// How many requests of `methods` the server counted.
fn requests_of(counted: &BTreeMap<String, u64>, methods: &[&str]) -> u64 {
    methods
        .iter()
        .map(|m| counted.get(*m).copied().unwrap_or(0))
        .sum()
}

/// A server of its own (every request counted is the test's), a holder's
/// client, and a client whose attempts are observed.
async fn counted_scene() -> (ServerProcess, LockClient, Arc<ObservedLock>, LockClient) {
    let server = own_server();
    let holder = connect(&server.url()).await;
    let (attempts, client) = observed(&server.url()).await;
    (server, holder, attempts, client)
}

/// Waits until `server` holds no queue entry (a warm-up waiter's is
/// deleted in the background).
async fn until_no_waiter_entries(server: &ServerProcess) {
    let mut raw = raw_client(&server.url()).await;
    let give_up = Instant::now() + Duration::from_secs(10);
    while keys_under(&mut raw, "")
        .await
        .iter()
        .any(|k| k.contains("/waiters/"))
    {
        assert!(Instant::now() < give_up, "the warm-up queue entry stayed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The proposals etcd committed, once two readings 300 ms apart agree
/// (what was in flight is done); panics if they still move after 20 s.
async fn settled_proposals(addr: std::net::SocketAddr) -> f64 {
    let give_up = Instant::now() + Duration::from_secs(20);
    let mut last = proposals_committed(addr).await;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = proposals_committed(addr).await;
        if now == last {
            return now;
        }
        assert!(Instant::now() < give_up, "etcd's proposals never settled");
        last = now;
    }
}

/// FIFO wake-up: each waiter watches only its predecessor in the queue, so
/// the key-value requests per handoff do not grow with the number of waiters.
/// A successor learns it is first from its predecessor's marker (its entry
/// put again as it took the lock, see `marker.rs`): in a line, a handoff is
/// the release and the next acquire, and the taker's watch cancelled; no
/// look-up, no watch moved to the lock key (before markers: 3 key-value
/// requests and 3 watch requests a handoff at 8 and 16 waiters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_cost_is_constant_in_the_number_of_waiters() {
    // A server of its own, so no other test's requests are counted.
    let server = own_server();
    let kv = |counts: &BTreeMap<String, f64>| -> f64 {
        ["Txn", "Range", "Put", "DeleteRange"]
            .iter()
            .map(|m| counts.get(*m).copied().unwrap_or(0.0))
            .sum()
    };
    let mut per_size = Vec::new();
    for waiters in [1usize, 8, 16] {
        let counts = requests_per_handoff(&server, waiters).await;
        eprintln!("requests per handoff with {waiters} waiters: {counts:?}");
        per_size.push((waiters, kv(&counts), counts));
    }
    for (waiters, total, counts) in &per_size {
        // Per handoff: release (Txn), acquire (Txn); the acquire's lease
        // grant and the released lease's revoke (one waiter: its first
        // attempt, before it queued, too).
        assert!(
            *total <= 4.0,
            "{waiters} waiters: {total} key-value requests per handoff: {counts:?}"
        );
        let grants = counts.get("LeaseGrant").copied().unwrap_or(0.0);
        assert!(grants <= 1.0, "{waiters} waiters: {counts:?}");
        if *waiters > 1 {
            assert!(
                *total <= 2.5,
                "{waiters} waiters: {total} key-value requests per handoff (a successor looked its place up): {counts:?}"
            );
            let watches = counts.get("Watch").copied().unwrap_or(0.0);
            assert!(
                watches <= 1.5,
                "{waiters} waiters: {watches} watch requests per handoff (a successor moved its watch): {counts:?}"
            );
        }
    }
}

/// Waiters acquire in the order they started waiting, and leave no queue
/// entries behind: neither those that acquired nor one that gave up at its
/// deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_acquire_in_fifo_order_and_leave_no_queue_entries() {
    let server = any_server();
    let ns = unique_name("fifo");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let k = LockKey::new("queue/of a").unwrap();
    let queue = format!("{ns}/lock/queue%2Fof a/waiters/");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;

    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5usize {
        let (attempts, client) = observed(&url).await;
        let task = {
            let attempts = attempts.clone();
            let k = k.clone();
            let order = order.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(30);
                let lease = client
                    .acquire(&k, Duration::from_secs(30), deadline)
                    .await
                    .expect("acquire")
                    .expect("acquired");
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(20)).await;
                client.release(&lease).await.expect("release");
                attempts.attempts_in_line()
            })
        };
        // Queued (its first attempt made) before the next one starts.
        until_in_line(&attempts, 0).await;
        tasks.push(task);
    }
    assert_eq!(
        keys_under(&mut raw, &queue).await.len(),
        5,
        "one entry per waiter"
    );
    // A waiter that gives up at its deadline leaves the queue.
    let quitter = connect(&url).await;
    let gave_up = quitter
        .acquire(
            &k,
            Duration::from_secs(30),
            Instant::now() + Duration::from_millis(300),
        )
        .await
        .expect("acquire with a short deadline");
    assert!(gave_up.is_none());

    holder.release(&held).await.expect("release");
    for task in tasks {
        let attempts = task.await.expect("waiter task");
        assert!(attempts <= 2, "a waiter made {attempts} attempts");
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert_queue_empties(&mut raw, &queue).await;
}

/// Waiters on look-alike keys (`a` and `a/b`) never see each other's queue
/// or releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_look_alike_keys_are_independent() {
    let server = any_server();
    let ns = unique_name("alike");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let a = LockKey::new("a").unwrap();
    let ab = LockKey::new("a/b").unwrap();
    let held_ab = acquire(&holder, &ab, Duration::from_secs(30)).await;
    let held_a = acquire(&holder, &a, Duration::from_secs(30)).await;

    let wait_on = |key: LockKey| {
        let url = url.clone();
        async move {
            let (attempts, client) = observed(&url).await;
            let task = {
                let client = client.clone();
                tokio::spawn(async move {
                    client
                        .acquire(
                            &key,
                            Duration::from_secs(30),
                            Instant::now() + Duration::from_secs(30),
                        )
                        .await
                })
            };
            until_in_line(&attempts, 0).await;
            (attempts, client, task)
        }
    };
    let (_, on_a, task_a) = wait_on(a.clone()).await;
    let (ab_attempts, on_ab, task_ab) = wait_on(ab.clone()).await;
    assert_eq!(
        keys_under(&mut raw, &format!("{ns}/lock/a/")).await.len(),
        1
    );
    assert_eq!(
        keys_under(&mut raw, &format!("{ns}/lock/a%2Fb/"))
            .await
            .len(),
        1
    );

    // Releasing `a` wakes its waiter only.
    holder.release(&held_a).await.expect("release a");
    let got_a = task_a
        .await
        .unwrap()
        .expect("acquire a")
        .expect("acquired a");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(ab_attempts.attempts_in_line(), 1, "a/b waiter woken by a");
    on_a.release(&got_a).await.unwrap();
    holder.release(&held_ab).await.expect("release a/b");
    let got_ab = task_ab
        .await
        .unwrap()
        .expect("acquire a/b")
        .expect("acquired a/b");
    assert_eq!(ab_attempts.attempts_in_line(), 2);
    on_ab.release(&got_ab).await.unwrap();
    common::delete_prefix(&mut raw, &ns).await;
}

/// Waits until `queue` holds `n` entries; panics after 10 s.
async fn until_queued(raw: &mut distlock_etcd::etcd_client::Client, queue: &str, n: usize) {
    let give_up = Instant::now() + Duration::from_secs(10);
    while keys_under(raw, queue).await.len() != n {
        assert!(Instant::now() < give_up, "{queue} never held {n} entries");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A waiter's queue transaction and its watch are two requests, and its
/// watch starts at the revision etcd confirms it at (a watch from an older
/// revision would be served by etcd's 100 ms catch-up loop). A predecessor
/// that leaves in between, its deletion older than the watch, must still
/// move the waiter up, so the release after it reaches the waiter. The
/// waiter's replies are held while the predecessor leaves: its
/// transaction is applied, its watch not yet asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_predecessor_that_leaves_before_the_watch_starts_still_moves_the_waiter_up() {
    let server = any_server();
    let ns = unique_name("gap");
    let query = format!("namespace={ns}");
    let url = format!("{}?{query}", server.url());
    let proxy = proxy_for(&server).await;
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let ahead = connect(&url).await;
    let (attempts, waiter) = observed(&through(&proxy, &query)).await;
    let k = LockKey::new("gap").unwrap();
    let queue = format!("{ns}/lock/gap/waiters/");
    let ttl = Duration::from_secs(60);
    let held = acquire(&holder, &k, ttl).await;
    // The waiter's session lease (its queue entries' lease) is granted
    // before its replies are held.
    let warm = waiter
        .acquire(&k, ttl, Instant::now() + Duration::from_millis(200))
        .await
        .expect("a short wait");
    assert!(warm.is_none(), "the key is held");
    assert_queue_empties(&mut raw, &queue).await;

    // The client outlives the wait, so its entry is deleted at once (a
    // dropped client's entries go with its session lease).
    let first = {
        let ahead = ahead.clone();
        let k = k.clone();
        tokio::spawn(async move {
            ahead
                .acquire(&k, ttl, Instant::now() + Duration::from_secs(60))
                .await
        })
    };
    until_queued(&mut raw, &queue, 1).await;
    let first_entry = keys_under(&mut raw, &queue).await;
    // etcd attempts before it watches: the replies are held once the
    // waiter's first attempt was refused and its watch is on its way.
    attempts.hold_requests(Call::Watch);
    let tried = attempts.attempts_in_line();
    let deadline = Instant::now() + Duration::from_secs(20);
    let second = {
        let waiter = waiter.clone();
        let k = k.clone();
        tokio::spawn(async move { waiter.acquire(&k, ttl, deadline).await })
    };
    let give_up = Instant::now() + Duration::from_secs(10);
    while attempts.waiting(Call::Watch) == 0 {
        assert!(
            Instant::now() < give_up,
            "the waiter never came to its watch"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.hold(Direction::ToClient);
    attempts.open(Call::Watch);
    // The waiter's transaction read the first one as its predecessor.
    until_queued(&mut raw, &queue, 2).await;
    let mut second_entry = keys_under(&mut raw, &queue).await;
    second_entry.retain(|entry| !first_entry.contains(entry));
    first.abort();
    until_queued(&mut raw, &queue, 1).await;
    assert_eq!(
        keys_under(&mut raw, &queue).await,
        second_entry,
        "the first waiter left, the second is still queued"
    );
    proxy.pass(Direction::ToClient);
    // In line now, its first attempt refused (the holder still holds).
    until_in_line(&attempts, tried).await;
    holder.release(&held).await.expect("release");
    let lease = second
        .await
        .expect("waiting task")
        .expect("acquire")
        .expect("acquired");
    // Its last attempt at the deadline would take the free key too.
    assert!(
        Instant::now() < deadline,
        "the waiter was left watching a deleted predecessor: its deadline woke it, not the release"
    );
    assert!(lease.fencing_token() > held.fencing_token());
    waiter.release(&lease).await.expect("release");
    assert_queue_empties(&mut raw, &queue).await;
}

/// A semaphore's first `limit` waiters all watch its permits, so a release
/// wakes one of them at once; a waiter that moves into those first `limit`
/// (one ahead of it left) watches the permits too, not the waiter still
/// ahead of it. Two waiters ahead of it are queue entries written as
/// distlock writes them, on a lease of their own: they never try, and
/// never leave unless told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_moves_into_a_semaphores_first_limit_watches_its_permits() {
    use distlock_etcd::etcd_client::PutOptions;

    let server = any_server();
    let ns = unique_name("window");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let k = LockKey::new("sem").unwrap();
    let queue = format!("{ns}/lock/%sem/sem/waiters/");
    let ttl = Duration::from_secs(60);
    let holders = connect(&url).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        match holders
            .try_acquire_permit(&k, 2, ttl)
            .await
            .expect("permit")
        {
            AcquireAttempt::Acquired(lease) => held.push(lease),
            AcquireAttempt::Held { .. } => panic!("a free semaphore refused a permit"),
        }
    }
    let lease = raw.lease_grant(60, None).await.expect("lease").id();
    for id in ["1-1", "1-2"] {
        raw.put(
            format!("{queue}{id}"),
            "dl1-waiter",
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .expect("queue entry");
    }
    let (attempts, waiter) = observed(&url).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let waiting = {
        let waiter = waiter.clone();
        let k = k.clone();
        tokio::spawn(async move { waiter.acquire_permit(&k, 2, ttl, deadline).await })
    };
    // Queued, two ahead (it watches the second), its first attempt refused.
    until_in_line(&attempts, 0).await;
    raw.delete(format!("{queue}1-2"), None)
        .await
        .expect("the second leaves");
    // One waiter ahead now: the waiter is among the first two, and the
    // release of a permit must wake it.
    holders.release(&held[0]).await.expect("release");
    let permit = waiting
        .await
        .expect("waiting task")
        .expect("acquire_permit")
        .expect("acquired");
    assert!(
        Instant::now() < deadline,
        "the waiter kept watching the waiter ahead of it: its deadline woke it, not the release"
    );
    waiter.release(&permit).await.expect("release");
    holders.release(&held[1]).await.expect("release");
    raw.lease_revoke(lease).await.expect("revoke");
}

/// The names put below a prefix, recorded by a raw watch of the namespace
/// until [`PutNames::stop`].
struct PutNames {
    task: JoinHandle<Vec<String>>,
    end_marker: String,
}

impl PutNames {
    /// Starts recording the names put below `prefix`, in namespace `ns`.
    async fn record(raw: &mut distlock_etcd::etcd_client::Client, ns: &str, prefix: &str) -> Self {
        use distlock_etcd::etcd_client::{EventType, WatchOptions};
        let end_marker = format!("{ns}/end of test");
        let mut events = raw
            .watch(format!("{ns}/"), Some(WatchOptions::new().with_prefix()))
            .await
            .expect("watch the namespace");
        let task = tokio::spawn({
            let (prefix, end_marker) = (prefix.to_owned(), end_marker.clone());
            async move {
                let mut names = Vec::new();
                while let Some(reply) = events.message().await.expect("watch stream") {
                    for event in reply.events() {
                        let key = event
                            .kv()
                            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned());
                        match (event.event_type(), key) {
                            (_, Some(key)) if key == end_marker => return names,
                            (EventType::Put, Some(key)) => {
                                names.extend(key.strip_prefix(&prefix).map(str::to_owned))
                            }
                            _ => {}
                        }
                    }
                }
                names
            }
        });
        Self { task, end_marker }
    }

    /// Every name put so far (once per put), in order.
    async fn stop(self, raw: &mut distlock_etcd::etcd_client::Client) -> Vec<String> {
        raw.put(self.end_marker.as_str(), "", None)
            .await
            .expect("end marker");
        let names = self.task.await.expect("watch task");
        raw.delete(self.end_marker.as_str(), None)
            .await
            .expect("delete end marker");
        names
    }
}

/// A client's queue entries reuse their names: etcd keeps a deleted key in
/// its index until it compacts, and every read of the line walks them all,
/// so a line whose entries all had new names slowed each join by every
/// wait before it. Five rounds of three waiting calls on one client: the
/// line sees at most six names (three at once, and a round's names may
/// not be free yet when the next begins), where each of its 15 waits had
/// a new one before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_queue_entries_reuse_their_names() {
    let server = any_server();
    let ns = unique_name("names");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let queue = format!("{ns}/lock/reused/waiters/");
    let seen = PutNames::record(&mut raw, &ns, &queue).await;
    let holder = connect(&url).await;
    let waiters = connect(&url).await;
    let k = LockKey::new("reused").unwrap();
    for _ in 0..5 {
        let held = acquire(&holder, &k, Duration::from_secs(30)).await;
        let mut tasks = Vec::new();
        for _ in 0..3 {
            let (client, k) = (waiters.clone(), k.clone());
            tasks.push(tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(30);
                let lease = client
                    .acquire(&k, Duration::from_secs(30), deadline)
                    .await
                    .expect("acquire")
                    .expect("acquired");
                client.release(&lease).await.expect("release");
            }));
        }
        until_queued(&mut raw, &queue, 3).await;
        holder.release(&held).await.expect("release");
        for task in tasks {
            task.await.expect("waiter");
        }
        assert_queue_empties(&mut raw, &queue).await;
    }
    let names = seen.stop(&mut raw).await;
    let distinct: std::collections::BTreeSet<&String> = names.iter().collect();
    assert!(names.len() >= 15, "fewer entries than waits: {names:?}");
    assert!(
        distinct.len() <= 6,
        "{} entry names for {} entries: {distinct:?}",
        distinct.len(),
        names.len()
    );
}

/// A client's permits reuse their names, as its queue entries do: every
/// permit attempt reads the semaphore's whole permits range, which etcd
/// walks with every key it had since it last compacted, so permits named
/// by their owner tokens (a new name each) slowed every attempt by each
/// acquisition before it. Five rounds of a renewing permit (a guard, on
/// the session lease) and a plain one (a lease of its own) held together
/// and released: the semaphore sees two names for its ten permits, where
/// each had a new one before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_permits_reuse_their_names() {
    let server = any_server();
    let ns = unique_name("permit-names");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let permits = format!("{ns}/lock/%sem/reused/permits/");
    let seen = PutNames::record(&mut raw, &ns, &permits).await;
    let client = connect(&url).await;
    let locker = Locker::new(client.clone());
    let k = LockKey::new("reused").unwrap();
    let ttl = Duration::from_secs(30);
    for _ in 0..5 {
        let guard = locker
            .try_lock(&k, &LockOptions::new(ttl).with_permits(2))
            .await
            .expect("a renewing permit")
            .expect("a free permit");
        let plain = match client.try_acquire_permit(&k, 2, ttl).await {
            Ok(AcquireAttempt::Acquired(lease)) => lease,
            other => panic!("a plain permit of a semaphore with room: {other:?}"),
        };
        client.release(&plain).await.expect("release");
        guard.release().await.expect("release the guard");
    }
    let names = seen.stop(&mut raw).await;
    let distinct: std::collections::BTreeSet<&String> = names.iter().collect();
    assert!(
        names.len() >= 10,
        "fewer permits than acquisitions: {names:?}"
    );
    assert!(
        distinct.len() <= 2,
        "{} permit names for {} permits: {distinct:?}",
        distinct.len(),
        names.len()
    );
}

/// Waits until `lease` (just returned, on a lease of its own, left to
/// expire) is gone on the server, nothing left under `prefix`, and past
/// the TTL its client counts from the grant's reply, with its second of
/// slack. `what` names what outlived the lease otherwise.
async fn expired(
    raw: &mut distlock_etcd::etcd_client::Client,
    prefix: &str,
    lease: &Lease,
    what: &str,
) {
    let returned = Instant::now();
    let deadline = returned + Duration::from_secs(60);
    while !keys_under(raw, prefix).await.is_empty() {
        assert!(Instant::now() < deadline, "{what} outlived its lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep_until((returned + lease.ttl() + Duration::from_millis(1_100)).into()).await;
}

/// A permit on a lease of its own that is never released (a raw lease
/// left to expire) gives its name back once its TTL is past: a client that
/// takes permits so, for ever, names no more of them than it holds at once.
#[tokio::test]
async fn a_permit_left_to_expire_gives_its_name_back() {
    let server = any_server();
    let ns = unique_name("permit-expired");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let permits = format!("{ns}/lock/%sem/expiring/permits/");
    let seen = PutNames::record(&mut raw, &ns, &permits).await;
    let client = connect(&url).await;
    let k = LockKey::new("expiring").unwrap();
    for _ in 0..3 {
        let lease = match client
            .try_acquire_permit(&k, 2, Duration::from_secs(1))
            .await
        {
            Ok(AcquireAttempt::Acquired(lease)) => lease,
            other => panic!("a plain permit of a semaphore with room: {other:?}"),
        };
        expired(&mut raw, &permits, &lease, "the permit").await;
    }
    let names = seen.stop(&mut raw).await;
    let distinct: std::collections::BTreeSet<&String> = names.iter().collect();
    // An attempt sent again (no answer in time) puts its name again.
    assert!(names.len() >= 3, "fewer puts than permits: {names:?}");
    assert_eq!(
        distinct.len(),
        1,
        "{} permit names for {} permits, each expired before the next: {distinct:?}",
        distinct.len(),
        names.len()
    );
}

/// The holder's marker of a lock on a lease of its own that is never
/// released (a raw lease left to expire, a guard's hold-at-least) gives
/// the number in its name back once the lease's TTL is past: a client
/// whose waits end in such locks names no more queue entries than it has
/// at once, and keeps no record of each lock for ever.
#[tokio::test]
async fn the_marker_of_a_lock_left_to_expire_gives_its_number_back() {
    let server = any_server();
    let ns = unique_name("marker-expired");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let queue = format!("{ns}/lock/expiring/waiters/");
    let seen = PutNames::record(&mut raw, &ns, &queue).await;
    let (holder, waiter) = (connect(&url).await, connect(&url).await);
    let k = LockKey::new("expiring").unwrap();
    for round in 1..=3 {
        // Free by now: the waiter's lock of the round before expired.
        let held = acquire(&holder, &k, Duration::from_secs(30)).await;
        let waiting = {
            let (waiter, k) = (waiter.clone(), k.clone());
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(60);
                waiter.acquire(&k, Duration::from_secs(1), deadline).await
            })
        };
        until_queued(&mut raw, &queue, 1).await;
        holder.release(&held).await.expect("release");
        let lease = waiting
            .await
            .unwrap()
            .expect("the wait")
            .unwrap_or_else(|| panic!("round {round}: the waiter never took the released lock"));
        // The marker is on the lock's lease.
        expired(&mut raw, &queue, &lease, "the marker").await;
    }
    let names = seen.stop(&mut raw).await;
    // `<session lease>-<number>`, both hex; a marker is its entry put
    // again, under the same name.
    let numbers: std::collections::BTreeSet<&str> = names
        .iter()
        .filter_map(|name| name.rsplit_once('-').map(|(_, number)| number))
        .collect();
    assert!(names.len() >= 3, "fewer puts than waits: {names:?}");
    assert_eq!(
        numbers.len(),
        1,
        "{} entry numbers for 3 waits, each lock expired before the next wait: {names:?}",
        numbers.len()
    );
}

/// A waiting client's places in line live on a session lease of 5 s: a
/// frozen or crashed client's entries go within 5 s (a woken waiter's
/// turn on the other backends), and each waiting client keeps its lease
/// alive 0.6 times a second. Its entries went on the shortest lease (1 s
/// on this etcd), which every waiting client kept alive three times a
/// second whatever the handoff rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_clients_queue_entries_live_on_a_five_second_lease() {
    let server = any_server();
    let ns = unique_name("waiter-lease");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let k = LockKey::new("waiter-lease").unwrap();
    let queue = format!("{ns}/lock/waiter-lease/waiters/");
    let held = acquire(&holder, &k, Duration::from_secs(30)).await;
    let waiter = connect(&url).await;
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            waiter.acquire(&k, Duration::from_secs(30), deadline).await
        })
    };
    until_queued(&mut raw, &queue, 1).await;
    let entries = raw
        .get(
            queue.as_str(),
            Some(distlock_etcd::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("read the queue");
    let lease = entries.kvs()[0].lease();
    assert_ne!(lease, 0, "a queue entry must live on a lease");
    let granted = raw
        .lease_time_to_live(lease, None)
        .await
        .expect("read the entry's lease")
        .granted_ttl();
    assert_eq!(
        granted, 5,
        "a waiting client's queue entry lives on a lease of {granted} s, not 5 s"
    );
    holder.release(&held).await.expect("release");
    let lease = served(waiting).await;
    waiter.release(&lease).await.expect("release");
    common::delete_prefix(&mut raw, &ns).await;
}

/// A client dropped as its wait is cancelled takes its queue entries with
/// it: their session lease (queue entries alone go on it) is revoked,
/// rather than left to hold up the line until it expires (the waiter's
/// task holds the client weakly, so it may not get to delete its entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_clients_queue_entry_lease_is_revoked() {
    let server = own_server();
    let ns = unique_name("dropped-waiter");
    let url = format!("{}?namespace={ns}", server.url());
    let mut raw = raw_client(&server.url()).await;
    let holder = connect(&url).await;
    let k = LockKey::new("dropped-waiter").unwrap();
    let queue = format!("{ns}/lock/dropped-waiter/waiters/");
    let _held = acquire(&holder, &k, Duration::from_secs(60)).await;
    let waiter = connect(&url).await;
    let waiting = {
        let (locker, k) = (Locker::new(waiter.clone()), k.clone());
        tokio::spawn(async move {
            let options =
                LockOptions::new(Duration::from_secs(30)).with_wait(Duration::from_secs(60));
            locker.acquire(&k, &options).await
        })
    };
    until_queued(&mut raw, &queue, 1).await;
    let revoked = |counts: &BTreeMap<String, u64>| counts.get("LeaseRevoke").copied().unwrap_or(0);
    let before = revoked(&grpc_started(server.addr()).await);
    waiting.abort();
    let _ = waiting.await;
    drop(waiter);
    let give_up = Instant::now() + Duration::from_secs(30);
    while revoked(&grpc_started(server.addr()).await) == before {
        assert!(
            Instant::now() < give_up,
            "a client dropped with its wait cancelled left its queue entries' lease to expire"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    until_queued(&mut raw, &queue, 0).await;
}
