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
//! [`Queues::enqueue`] (the backend's `watch`) puts a queue entry
//! `NS/lock/<escaped key>/waiters/<waiter id>` on the client's 5 s session
//! lease, so a crashed client's entries vanish with its lease. Its
//! `create_revision` is its place in line. In the same transaction it reads
//! the entry with the greatest create revision below its own — its
//! predecessor — and whether the lock key exists. A waiter with a
//! predecessor watches only that entry's deletion; the first in line
//! watches the lock key's deletion (a release, a force release, or the
//! holder's lease expiring). Every watch starts at the store's current
//! revision, so etcd delivers its deletions at once (a watch from an older
//! revision would wait for etcd's catch-up loop, up to 100 ms); if the
//! store moved on between the transaction and the watch, the waiter reads
//! its target again and, if what it saw was deleted meanwhile, fires its
//! own watch: nothing in between is missed.
//!
//! A lock waiter that takes the lock leaves its entry in the line as the
//! holder's marker, on the lock's lease, until the lock ends (see
//! [`crate::marker`]): its successor's watch sees the entry put again and
//! knows it is first now, with no request, and the marker's deletion (with
//! the lock's) wakes it. A waiter whose predecessor is a marker when it
//! looks is first too, and watches the marker.
//!
//! A background task per waiter moves it up the line: when its predecessor
//! leaves without the lock, one transaction finds the next predecessor (or
//! none: it is first now) and reads the lock key. A lock waiter watches the
//! lock key before that transaction (a predecessor whose client knows no
//! markers deleted its entry as it took the lock), so when it finds itself
//! first the watch covers everything after its read, and it reads nothing
//! again. The waiter's [`ReleaseWatch`] — on a channel of its own, so
//! exactly one waiter is woken — fires only when it is first and the lock
//! key (or the marker ahead) was deleted, or when it just became first and
//! the lock is free. A handoff therefore costs the same requests however
//! many wait: the release, the next waiter's acquire, and the end of its
//! watch. Nor do their reads grow with the line where it is long: a waiter
//! known first claims its place without the acquire's compare over the
//! line ([`Turn::known_first`]), and a successor whose predecessor took the
//! lock without a marker knows it is first from the lock key's create
//! revision (`entries::look_up`). A waiter woken for the end of the marker
//! ahead whose attempt is refused (the marker went without its lock) looks
//! its place up again.
//!
//! Each watch has a channel of its own, so the listener cancels it on the
//! server as soon as the task drops it (moved up, or left): a deletion of
//! the lock key is sent to its first waiter's watch, not also to the
//! watches of the heads before it ([`distlock_core::Listener::unsubscribe_on_leave`]).
//!
//! The caller's channel lives in a [`ReleaseNotifier`] of the queue's own,
//! not in the watch listener's: when the watch stream is lost, the listener
//! fails the *task's* watch, and the task looks its place up again (one
//! transaction) and watches from the revision it read, waking the caller
//! if it is first and the lock is free (a release may have happened while
//! the stream was down). The caller keeps its place in line, and waiters
//! that leave during the reconnect change nothing for the others.
//!
//! When the waiting call ends (acquired, deadline, or its future dropped)
//! its [`ReleaseWatch`] is dropped; the task learns it at once
//! ([`ReleaseNotifier::closed`]) and deletes the queue entry in the
//! background, so the successor moves up. A waiter that takes the lock
//! turns its entry into the marker in the acquire transaction itself (its
//! task then sends no delete, and the client keeps the name's number until
//! the lock ends). A woken first waiter that finds the lock taken (an earlier
//! attempt of its holder's acquisition adopted it) stays first and keeps
//! watching the lock key.
//!
//! Fair handoff (no cut-in): a lock's line decides who takes a free key.
//! Each waiting call's entry is registered by its owner token (a
//! [`Seat`]), and its acquire attempts claim that place
//! ([`crate::txn::Turn`]): the transaction takes a free key only if no
//! entry under the line's prefix was created before the waiter's own. An
//! attempt that is not in line (a `try_lock`, the holder that released and
//! comes straight back before it queued) takes it only if the line is
//! empty. A refused attempt on a free key gets no expiry to wait for: the
//! head is woken by its own watch of the lock key, and every other waiter
//! by its own when it becomes first. The head's turn needs no timer of its
//! own: its entry lives on its client's session lease of [`WAITER_TTL`]
//! (5 s), so the entry of a client that froze or died vanishes with that
//! lease and the next waiter moves up; an entry whose wait ended is deleted at once.
//! A waiter that expects to be refused (someone ahead, or the lock held,
//! by its task's last look) checks first with a read-only transaction of
//! two point reads, the lock key and the entry ahead that its task watches
//! ([`crate::txn::probe`]), so a refused attempt costs one read: no lease
//! (a plain lock's) and no write through Raft (a lock on the session
//! lease: etcd logs and commits a transaction that could write even when
//! its compare fails). The attempt right after a waiter joined costs not
//! even that when the entry's own transaction found someone ahead or the
//! lock held by another owner: it read what the probe would, and the task
//! watches from its revision on, so that attempt is refused without a
//! request ([`Seat::refused_at_join`]). Semaphore lines keep first-come
//! order only among waiters: a permit attempt does not look at the line.
//!
//! A waiting call joins a lock's line only once no acquire attempt of
//! another waiter of its client on that key is in flight (or woken and
//! about to be sent: at most a few milliseconds), bounded by an operation
//! timeout ([`Queues::behind_own_attempts`]). etcd commits writes in
//! rounds, so a put sent in the same moment as that attempt's grant often
//! made the grant wait for the next round: a holder that releases and asks
//! again while the next waiter of its own process takes the lock.

