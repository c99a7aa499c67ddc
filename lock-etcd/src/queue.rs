//! FIFO wake-up of waiters (etcd's Go `concurrency.Mutex` recipe): each
//! waiting call queues, and only the first in line watches the lock.
//!
//! A semaphore's waiters ([`Line::Permits`]) queue the same way under the
//! semaphore's own prefix, with one difference: its first `limit` waiters
//! (the limit stored with its permits) all count as first and watch
//! deletions below its permits prefix, so up to `limit` of them take
//! permits at once; "free" is fewer than `limit` permits. A release wakes
//! those waiters only, never the whole line.
//!
//! [`enqueue`] (the backend's `watch`) puts a queue entry
//! `NS/lock/<escaped key>/waiters/<waiter id>` on the client's short session
//! lease, so a crashed client's entries vanish with its lease. Its
//! `create_revision` is its place in line. In the same transaction it reads
//! the entry with the greatest create revision below its own — its
//! predecessor — and whether the lock key exists. A waiter with a
//! predecessor watches only that entry's deletion; the first in line
//! watches the lock key's deletion (a release, a force release, or the
//! holder's lease expiring). Every watch starts just after the revision the
//! transaction read, so nothing in between is missed.
//!
//! A background task per waiter moves it up the line: when its predecessor
//! leaves, one transaction finds the next predecessor (or none: it is first
//! now) and reads the lock key. The waiter's [`ReleaseWatch`] — on a channel
//! of its own, so exactly one waiter is woken — fires only when it is first
//! and the lock key was deleted, or when it just became first and the lock
//! is free. A handoff therefore costs a constant number of requests however
//! many wait: the release, the next waiter's acquire, the leaving waiter's
//! queue-entry delete and its successor's look-up.
//!
//! The caller's channel lives in a
//! [`ReleaseNotifier`](distlock_core::ReleaseNotifier) of the queue's own,
//! not in the watch listener's: when the watch stream is lost, the listener
//! fails the *task's* watch, and the task looks its place up again (one
//! transaction) and watches from the revision it read, waking the caller
//! if it is first and the lock is free (a release may have happened while
//! the stream was down). The caller keeps its place in line, and waiters
//! that leave during the reconnect change nothing for the others.
//!
//! When the waiting call ends (acquired, deadline, or its future dropped)
//! its [`ReleaseWatch`] is dropped; the task learns it at once
//! ([`ReleaseNotifier::closed`](distlock_core::ReleaseNotifier::closed)) and deletes the queue entry in the
//! background, so the successor moves up. A woken first waiter that finds
//! the lock taken (another client acquired without queueing) stays first
//! and keeps watching the lock key.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::{ErrorKind, LockError, LockKey, ReleaseWatch};
use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp};
use etcd_client::{TxnOpResponse, TxnResponse};
use tokio::sync::oneshot;

use crate::backend::{EtcdLock, Inner, MIN_TTL};
use crate::errors::Repeat;
use crate::fence::Fence;
use crate::keys::KeyLayout;
use crate::listener::Topic;
use crate::session::Session;
use crate::txn;

/// Pauses between retries of a failed look-up or entry delete.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// The value of a queue entry (only its key and revisions matter).
const ENTRY_VALUE: &[u8] = b"dl1-waiter";

/// What one queue transaction read, at revision `revision`.
struct Position {
    /// The header revision: the state the reads saw.
    revision: i64,
    /// The queue entry just before ours, if any.
    predecessor: Option<Vec<u8>>,
    /// Whether what the line waits for is taken (the lock key exists, or
    /// every permit is).
    held: bool,
    /// Whether our own entry exists.
    queued: bool,
}

