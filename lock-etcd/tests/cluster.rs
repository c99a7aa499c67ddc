//! Faults of a 3-member etcd cluster, each test on a cluster of
//! its own: the leader SIGKILLed while guards hold and waiters wait, one
//! member cut off from the client, the whole cluster down longer than the
//! TTL. Throughout: no two holders overlap, fencing tokens grow, a guard
//! keeps its lock or reports `lost()` before anyone else gets it, waiters
//! get the lock once a leader exists again, and the client uses the other
//! members.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::checker::ExclusionChecker;
use distlock_conformance::fault::Proxy;
use distlock_conformance::server::EtcdCluster;
use distlock_core::{
    AcquireAttempt, ErrorKind, FencingToken, LockError, LockKey, LockOptions, Locker, LostReason,
};
use tokio::sync::oneshot;

use common::{connect, unique_key};

/// Guards' TTL. Renewed every third of it and stopped a third before it
/// ends, a guard rides through an election (about a second with the
/// harness's 500 ms election timeout) if its renewals get through within
/// about three seconds; if not, it reports `lost()`, which is allowed.
const TTL: Duration = Duration::from_secs(5);

/// How long waiters may wait: far beyond any election or restart here.
const WAIT: Duration = Duration::from_secs(60);

async fn start_cluster() -> Arc<EtcdCluster> {
    tokio::task::spawn_blocking(|| EtcdCluster::start(3))
        .await
        .expect("cluster start task")
        .map(Arc::new)
        .expect("a 3-member etcd cluster must start")
}

/// Kills the current leader; returns its index once another member leads.
async fn kill_leader(cluster: &Arc<EtcdCluster>) -> usize {
    let cluster = cluster.clone();
    tokio::task::spawn_blocking(move || {
        let leader = cluster.wait_for_leader().expect("a leader");
        cluster.member(leader).kill();
        leader
    })
    .await
    .expect("kill task")
}

async fn restart(cluster: &Arc<EtcdCluster>, member: usize) {
    let cluster = cluster.clone();
    tokio::task::spawn_blocking(move || cluster.member(member).restart())
        .await
        .expect("restart task")
        .expect("the member restarts");
}

/// How a holder's guard ended.
#[derive(Debug)]
enum HolderEnd {
    Released(Result<(), LockError>),
    Lost(LostReason),
}

/// A guard held in a task, its critical section recorded until it is
/// released (on the signal) or lost.
struct Holder {
    token: FencingToken,
    release: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<HolderEnd>,
}

impl Holder {
    async fn take(
        url: &str,
        key: &LockKey,
        ttl: Duration,
        checker: &Arc<ExclusionChecker>,
    ) -> Holder {
        let locker = Locker::new(connect(url).await);
        let guard = locker
            .try_lock(key, &LockOptions::new(ttl))
            .await
            .expect("try_lock")
            .expect("the key is free");
        let token = guard.fencing_token();
        let (release, released) = oneshot::channel::<()>();
        let (checker, key) = (checker.clone(), key.clone());
        let task = tokio::spawn(async move {
            let section = checker.enter(&key, guard.fencing_token());
            tokio::select! {
                reason = guard.lost() => {
                    section.exit();
                    HolderEnd::Lost(reason)
                }
                _ = released => {
                    section.exit();
                    HolderEnd::Released(guard.release().await)
                }
            }
        });
        Holder {
            token,
            release,
            task,
        }
    }

    /// Releases (or finds it lost); an error other than "not held" fails.
    async fn end(self) -> HolderEnd {
        let _ = self.release.send(());
        let end = self.task.await.expect("holder task");
        if let HolderEnd::Released(Err(e)) = &end {
            assert_eq!(e.kind(), ErrorKind::NotHeld, "release failed: {e}");
        }
        end
    }
}

/// A waiting acquire in a task: it must get the lock (no error, no
/// timeout), then runs a short critical section and releases.
fn waiter(
    url: &str,
    key: &LockKey,
    checker: &Arc<ExclusionChecker>,
) -> tokio::task::JoinHandle<FencingToken> {
    let (url, key, checker) = (url.to_owned(), key.clone(), checker.clone());
    tokio::spawn(async move {
        let locker = Locker::new(connect(&url).await);
        let guard = locker
            .acquire(&key, &LockOptions::new(TTL).with_wait(WAIT))
            .await
            .unwrap_or_else(|e| panic!("a waiting acquire failed before its deadline: {e}"))
            .expect("the waiter got the lock before its deadline");
        let token = guard.fencing_token();
        let mut section = checker.enter(&key, token);
        section.increment().await;
        tokio::select! {
            _ = guard.lost() => {}
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        section.exit();
        if let Err(e) = guard.release().await {
            assert_eq!(e.kind(), ErrorKind::NotHeld, "release failed: {e}");
        }
        token
    })
}

/// Exclusion held and tokens grew on every key; every waiter's token is
/// above its key's first holder's.
fn verify(
    checker: &ExclusionChecker,
    firsts: &[(LockKey, FencingToken)],
    got: &[(LockKey, FencingToken)],
) {
    let report = checker.verify().expect("no overlap, fencing tokens grow");
    assert!(report.sections >= firsts.len() + got.len());
    for (key, token) in got {
        let first = firsts
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| *t)
            .expect("a first holder");
        assert!(
            *token > first,
            "{key}: waiter's token {token} after {first}"
        );
    }
}