mod entries;
mod line;
mod waiter;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::{
    ContendedKeys, Departure, Listener, LockError, LockKey, OwnerToken, ReleaseNotifier,
    ReleaseWatch,
};
use etcd_client::{GetOptions, KeyValue};
use tokio::sync::oneshot;

use crate::config::WAITER_TTL;
use crate::connection::Etcd;
use crate::fence::Fence;
use crate::keys::{decode_value, KeyLayout};
use crate::listener::{EtcdWatches, Topic};
use crate::marker::HolderMarkers;
use crate::requests::Repeat;
use crate::session::Sessions;
use crate::slots::Slots;
use crate::txn::Turn;
use entries::{delete_later, is_foreign, put_entry};
pub(crate) use line::Line;
use waiter::Waiter;

/// How long a join waits for an attempt of a waiter of its client that
/// was woken and has not yet sent it ([`Queues::behind_own_attempts`]).
const WOKEN_ATTEMPT_WAIT: Duration = Duration::from_millis(5);

/// A watch's [`TargetWatch::deleted_at`] when its target was found
/// deleted before the watch began: no grant's revision.
const DELETED_UNSEEN: i64 = i64::MAX;

/// Pauses between retries of a failed look-up or entry delete.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// The waiter queues of one client: what its waiting calls (lock and
/// permit waiters alike) share. Its tasks hold it weakly, so they end with
/// the client.
pub(crate) struct Queues {
    /// The watch stream that carries deletions to the waiters' tasks.
    pub(crate) listener: Listener<EtcdWatches>,
    /// The channels of waiting calls, woken by their queue tasks (not by
    /// the listener, whose resets they never see: see the module docs).
    pub(crate) waiting: ReleaseNotifier,
    /// Numbers this client's waiting calls.
    next_waiter: AtomicU64,
    /// The numbers in its queue entries' names, reused ([`crate::slots`]).
    /// A name is reused only once its entry is known deleted and no
    /// request that names it can still be applied: a late put would come
    /// back under someone else's wait, and a late delete would take the new
    /// entry (each delete names the place it deletes, see
    /// [`crate::txn::dequeue`], and attempts whose outcome is unknown
    /// retire the name).
    slots: Arc<Slots>,
    /// The places of this client's lock waiters, by their owner tokens.
    seats: Mutex<HashMap<OwnerToken, Arc<Seat>>>,
    /// The markers of the locks this client's waiters took.
    pub(crate) markers: HolderMarkers,
    /// Queue entries go on the client's session lease of [`WAITER_TTL`],
    /// a session of their own (no lock or permit goes on it), revoked when
    /// the client is dropped.
    sessions: Arc<Sessions>,
    /// Lock keys an attempt of this client found taken (held, or a line
    /// ahead of it), and when: for [`CONTENDED_FOR`](distlock_core::CONTENDED_FOR) after, an attempt not
    /// in line reads before it writes (a refused transaction that could
    /// write is a Raft proposal; a read is not).
    contended: ContendedKeys,
    etcd: Etcd,
}