/// One waiting call's place in the queue of one lock key.
struct Waiter {
    client: Weak<Inner>,
    line: Line,
    /// Our queue entry's etcd key.
    entry: Vec<u8>,
    /// Its create revision: our place in line.
    place: i64,
    /// The channel of the caller's [`ReleaseWatch`].
    channel: String,
    /// Numbers the channels of our own watches (one per watched target).
    watches: u64,
    /// The etcd key watched now (predecessor entry or lock key) and the
    /// subscription.
    target: Vec<u8>,
    watch: ReleaseWatch,
    /// The watch was lost with its stream: replace it at the next look-up.
    stale: bool,
    /// Fences of re-queueing puts whose outcome is unknown: put up with
    /// the entry's final delete.
    fences: Vec<Fence>,
}

/// What a waiter queue waits for.
#[derive(Debug, Clone)]
pub(crate) enum Line {
    /// The lock on a key: the first in line watches the lock key.
    Lock(LockKey),
    /// A permit of a key's semaphore: the first in line watches deletions
    /// of its permits (a release, or a permit's lease running out).
    Permits(LockKey),
}

impl Line {
    pub(crate) fn key(&self) -> &LockKey {
        match self {
            Line::Lock(key) | Line::Permits(key) => key,
        }
    }

    fn what(&self) -> &'static str {
        match self {
            Line::Lock(_) => "lock",
            Line::Permits(_) => "semaphore",
        }
    }

    /// The etcd key the fences of queue entries go below.
    fn base(&self, layout: &KeyLayout) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.lock_key(key),
            Line::Permits(key) => layout.semaphore_base(key),
        }
    }

    fn queue_prefix(&self, layout: &KeyLayout) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.queue_prefix(key),
            Line::Permits(key) => layout.permit_queue_prefix(key),
        }
    }

    fn entry(&self, layout: &KeyLayout, waiter_id: &str) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.queue_entry(key, waiter_id),
            Line::Permits(_) => {
                let mut entry = self.queue_prefix(layout);
                entry.extend_from_slice(waiter_id.as_bytes());
                entry
            }
        }
    }

    /// What the first in line watches: the lock key, or the prefix of the
    /// semaphore's permits.
    fn held_target(&self, layout: &KeyLayout) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.lock_key(key),
            Line::Permits(key) => layout.permits_prefix(key),
        }
    }

    fn is_held_target(&self, layout: &KeyLayout, target: &[u8]) -> bool {
        self.held_target(layout) == target
    }

    /// The read that tells whether what the line waits for is taken.
    fn read_held(&self, layout: &KeyLayout) -> TxnOp {
        match self {
            Line::Lock(key) => TxnOp::get(
                layout.lock_key(key),
                Some(GetOptions::new().with_keys_only()),
            ),
            Line::Permits(key) => TxnOp::get(
                layout.permits_prefix(key),
                Some(GetOptions::new().with_prefix()),
            ),
        }
    }

    /// The queue entry a waiter watches, given its `predecessor` and how
    /// many wait `ahead` of it: a semaphore's first `limit` waiters all
    /// watch its permits (`None`, as the first in a lock's line), so a
    /// release wakes one of them while the others still hold theirs, and
    /// up to `limit` waiters take permits at once; the ones after them
    /// watch their predecessor. Before any permit exists (no limit
    /// stored) every waiter may try.
    fn to_watch(
        &self,
        predecessor: Option<Vec<u8>>,
        ahead: Option<i64>,
        permits: Option<&Vec<KeyValue>>,
    ) -> Option<Vec<u8>> {
        let Line::Permits(_) = self else {
            return predecessor;
        };
        let window = crate::semaphore::stored_limit(permits.map_or(&[][..], Vec::as_slice));
        match (ahead, window) {
            (Some(ahead), Some(window)) if ahead >= i64::from(window) => predecessor,
            _ => None,
        }
    }

    /// Whether [`read_held`](Self::read_held) found it taken.
    fn held(&self, found: Option<&Vec<KeyValue>>) -> bool {
        let found = found.map_or(&[][..], Vec::as_slice);
        match self {
            Line::Lock(_) => !found.is_empty(),
            Line::Permits(_) => crate::semaphore::all_taken(found),
        }
    }
}

