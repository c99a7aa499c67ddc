//! The raw driver's one-key crowd on etcd (issue 28, target 7): etcd's own
//! FIFO lock recipe (as its `concurrency` package's mutex), with nothing
//! but what the recipe needs, beside the library's crowd in the same run.
//!
//! Each task has a key of its own below one prefix (reused, so the range
//! gains no dead keys), on one lease granted before. To take the lock it
//! puts its key and, in the same transaction, reads the two newest keys of
//! the prefix (itself and the one before it, a read sorted by create
//! revision); it holds the lock when that one is deleted, which one watch
//! of the prefix reports, and releases by deleting its key. A handoff is
//! two writes (the release, and the releasing task's join when it asks
//! again) and one watch event: nothing re-checks, no waiter leaves, no
//! lock key apart from the line, no `try_lock` to keep out. If this floor
//! misses the rate target, no etcd lock can meet it on this machine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::etcd::etcd_client::{
    Client as EtcdClient, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use tokio::sync::oneshot;

use crate::crowd::HoldClock;
use crate::plan::BenchResult;
use crate::servers::Server;

/// What the raw crowd measured.
pub struct RawCrowd {
    /// Acquisitions returned by the deadline.
    pub handoffs: usize,
    /// Holders that overlapped (the recipe is exclusive: must be 0).
    pub overlaps: usize,
}

/// Who waits for which key's deletion, and the last deletion of each key.
#[derive(Default)]
struct Deletions {
    /// Key -> (the waiter's own create revision, its wake-up).
    waiting: HashMap<Vec<u8>, (i64, oneshot::Sender<()>)>,
    /// Key -> revision of its last deletion.
    last: HashMap<Vec<u8>, i64>,
}

impl Deletions {
    /// Wakes whoever waits for `key`'s deletion at `revision`.
    fn deleted(&mut self, key: &[u8], revision: i64) {
        self.last.insert(key.to_vec(), revision);
        if self
            .waiting
            .get(key)
            .is_some_and(|(after, _)| revision > *after)
        {
            if let Some((_, wake)) = self.waiting.remove(key) {
                let _ = wake.send(());
            }
        }
    }

    /// A wake-up for `key`'s first deletion after `revision` (at once if
    /// it happened already).
    fn wait(&mut self, key: &[u8], revision: i64) -> oneshot::Receiver<()> {
        let (wake, woken) = oneshot::channel();
        if self.last.get(key).is_some_and(|at| *at > revision) {
            let _ = wake.send(());
        } else {
            self.waiting.insert(key.to_vec(), (revision, wake));
        }
        woken
    }
}

/// Runs `tasks` tasks of the recipe on one key for `duration`, each
/// holding `hold`.
pub async fn etcd(
    server: &Server,
    tasks: usize,
    hold: Duration,
    duration: Duration,
) -> BenchResult<RawCrowd> {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let port = server.port().unwrap_or(0);
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(30));
    let mut client = EtcdClient::connect([format!("http://127.0.0.1:{port}")], Some(options))
        .await
        .map_err(|e| e.to_string())?;
    let prefix = format!(
        "rawbench/crowd/{}-{}/",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    );
    let lease = client
        .lease_grant(
            i64::try_from(duration.as_secs()).unwrap_or(60) * 4 + 60,
            None,
        )
        .await
        .map_err(|e| e.to_string())?
        .id();
    let deletions = Arc::new(Mutex::new(Deletions::default()));
    let mut events = client
        .watch(prefix.as_str(), Some(WatchOptions::new().with_prefix()))
        .await
        .map_err(|e| e.to_string())?;
    // Its first answer says it was created: every deletion from now on is
    // reported.
    events.message().await.map_err(|e| e.to_string())?;
    let dispatcher = {
        let deletions = deletions.clone();
        tokio::spawn(async move {
            while let Ok(Some(reply)) = events.message().await {
                let mut deletions = deletions.lock().unwrap_or_else(|e| e.into_inner());
                for event in reply.events() {
                    if let (EventType::Delete, Some(kv)) = (event.event_type(), event.kv()) {
                        deletions.deleted(kv.key(), kv.mod_revision());
                    }
                }
            }
        })
    };
    let held = Arc::new(AtomicBool::new(false));
    let hold_clock = Arc::new(HoldClock::default());
    let deadline = Instant::now() + duration;
    let mut handles = Vec::new();
    for task in 0..tasks {
        let mut kv = client.kv_client();
        let key = format!("{prefix}{task:04x}");
        let (prefix, deletions, held, hold_clock) = (
            prefix.clone(),
            deletions.clone(),
            held.clone(),
            hold_clock.clone(),
        );
        handles.push(tokio::spawn(async move {
            let join = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(key.as_str(), "", Some(PutOptions::new().with_lease(lease))),
                    TxnOp::get(
                        prefix.as_str(),
                        Some(
                            GetOptions::new()
                                .with_prefix()
                                .with_sort(SortTarget::Create, SortOrder::Descend)
                                .with_limit(2),
                        ),
                    ),
                ]);
            let (mut handoffs, mut overlaps) = (0usize, 0usize);
            while Instant::now() < deadline {
                let reply = kv.txn(join.clone()).await.map_err(|e| e.to_string())?;
                if !reply.succeeded() {
                    return Err(format!("raw crowd: {key} was still there"));
                }
                let mine = reply.header().map_or(0, |h| h.revision());
                let before = reply.op_responses().into_iter().find_map(|op| match op {
                    TxnOpResponse::Get(get) => get
                        .kvs()
                        .iter()
                        .find(|kv| kv.create_revision() < mine)
                        .map(|kv| kv.key().to_vec()),
                    _ => None,
                });
                if let Some(before) = before {
                    let woken = deletions
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .wait(&before, mine);
                    woken
                        .await
                        .map_err(|_| "raw crowd: the watch ended".to_owned())?;
                }
                let acquired = Instant::now();
                if held.swap(true, Ordering::SeqCst) {
                    overlaps += 1;
                }
                if acquired <= deadline {
                    handoffs += 1;
                }
                hold_clock.hold(acquired, hold).await;
                held.store(false, Ordering::SeqCst);
                kv.delete(key.as_str(), None)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok::<_, String>((handoffs, overlaps))
        }));
    }
    let mut out = RawCrowd {
        handoffs: 0,
        overlaps: 0,
    };
    for handle in handles {
        let (handoffs, overlaps) = handle.await.map_err(|e| e.to_string())??;
        out.handoffs += handoffs;
        out.overlaps += overlaps;
    }
    dispatcher.abort();
    let _ = client.lease_revoke(lease).await;
    Ok(out)
}