impl Queues {
    pub(crate) fn new(
        etcd: Etcd,
        sessions: Arc<Sessions>,
        listener: Listener<EtcdWatches>,
    ) -> Self {
        Self {
            listener,
            waiting: ReleaseNotifier::new(),
            next_waiter: AtomicU64::new(0),
            slots: Arc::default(),
            seats: Mutex::new(HashMap::new()),
            markers: HolderMarkers::default(),
            sessions,
            contended: ContendedKeys::default(),
            etcd,
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
    ///
    /// A lock waiter's entry is registered under `owner`, the token of its
    /// acquire attempts, so they claim its place ([`Queues::turn`]).
    pub(crate) async fn enqueue(
        self: &Arc<Self>,
        line: Line,
        owner: Option<OwnerToken>,
    ) -> Result<ReleaseWatch, LockError> {
        let waiter = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        let channel = format!("{}#{waiter}", line.key().as_str());
        // Registered first: whatever the task notifies from now on is kept.
        let mut caller = self
            .waiting
            .subscribe(&channel, || async { Ok(()) })
            .await?;
        // Held by the waiter's task until its entry is deleted.
        let departure = caller.departure();
        let (joined, on_joined) = oneshot::channel();
        tokio::spawn(join(self.clone(), line, channel, owner, joined, departure));
        match on_joined.await {
            Ok(result) => result.map(|()| caller),
            Err(_) => Err(LockError::unavailable(
                "the etcd waiter task stopped before it joined the queue (is the runtime shutting down?)",
            )),
        }
    }

    /// What an acquire attempt of `owner` on `key` claims: the key's line,
    /// and the place of `owner`'s waiting call in it if it waits; with
    /// that waiter's seat, claimed until the attempt ends ([`Claim`]).
    pub(crate) fn turn(&self, key: &LockKey, owner: OwnerToken) -> (Turn, Option<Claim>) {
        let claim = self
            .seats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&owner)
            // A waiter whose grant took its entry (and gave the lock back,
            // too late to use) is no longer in line.
            .filter(|seat| seat.key == *key && !seat.taken.load(Ordering::Acquire))
            // Claimed under the seats' lock: a waiter that unseats itself
            // then sees every attempt that found its seat.
            .map(Claim::new);
        let place = claim
            .as_ref()
            .map(|seat| (seat.entry.clone(), seat.place.load(Ordering::Acquire)));
        let known_first = match (&claim, &place) {
            (Some(seat), Some((_, place))) => seat.first_at.load(Ordering::Acquire) == *place,
            _ => false,
        };
        let turn = Turn {
            line: self.etcd.layout.queue_prefix(key),
            place,
            known_first,
        };
        (turn, claim)
    }

    /// The queue entry of one of this client's waiters in `key`'s lock
    /// line, if any: while it exists, an attempt that is not in line (a
    /// `try_lock`, a waiting acquire's first attempt before it queues) is
    /// refused. The entry exists while the waiter's seat is registered
    /// (put before, deleted after), so that needs no request; a settling
    /// attempt reads the entry and the lock key (it may find its own lock
    /// to give back).
    pub(crate) fn entry_in_line(&self, key: &LockKey) -> Option<Vec<u8>> {
        self.seats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .find(|seat| seat.key == *key && !seat.taken.load(Ordering::Acquire))
            .map(|seat| seat.entry.clone())
    }

    /// An attempt of this client found `key` taken (see the field).
    pub(crate) fn taken(&self, key: &LockKey) {
        self.contended.found_taken(key);
    }

    /// Whether an attempt of this client found `key` taken lately.
    pub(crate) fn contended(&self, key: &LockKey) -> bool {
        self.contended.is_contended(key)
    }

    fn seat(&self, owner: OwnerToken, seat: &Arc<Seat>) {
        self.seats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(owner, seat.clone());
    }

    fn unseat(&self, owner: OwnerToken, seat: &Arc<Seat>) {
        let mut seats = self.seats.lock().unwrap_or_else(|e| e.into_inner());
        if seats.get(&owner).is_some_and(|s| Arc::ptr_eq(s, seat)) {
            seats.remove(&owner);
        }
        drop(seats);
        seat.attempt_ended.notify_waiters();
    }

    /// Waits while an acquire attempt of one of this client's waiters on
    /// `key` is in flight, or (for at most [`WOKEN_ATTEMPT_WAIT`]) while
    /// one was woken to attempt and has not yet: a queue entry put beside
    /// that attempt's grant is a second write in the same moment, and etcd
    /// commits writes in rounds, so the grant often waited for the put's
    /// round (a holder that releases and asks again, with the next waiter
    /// in its own process: 0.5 ms more a handoff). The entry goes behind
    /// that waiter anyway. Bounded: an attempt ends within its operation
    /// timeout (its claim is dropped then, or with its future), and a
    /// waiter that leaves says so.
    async fn behind_own_attempts(&self, key: &LockKey) {
        let woken_until = tokio::time::Instant::now() + WOKEN_ATTEMPT_WAIT;
        loop {
            let woken_counts = tokio::time::Instant::now() < woken_until;
            let busy = |seat: &Seat| {
                seat.in_flight.load(Ordering::Acquire) > 0
                    || (woken_counts && seat.woken.load(Ordering::Acquire))
            };
            let seat = self
                .seats
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .find(|seat| seat.key == *key && !seat.taken.load(Ordering::Acquire) && busy(seat))
                .cloned();
            let Some(seat) = seat else {
                return;
            };
            let ended = seat.attempt_ended.notified();
            tokio::pin!(ended);
            // Registered before the second look: an end between the two
            // is not missed.
            ended.as_mut().enable();
            if !busy(&seat) {
                continue;
            }
            if seat.in_flight.load(Ordering::Acquire) > 0 {
                ended.await;
            } else {
                let _ = tokio::time::timeout_at(woken_until, ended).await;
            }
        }
    }
}

/// A lock waiter's place in its line, as its acquire attempts claim it
/// (see the module docs): registered by the waiting call's owner token
/// while its task runs.
#[derive(Debug)]
pub(crate) struct Seat {
    key: LockKey,
    /// The waiter's queue entry.
    entry: Vec<u8>,
    /// Its create revision (it changes if the entry is put again).
    place: AtomicI64,
    /// The place at which the waiter's task found nobody ahead (0: not
    /// found yet), so an attempt that claims that place is first for good
    /// ([`Turn::known_first`]). A place, not a flag: an entry put again
    /// has a new place, behind others, and is not first until its task
    /// looks again.
    first_at: AtomicI64,
    /// The task's last look found someone ahead, or the lock held: an
    /// attempt now is likely refused, so it reads first.
    expects_refusal: AtomicBool,
    /// The transaction that put the entry found someone ahead or another
    /// owner's lock, and no attempt has been answered since: the attempt
    /// that follows the join is answered from that (see
    /// [`Seat::refused_at_join`]).
    refused_at_join: AtomicBool,
    /// The queue entry ahead of the waiter that its task watches, if any:
    /// while it exists, someone is ahead, which a read of that one key
    /// tells (a look at the whole line reads every entry in it).
    ahead: Mutex<Option<Vec<u8>>>,
    /// An acquire took the lock and deleted the entry with it.
    taken: AtomicBool,
    /// Attempts that claimed this seat and have not ended ([`Claim`]).
    in_flight: AtomicUsize,
    /// An attempt that claimed this seat sent its transaction and got no
    /// answer (an error, or it was dropped): it may still be applied.
    unsettled: AtomicBool,
    /// Its task woke the caller (first, the lock free), and no attempt has
    /// claimed the seat since: an attempt is coming.
    woken: AtomicBool,
    /// Told when an attempt's claim ends and when the waiter leaves (see
    /// [`Queues::behind_own_attempts`]).
    attempt_ended: tokio::sync::Notify,
    /// Counts the attempts that claimed this seat and were refused: one
    /// woken for the end of the holder's marker ahead and refused tells
    /// the task to look its place up again (see [`crate::marker`]).
    refusals: tokio::sync::watch::Sender<u64>,
}

impl Seat {
    /// Whether an attempt now is likely refused (see the field).
    pub(crate) fn expects_refusal(&self) -> bool {
        self.expects_refusal.load(Ordering::Acquire)
    }