/// Queues a waiter on `key` and returns the watch that wakes it; the queue
/// entry is written and its etcd watch is live when this returns.
///
/// Cancel-safe: the entry is written and watched by a task of its own, so
/// dropping this future at any point leaves nothing behind. The task then
/// finds the caller's watch gone and deletes the entry. A put whose
/// outcome is unknown is fenced (see [`crate::fence`]): its delete puts
/// the fence up in the same transaction, so the put, applied after it,
/// writes nothing (a plain delete could be applied first and leave the
/// entry on the session lease for as long as the client lives).
pub(crate) async fn enqueue(lock: &EtcdLock, line: Line) -> Result<ReleaseWatch, LockError> {
    let inner = &lock.inner;
    let waiter = inner.next_waiter.fetch_add(1, Ordering::Relaxed);
    let channel = format!("{}#{waiter}", line.key().as_str());
    // Registered first: whatever the task notifies from now on is kept.
    let caller = inner
        .waiting
        .subscribe(&channel, || async { Ok(()) })
        .await?;
    let (joined, on_joined) = oneshot::channel();
    tokio::spawn(join(lock.clone(), line, channel, waiter, joined));
    match on_joined.await {
        Ok(result) => result.map(|()| caller),
        Err(_) => Err(LockError::unavailable(
            "the etcd waiter task stopped before it joined the queue (is the runtime shutting down?)",
        )),
    }
}

/// Writes the queue entry, watches the predecessor (or the lock), reports
/// on `joined`, then moves the waiter up the line until it leaves.
async fn join(
    lock: EtcdLock,
    line: Line,
    channel: String,
    waiter: u64,
    joined: oneshot::Sender<Result<(), LockError>>,
) {
    let inner = &lock.inner;
    // Unique in the cluster: the entry lives on this session lease, whose
    // id etcd never hands out twice, and the number is unique per client.
    // Session and entry share one operation timeout.
    let deadline = inner.requests.deadline();
    let session = match lock.session(MIN_TTL, deadline).await {
        Ok(session) => session,
        Err(e) => {
            let _ = joined.send(Err(e));
            return;
        }
    };
    let waiter_id = format!("{:x}-{waiter:x}", session.lease_id());
    let entry = line.entry(&inner.layout, &waiter_id);
    let fence = Fence::new(&line.base(&inner.layout), session.lease_id());
    let placed = match put_entry(&lock, &line, &entry, &session, &fence, deadline).await {
        Ok(placed) => placed,
        Err(e) => {
            // The put may have happened, or may still happen: take it out
            // again with its fence up, so a late put writes nothing.
            delete_later(Arc::downgrade(inner), entry, vec![fence]);
            let _ = joined.send(Err(e));
            return;
        }
    };
    let (place, position) = placed;
    let (target, start) = target_of(&lock, &line, &position);
    let first_watch = format!("{channel}#0");
    let watch = match watch_target(&lock, &line, first_watch, &target, start).await {
        Ok(watch) => watch,
        Err(e) => {
            delete_later(Arc::downgrade(inner), entry, Vec::new());
            let _ = joined.send(Err(e));
            return;
        }
    };
    tracing::trace!(key = %line.key(), place, first = position.predecessor.is_none(), "etcd waiter queued");
    let waiter = Waiter {
        client: Arc::downgrade(inner),
        line,
        entry,
        place,
        channel,
        watches: 1,
        target,
        watch,
        stale: false,
        fences: Vec::new(),
    };
    drop(lock);
    // The caller tries right after this, so a free lock needs no wake-up
    // here. If the caller is gone, `run` finds its watch dropped and
    // deletes the entry at once.
    let _ = joined.send(Ok(()));
    waiter.run().await;
}