/// The leader SIGKILLed while guards hold locks and waiters wait: guards
/// ride through (renewing on the new leader) or report lost first; a
/// release sent during the election frees the key (it used to fail with
/// the request lost with the leader, leaving the lock to its TTL);
/// waiting acquires get the lock without an error; the killed member
/// comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_killed_while_guards_hold_and_waiters_wait() {
    let cluster = start_cluster().await;
    let url = cluster.url();
    let checker = ExclusionChecker::new();
    let waited: Vec<LockKey> = (0..2).map(|_| unique_key("leader-kill-waited")).collect();
    let released: Vec<LockKey> = (0..3).map(|_| unique_key("leader-kill-released")).collect();
    let mut holders = Vec::new();
    for k in waited.iter().chain(&released) {
        holders.push((k.clone(), Holder::take(&url, k, TTL, &checker).await));
    }
    let firsts: Vec<(LockKey, FencingToken)> =
        holders.iter().map(|(k, h)| (k.clone(), h.token)).collect();
    let waiters: Vec<_> = waited
        .iter()
        .flat_map(|k| [k, k])
        .map(|k| (k.clone(), waiter(&url, k, &checker)))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let killed = kill_leader(&cluster).await;
    let other = connect(&url).await;
    let (now, later): (Vec<_>, Vec<_>) =
        holders.into_iter().partition(|(k, _)| released.contains(k));
    for (k, holder) in now {
        if let HolderEnd::Lost(reason) = holder.end().await {
            panic!("{k} was lost before its release: {reason}");
        }
        // Released: nothing of that lock is left on the cluster.
        match other.try_acquire(&k, TTL).await.expect("try_acquire") {
            AcquireAttempt::Acquired(lease) => other.release(&lease).await.expect("release"),
            AcquireAttempt::Held { .. } => panic!("{k} still held after its release returned"),
        }
    }
    // The others hold on through the election.
    tokio::time::sleep(TTL).await;
    let mut kept = 0;
    for (_, holder) in later {
        if matches!(holder.end().await, HolderEnd::Released(Ok(()))) {
            kept += 1;
        }
    }
    let mut got = Vec::new();
    for (k, task) in waiters {
        got.push((k, task.await.expect("waiter task")));
    }
    restart(&cluster, killed).await;
    verify(&checker, &firsts, &got);
    eprintln!(
        "guards that kept their lock through the election: {kept} of {}",
        waited.len()
    );
}

/// One member cut off from the client (a fault proxy in front of its
/// endpoint black-holes everything, open connections and new ones): the
/// guard keeps its lock or reports lost first, the waiters get it, and
/// new clients connect and take and release locks through the other
/// members.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn member_cut_off_from_the_client() {
    let cluster = start_cluster().await;
    let proxy = Proxy::start(cluster.member(0).addr())
        .await
        .expect("fault proxy");
    let url = format!(
        "etcd://{},{},{}",
        proxy.addr(),
        cluster.member(1).addr(),
        cluster.member(2).addr()
    );
    let checker = ExclusionChecker::new();
    let k = unique_key("cut-off");
    // Its keep-alives and renewals may go to the cut-off member at first
    // and must be sent again elsewhere before the lock's stop moment: a
    // TTL of 15 s leaves ten seconds for that.
    let holder = Holder::take(&url, &k, Duration::from_secs(15), &checker).await;
    let firsts = [(k.clone(), holder.token)];
    let waiters: Vec<_> = (0..2).map(|_| waiter(&url, &k, &checker)).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    proxy.black_hole();
    for _ in 0..3 {
        let client = connect(&url).await;
        let fresh = unique_key("cut-off-fresh");
        match client.try_acquire(&fresh, TTL).await.expect("try_acquire") {
            AcquireAttempt::Acquired(lease) => client.release(&lease).await.expect("release"),
            AcquireAttempt::Held { .. } => panic!("{fresh} is new, yet held"),
        }
    }
    let end = holder.end().await;
    let mut got = Vec::new();
    for task in waiters {
        got.push((k.clone(), task.await.expect("waiter task")));
    }
    proxy.heal();
    verify(&checker, &firsts, &got);
    eprintln!("the guard through the cut: {end:?}");
}

/// The whole cluster down for longer than the TTL: the guard, unable to
/// renew, reports `lost()` (before anyone else can get the lock); the
/// waiting acquires ride through the outage and get the lock once the
/// cluster is back, with fencing tokens above the old holder's (etcd's
/// revision survives the restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_cluster_down_longer_than_the_ttl() {
    let cluster = start_cluster().await;
    let url = cluster.url();
    let checker = ExclusionChecker::new();
    let k = unique_key("cluster-down");
    let ttl = Duration::from_secs(2);
    let holder = Holder::take(&url, &k, ttl, &checker).await;
    let firsts = [(k.clone(), holder.token)];
    let waiters: Vec<_> = (0..2).map(|_| waiter(&url, &k, &checker)).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let down = cluster.clone();
    tokio::task::spawn_blocking(move || down.kill_all())
        .await
        .expect("kill task");
    let killed_at = Instant::now();
    // Hang guard only: the guard must give up on its own.
    let end = tokio::time::timeout(Duration::from_secs(60), holder.task)
        .await
        .expect("the guard reported nothing with the cluster down")
        .expect("holder task");
    assert!(
        matches!(end, HolderEnd::Lost(_)),
        "the guard kept a lock it could not renew: {end:?}"
    );
    tokio::time::sleep((ttl * 2).saturating_sub(killed_at.elapsed())).await;
    let up = cluster.clone();
    tokio::task::spawn_blocking(move || up.restart_stopped())
        .await
        .expect("restart task")
        .expect("the cluster restarts");
    let mut got = Vec::new();
    for task in waiters {
        got.push((k.clone(), task.await.expect("waiter task")));
    }
    verify(&checker, &firsts, &got);
}