    /// Whether the attempt that follows the join is refused without a
    /// request: the entry's own transaction found someone ahead or another
    /// owner's lock ([`Position::refuses`]), and nothing woke the waiter
    /// since (a wake-up clears `expects_refusal`). Asked once: later attempts go to the server.
    /// Safe as a refusal read from the server is: the waiter's task watches
    /// from that transaction's revision on, and wakes the caller, who is
    /// subscribed already, when it is first and the lock free.
    pub(crate) fn refused_at_join(&self) -> bool {
        self.refused_at_join.swap(false, Ordering::AcqRel) && self.expects_refusal()
    }

    /// The entry ahead of the waiter, by its task's last look (see the
    /// field).
    pub(crate) fn ahead(&self) -> Option<Vec<u8>> {
        self.ahead.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// An attempt that claimed this seat took the lock (and left the line).
    pub(crate) fn took(&self) {
        self.taken.store(true, Ordering::Release);
    }

    /// An attempt that claimed this seat was refused.
    pub(crate) fn refused(&self) {
        self.refusals.send_modify(|n| *n += 1);
    }

    /// Whether no attempt that claimed this seat can still be applied:
    /// none is in flight, and each that sent its transaction was answered
    /// (by its only try: see [`Claim::answered`]).
    /// An attempt that takes the lock deletes the waiter's entry, by its
    /// name: one applied later would delete a newer entry of that name, so
    /// the name is reused only if this holds ([`crate::slots`]). Asked once the
    /// seat is unregistered, when no new attempt can claim it.
    fn settled(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0 && !self.unsettled.load(Ordering::Acquire)
    }
}

/// An acquire attempt's claim on a waiter's [`Seat`], from the moment it
/// found the seat until the attempt ends: counted in the seat's attempts in
/// flight, and, if its transaction was sent and no answer came, marking
/// the seat unsettled ([`Seat::settled`]).
#[derive(Debug)]
pub(crate) struct Claim {
    seat: Arc<Seat>,
    /// The transaction was sent and not yet answered.
    sent: bool,
}

impl Claim {
    fn new(seat: &Arc<Seat>) -> Self {
        seat.in_flight.fetch_add(1, Ordering::AcqRel);
        seat.woken.store(false, Ordering::Release);
        Self {
            seat: seat.clone(),
            sent: false,
        }
    }