/// Watches deletions of `target` from revision `start` on channel
/// `channel` (every key below it if it is the permits prefix the first in
/// a semaphore's line watches); the etcd watch is confirmed when this
/// returns.
async fn watch_target(
    lock: &EtcdLock,
    line: &Line,
    channel: String,
    target: &[u8],
    start: i64,
) -> Result<ReleaseWatch, LockError> {
    let prefix =
        matches!(line, Line::Permits(_)) && line.is_held_target(&lock.inner.layout, target);
    lock.inner
        .listener
        .watch(Topic {
            channel,
            key: target.to_vec(),
            prefix,
            start_revision: start,
        })
        .await
}

/// The etcd key to watch from `position`, and the revision to watch from.
fn target_of(lock: &EtcdLock, line: &Line, position: &Position) -> (Vec<u8>, i64) {
    let target = position
        .predecessor
        .clone()
        .unwrap_or_else(|| line.held_target(&lock.inner.layout));
    (target, position.revision.saturating_add(1))
}

/// Reads of the predecessor of a waiter at create revision below `below`
/// (0: any), of what the line waits for, and (a semaphore's line) of how
/// many wait before it (with `below` 0: every waiter, itself included).
fn reads(lock: &EtcdLock, line: &Line, below: i64, limit: i64) -> Vec<TxnOp> {
    let layout = &lock.inner.layout;
    let before = |options: GetOptions| {
        if below > 0 {
            options.with_max_create_revision(below - 1)
        } else {
            options
        }
    };
    let queue = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_limit(limit);
    let mut reads = vec![
        TxnOp::get(line.queue_prefix(layout), Some(before(queue))),
        line.read_held(layout),
    ];
    if matches!(line, Line::Permits(_)) {
        let count = GetOptions::new().with_prefix().with_count_only();
        reads.push(TxnOp::get(line.queue_prefix(layout), Some(before(count))));
    }
    reads
}

/// The count the `index`th read of a reply found.
fn count_at(reply: &TxnResponse, index: usize) -> Option<i64> {
    reply
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.count()),
            _ => None,
        })
        .nth(index)
}

fn ranges(reply: &TxnResponse) -> Vec<Vec<KeyValue>> {
    reply
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().to_vec()),
            _ => None,
        })
        .collect()
}

fn revision_of(reply: &TxnResponse) -> Result<i64, LockError> {
    reply
        .header()
        .map(|h| h.revision())
        .filter(|r| *r > 0)
        .ok_or_else(|| LockError::unavailable("etcd answered a queue transaction without revision"))
}

/// Writes our queue entry on the client's session lease `session` (fenced
/// by `fence`, on that lease) and reads our
/// predecessor and the lock key, in one transaction. Returns our place
/// (the entry's create revision) and what was read.
async fn put_entry(
    lock: &EtcdLock,
    line: &Line,
    entry: &[u8],
    session: &Session,
    fence: &Fence,
    deadline: std::time::Instant,
) -> Result<(i64, Position), LockError> {
    let txn = txn::enqueue(
        entry,
        ENTRY_VALUE,
        session.lease_id(),
        fence,
        reads(lock, line, 0, 2),
    );
    let reply = lock
        .run_txn_until(deadline, "etcd queue waiter", Repeat::IfUnapplied, txn)
        .await?;
    if !reply.succeeded() {
        return Err(LockError::unavailable(
            "etcd refused a queue entry whose request was given up",
        ));
    }
    let revision = revision_of(&reply)?;
    // The put is the transaction's only write: its revision is ours.
    let place = revision;
    let ranges = ranges(&reply);
    check_entries(lock, line, ranges.first())?;
    // Newest first; skip our own entry (whether or not the read saw it).
    let predecessor = ranges
        .first()
        .and_then(|kvs| {
            kvs.iter()
                .find(|kv| kv.key() != entry && kv.create_revision() < place)
        })
        .map(|kv| kv.key().to_vec());
    // The count saw our own entry too.
    let ahead = count_at(&reply, 2).map(|count| count - 1);
    let predecessor = line.to_watch(predecessor, ahead, ranges.get(1));
    let held = line.held(ranges.get(1));
    Ok((
        place,
        Position {
            revision,
            predecessor,
            held,
            queued: true,
        },
    ))
}