    /// The attempt's transaction goes out now.
    pub(crate) fn sending(&mut self) {
        self.sent = true;
    }

    /// It was answered, its outcome `known` (applied or refused, and no
    /// earlier try of it can still be applied: the client sent no request
    /// again after a try that got no answer meanwhile), or not (an error).
    pub(crate) fn answered(&mut self, known: bool) {
        if known {
            self.sent = false;
        }
    }
}

impl std::ops::Deref for Claim {
    type Target = Seat;

    fn deref(&self) -> &Seat {
        &self.seat
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.sent {
            self.seat.unsettled.store(true, Ordering::Release);
        }
        self.seat.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.seat.attempt_ended.notify_waiters();
    }
}

/// Refuses a queue entry distlock did not write at the head of `line` (a
/// waiter queue prefix): obeyed, it would keep the key from everyone.
pub(crate) fn check_entry(line: &[u8], kv: &KeyValue) -> Result<(), LockError> {
    if is_foreign(line, kv) {
        return Err(LockError::corrupted(format!(
            "the lock's etcd waiter queue holds a key distlock did not write ({:?}); it was left untouched — remove it or use another namespace",
            String::from_utf8_lossy(kv.key())
        )));
    }
    Ok(())
}

/// What one queue transaction read, at revision `revision`.
pub(crate) struct Position {
    /// The header revision: the state the reads saw.
    revision: i64,
    /// The queue entry to watch before ours, if any (see [`Line::to_watch`]).
    predecessor: Option<Vec<u8>>,
    /// Whether what the line waits for is taken (the lock key exists, or
    /// every permit is).
    held: bool,
    /// Whether our own entry exists.
    queued: bool,
    /// The owner of the lock key, if a lock's line read one in a form
    /// distlock writes.
    holder: Option<OwnerToken>,
    /// What the reads saw of the target the waiter watches (that
    /// predecessor, else the lock key or the permits): each key and its
    /// create revision.
    seen: Vec<(Vec<u8>, i64)>,
    /// The predecessor is the marker of the lock's holder (see
    /// [`crate::marker`]): the waiter is first, and watches it.
    holder_ahead: bool,
}

impl Position {
    /// Whether an attempt of `owner` is refused by what this look read:
    /// someone ahead, or the lock held by another owner. A lock held by
    /// `owner` itself is an earlier attempt of its acquisition whose reply
    /// was lost (applied late, before the entry was put: after, its compare
    /// over the line fails), which the attempt must adopt; a value distlock
    /// did not write is the attempt's to report.
    fn refuses(&self, owner: OwnerToken) -> bool {
        match (self.held, self.holder) {
            (false, _) => self.predecessor.is_some() && !self.holder_ahead,
            (true, Some(holder)) => holder != owner,
            (true, None) => false,
        }
    }

    /// Whether nobody waits ahead: no predecessor, or only the holder's
    /// marker.
    fn first(&self) -> bool {
        self.predecessor.is_none() || self.holder_ahead
    }

    /// What a seat at `place` records as [`Seat::first_at`] from this
    /// look: `place` if nobody was ahead, else 0.
    fn first_at(&self, place: i64) -> i64 {
        if self.first() {
            place
        } else {
            0
        }
    }

    /// The entry ahead that an attempt's probe reads ([`Seat::ahead`]):
    /// the predecessor, unless it is the holder's marker (the lock key
    /// says as much, and a stray marker must not refuse the waiter).
    fn waiting_behind(&self) -> Option<Vec<u8>> {
        self.predecessor.clone().filter(|_| !self.holder_ahead)
    }

    /// A position from the reads of one transaction at `revision`: the
    /// newest entry before ours, how many wait ahead (a semaphore's line)
    /// and what the line waits for.
    fn read(
        line: &Line,
        revision: i64,
        before: Option<&KeyValue>,
        ahead: Option<i64>,
        held: Option<&Vec<KeyValue>>,
        queued: bool,
    ) -> Self {
        let predecessor = line.to_watch(before.map(|kv| kv.key().to_vec()), ahead, held);
        let holder_ahead = matches!(line, Line::Lock(_))
            && predecessor.is_some()
            && before.is_some_and(crate::marker::is_marker);
        let seen = match (&predecessor, before) {
            (Some(_), Some(kv)) => vec![(kv.key().to_vec(), kv.create_revision())],
            _ => held
                .into_iter()
                .flatten()
                .map(|kv| (kv.key().to_vec(), kv.create_revision()))
                .collect(),
        };
        let holder = match line {
            Line::Lock(_) => held
                .and_then(|kvs| kvs.first())
                .and_then(|kv| decode_value(kv.value())),
            Line::Permits(..) => None,
        };
        Position {
            revision,
            predecessor,
            held: line.held(held),
            queued,
            seen,
            holder,
            holder_ahead,
        }
    }
}

/// Writes the queue entry, watches the predecessor (or the lock), reports
/// on `joined`, then moves the waiter up the line until it leaves.
async fn join(
    queues: Arc<Queues>,
    line: Line,
    channel: String,
    owner: Option<OwnerToken>,
    joined: oneshot::Sender<Result<(), LockError>>,
    departure: Departure,
) {
    let etcd = &queues.etcd;
    if let Line::Lock(key) = &line {
        // At most an operation timeout, whatever the attempts do.
        let wait = etcd.requests.deadline();
        let _ = tokio::time::timeout_at(wait.into(), queues.behind_own_attempts(key)).await;
    }
    // Unique in the cluster: the entry's name has this session lease's id,
    // which etcd never hands out twice, and a slot number no other waiter
    // of this client holds (reused once free: see `Queues::slots`). Session
    // and entry share one operation timeout.
    let deadline = etcd.requests.deadline();
    let session = match queues.sessions.session(WAITER_TTL, deadline).await {
        Ok(session) => session,
        Err(e) => {
            let _ = joined.send(Err(e));
            return;
        }
    };
    // Markers of locks left to expire give their numbers back first.
    queues.markers.sweep();
    let slot = queues.slots.take();
    let waiter_id = format!("{:x}-{:x}", session.lease_id(), slot.number());
    let entry = line.entry(&etcd.layout, &waiter_id);
    let fence = Fence::new(&line.base(&etcd.layout), session.lease_id());
    let placed = match put_entry(etcd, &line, &entry, &session, &fence, deadline).await {
        Ok(placed) => placed,
        Err(e) => {
            // The put may have happened, or may still happen: take it out
            // again with its fence up, so a late put writes nothing. Its
            // place unknown, the delete is not conditional on it, and the
            // name is retired (a late attempt of that delete could take
            // a new entry of the same name).
            delete_later(Arc::downgrade(&queues), entry, None, vec![fence], None);
            drop(slot);
            let _ = joined.send(Err(e));
            return;
        }
    };
    let (place, position) = placed;
    let target = target_of(&etcd.layout, &line, &position);
    let first_watch = format!("{channel}#0");
    let watched = match watch_target(&queues, &line, first_watch, &target, &position).await {
        Ok(watched) => watched,
        Err(e) => {
            delete_later(
                Arc::downgrade(&queues),
                entry,
                Some(place),
                Vec::new(),
                Some(slot),
            );
            let _ = joined.send(Err(e));
            return;
        }
    };
    // A lock waiter's attempts claim its place from now on.
    let seat = match (&line, owner) {
        (Line::Lock(key), Some(owner)) => {
            let seat = Arc::new(Seat {
                key: key.clone(),
                entry: entry.clone(),
                place: AtomicI64::new(place),
                first_at: AtomicI64::new(position.first_at(place)),
                expects_refusal: AtomicBool::new(!position.first() || position.held),
                refused_at_join: AtomicBool::new(position.refuses(owner)),
                ahead: Mutex::new(position.waiting_behind()),
                taken: AtomicBool::new(false),
                in_flight: AtomicUsize::new(0),
                unsettled: AtomicBool::new(false),
                woken: AtomicBool::new(false),
                attempt_ended: tokio::sync::Notify::new(),
                refusals: tokio::sync::watch::Sender::new(0),
            });
            queues.seat(owner, &seat);
            Some((owner, seat))
        }
        _ => None,
    };
    tracing::trace!(key = %line.key(), place, first = position.first(), "etcd waiter queued");
    let refusals = seat.as_ref().map(|(_, seat)| seat.refusals.subscribe());
    let waiter = Waiter {
        client: Arc::downgrade(&queues),
        line,
        entry,
        place,
        channel,
        watches: 1,
        watched,
        holder_ahead: position.holder_ahead,
        // A marker without its lock: the caller's next attempt takes the
        // lock past it, and a refusal makes the task look again.
        ahead_ended: position.holder_ahead && !position.held,
        refusals,
        stale: false,
        fences: Vec::new(),
        seat,
        requeued: false,
        slot,
        _departure: departure,
    };
    drop(queues);
    // The caller tries right after this, so a free lock needs no wake-up
    // here. If the caller is gone, `run` finds its watch dropped and
    // deletes the entry at once.
    let _ = joined.send(Ok(()));
    waiter.run().await;
}

/// Watches deletions of `target` on channel `channel` (every key below it
/// if it is the permits prefix the first in a semaphore's line watches);
/// the etcd watch is confirmed when this returns. A deletion of what
/// `position` saw of it, after its look-up but before the watch, fires the
/// watch too.
async fn watch_target(
    queues: &Queues,
    line: &Line,
    channel: String,
    target: &[u8],
    position: &Position,
) -> Result<TargetWatch, LockError> {
    let watched = TargetWatch::subscribe(queues, line, channel, target).await?;
    // The watch reports what happens after the revision etcd confirmed it
    // at; if the store moved on since the look-up, see whether what it saw
    // is still there.
    if !watched.covers(position)
        && !still_there(queues, target, watched.prefix, &position.seen).await
    {
        // Deleted, at a revision the watch did not see: as a deletion no
        // grant made (a waiter behind a marker takes it for its lock's
        // end; one behind an entry looks its place up).
        watched.deleted_at.store(DELETED_UNSEEN, Ordering::Release);
        queues.listener.notifier().notify(&watched.channel);
    }
    Ok(watched)
}

/// A confirmed watch of deletions of a waiter's target.
pub(crate) struct TargetWatch {
    pub(crate) watch: ReleaseWatch,
    channel: String,
    /// The key watched.
    pub(crate) target: Vec<u8>,
    /// Every key below `target` is watched (a semaphore's permits).
    prefix: bool,
    /// The revision etcd confirmed it at: it reports what happens after.
    confirmed_at: i64,
    /// See [`crate::listener::Topic::deleted_at`].
    pub(crate) deleted_at: Arc<AtomicI64>,
    /// See [`crate::listener::Topic::rewritten_at`]: set for the entry
    /// ahead in a lock's line.
    pub(crate) rewritten_at: Option<Arc<AtomicI64>>,
}

impl TargetWatch {
    /// Watches deletions of `target` (every key below it if it is the
    /// permits prefix the first in a semaphore's line watches) on
    /// `channel`; confirmed when this returns.
    pub(crate) async fn subscribe(
        queues: &Queues,
        line: &Line,
        channel: String,
        target: &[u8],
    ) -> Result<Self, LockError> {
        let held_target = line.is_held_target(&queues.etcd.layout, target);
        let prefix = matches!(line, Line::Permits(..)) && held_target;
        // The entry ahead in a lock's line may become its holder's marker.
        let rewritten_at =
            (matches!(line, Line::Lock(_)) && !held_target).then(|| Arc::new(AtomicI64::new(0)));
        let topic = Topic {
            channel: channel.clone(),
            key: target.to_vec(),
            prefix,
            confirmed_at: Default::default(),
            creations: false,
            deleted_at: Default::default(),
            rewritten_at: rewritten_at.clone(),
        };
        let confirmed_at = topic.confirmed_at.clone();
        let deleted_at = topic.deleted_at.clone();
        let watch = queues.listener.watch(topic).await?;
        Ok(Self {
            watch,
            channel,
            target: target.to_vec(),
            prefix,
            confirmed_at: confirmed_at.load(Ordering::Acquire),
            deleted_at,
            rewritten_at,
        })
    }