/// Refuses queue entries distlock did not write (a key not named
/// `<session lease>-<number>` in hex, another value, or no lease): obeying
/// one would stall every waiter behind it, and deleting it would destroy
/// data that is not ours.
fn check_entries(
    lock: &EtcdLock,
    line: &Line,
    kvs: Option<&Vec<KeyValue>>,
) -> Result<(), LockError> {
    let prefix = line.queue_prefix(&lock.inner.layout);
    for kv in kvs.into_iter().flatten() {
        let id = kv.key().strip_prefix(prefix.as_slice()).unwrap_or_default();
        if kv.value() != ENTRY_VALUE || kv.lease() == 0 || !is_waiter_id(id) {
            return Err(LockError::corrupted(format!(
                "the etcd waiter queue of {} {:?} holds a key distlock did not write ({:?}); it was left untouched — remove it or use another namespace",
                line.what(),
                line.key().as_str(),
                String::from_utf8_lossy(kv.key())
            )));
        }
    }
    Ok(())
}

/// Whether `id` is `<hex>-<hex>`, as the waiter ids distlock writes.
fn is_waiter_id(id: &[u8]) -> bool {
    let hex = |part: &[u8]| {
        !part.is_empty()
            && part
                .iter()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    let mut parts = id.split(|b| *b == b'-');
    matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None) if hex(a) && hex(b))
}

/// Deletes a queue entry in the background, retrying (each attempt under
/// the operation timeout) while the client lives; a dropped client's
/// entries go with its session lease.
fn delete_later(client: Weak<Inner>, entry: Vec<u8>, fences: Vec<Fence>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(delete_entry(client, entry, fences));
}