    /// Whether the watch reports every deletion after `position` was read
    /// (it was confirmed at or before that revision), or `position` saw
    /// nothing of its target to be deleted.
    pub(crate) fn covers(&self, position: &Position) -> bool {
        position.seen.is_empty()
            || (self.confirmed_at != 0 && self.confirmed_at <= position.revision)
    }
}

/// Whether every key of `seen` still exists with its create revision: a
/// read of `target` (every key below it if `prefix`). A failed read
/// answers no: the waiter then looks its place up again, or its caller
/// tries once more.
async fn still_there(
    queues: &Queues,
    target: &[u8],
    prefix: bool,
    seen: &[(Vec<u8>, i64)],
) -> bool {
    let etcd = &queues.etcd;
    let options = GetOptions::new().with_keys_only();
    let options = if prefix {
        options.with_prefix()
    } else {
        options
    };
    let reply = etcd
        .requests
        .send("etcd queue watch check", Repeat::Safe, || {
            let mut kv = etcd.kv.clone();
            let options = options.clone();
            async move { kv.get(target, Some(options)).await }
        })
        .await;
    match reply {
        Ok(reply) => seen.iter().all(|(key, created)| {
            reply
                .kvs()
                .iter()
                .any(|kv| kv.key() == key.as_slice() && kv.create_revision() == *created)
        }),
        Err(e) => {
            tracing::debug!(error = %e, "could not check an etcd queue watch's target");
            false
        }
    }
}

/// The etcd key to watch from `position`.
fn target_of(layout: &KeyLayout, line: &Line, position: &Position) -> Vec<u8> {
    position
        .predecessor
        .clone()
        .unwrap_or_else(|| line.held_target(layout))
}