/// Deletes a queue entry and puts up `fences` (of its puts whose outcome
/// is unknown) in one transaction, retrying while the client lives.
async fn delete_entry(client: Weak<Inner>, entry: Vec<u8>, fences: Vec<Fence>) {
    let txn = txn::dequeue(&entry, &fences);
    let mut pause = RETRY_MIN;
    loop {
        let Some(inner) = client.upgrade() else {
            return;
        };
        let kv = &inner.kv;
        let result = inner
            .requests
            .send("etcd dequeue waiter", Repeat::Safe, || {
                let mut kv = kv.clone();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            })
            .await;
        drop(inner);
        match result {
            Ok(_) => return,
            Err(e) => {
                tracing::debug!(error = %e, "could not delete an etcd queue entry; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RETRY_MAX);
            }
        }
    }
}

impl Waiter {
    fn lock(&self) -> Option<EtcdLock> {
        self.client.upgrade().map(|inner| EtcdLock { inner })
    }

    /// Whether the waiting call is still on (its watch not dropped).
    fn waiting(&self) -> bool {
        self.client
            .upgrade()
            .is_some_and(|inner| inner.waiting.has_waiters(&self.channel))
    }

    fn is_first(&self, lock: &EtcdLock) -> bool {
        self.line.is_held_target(&lock.inner.layout, &self.target)
    }

    fn wake_caller(&self, lock: &EtcdLock) {
        lock.inner.waiting.notify(&self.channel);
    }

    async fn run(mut self) {
        // Resolves when the waiting call ends (its ReleaseWatch dropped).
        let departed = match self.client.upgrade() {
            Some(inner) => inner.waiting.closed(&self.channel),
            None => return,
        };
        tokio::pin!(departed);
        // Set after a failed look-up: retry then.
        let mut retry: Option<Duration> = None;
        loop {
            let retry_sleep = async {
                match retry {
                    Some(pause) => tokio::time::sleep(pause).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                woke = self.watch.released() => {
                    if let Err(e) = woke {
                        // The watch stream was lost: a deletion may have
                        // been missed, and this watch is gone.
                        tracing::debug!(key = %self.line.key(), error = %e, "etcd watch lost; looking the waiter's place up again");
                        self.stale = true;
                    }
                }
                _ = &mut departed => break,
                _ = retry_sleep => {}
            }
            if !self.waiting() {
                break;
            }
            let Some(lock) = self.lock() else {
                return;
            };
            if retry.is_none() && !self.stale && self.is_first(&lock) {
                // The lock key was deleted: try now.
                tracing::trace!(key = %self.line.key(), place = self.place, "etcd lock released; waking the first waiter");
                self.wake_caller(&lock);
                continue;
            }
            // Our predecessor left, or the watch was lost: find our place
            // again.
            match self.move_up(&lock).await {
                Ok(()) => retry = None,
                Err(e) if e.kind() == ErrorKind::Corrupted => {
                    // Not obeyed (it would stall the line) and not deleted:
                    // every waiting call of this client queues again, and
                    // one that finds it in its way reports it.
                    tracing::error!(key = %self.line.key(), error = %e, "foreign data in an etcd waiter queue");
                    lock.inner.waiting.reset();
                    break;
                }
                Err(e) => {
                    tracing::debug!(key = %self.line.key(), error = %e, "etcd queue look-up failed; retrying");
                    let pause = retry.map_or(RETRY_MIN, |p| (p * 2).min(RETRY_MAX));
                    retry = Some(pause);
                }
            }
        }
        tracing::trace!(key = %self.line.key(), place = self.place, "etcd waiter left the queue");
        delete_entry(self.client.clone(), self.entry.clone(), self.fences).await;
    }

    /// Reads our predecessor and the lock key; watches the new predecessor,
    /// or the lock key if we are first now (waking the caller if the lock
    /// is free). A lost watch is replaced even if its target is unchanged.
    async fn move_up(&mut self, lock: &EtcdLock) -> Result<(), LockError> {
        let mut ops = reads(lock, &self.line, self.place, 1);
        // Our own entry, before the count (read last, if at all).
        ops.insert(
            2,
            TxnOp::get(self.entry.clone(), Some(GetOptions::new().with_keys_only())),
        );
        let txn = Txn::new().and_then(ops);
        let reply = lock
            .run_txn("etcd queue look-up", Repeat::Safe, txn)
            .await?;
        let revision = revision_of(&reply)?;
        let ranges = ranges(&reply);
        check_entries(lock, &self.line, ranges.first())?;
        let mut position = Position {
            revision,
            predecessor: self.line.to_watch(
                ranges
                    .first()
                    .and_then(|kvs| kvs.first())
                    .map(|kv| kv.key().to_vec()),
                count_at(&reply, 3),
                ranges.get(1),
            ),
            held: self.line.held(ranges.get(1)),
            queued: ranges.get(2).is_some_and(|kvs| !kvs.is_empty()),
        };
        if !position.queued {
            // Our entry is gone (our session lease was lost): queue again,
            // at the end of the line.
            let deadline = lock.inner.requests.deadline();
            let session = lock.session(MIN_TTL, deadline).await?;
            let fence = Fence::new(&self.line.base(&lock.inner.layout), session.lease_id());
            let (place, again) =
                match put_entry(lock, &self.line, &self.entry, &session, &fence, deadline).await {
                    Ok(placed) => placed,
                    Err(e) => {
                        // Its outcome is unknown: fenced off when we leave.
                        self.fences.push(fence);
                        return Err(e);
                    }
                };
            tracing::debug!(key = %self.line.key(), place, "etcd queue entry lost; queued again");
            self.place = place;
            position = again;
        }
        let (target, start) = target_of(lock, &self.line, &position);
        if self.stale || target != self.target {
            let channel = format!("{}#{}", self.channel, self.watches);
            self.watches += 1;
            self.watch = watch_target(lock, &self.line, channel, &target, start).await?;
            self.target = target;
            self.stale = false;
        }
        let first = position.predecessor.is_none();
        tracing::trace!(key = %self.line.key(), place = self.place, first, "etcd waiter moved up");
        if first && !position.held {
            self.wake_caller(lock);
        }
        Ok(())
    }
}
