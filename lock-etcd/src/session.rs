//! Session leases: one etcd lease per client and TTL, shared by the locks
//! and semaphore permits whose guards renew them, kept alive by one
//! keep-alive stream (as etcd's Go `concurrency.Session`).
//!
//! A renewing acquire attaches its key to the session lease, so it needs
//! no lease grant of its own. Renewing such a lock or permit does not move
//! the key: one request confirms the key is still ours and still on the
//! session lease, and the lease's validity is counted from the last
//! keep-alive the server confirmed: a grant or renewal says so with
//! [`Grant::clock_started`], so the client dates the lease from it.
//!
//! The session lease alone would keep a lock alive as long as the *client*
//! lives, not as long as its *holder* renews it. So the session's task also
//! tracks each attached key's last renewal and deletes (compare owner,
//! create revision and lease, then delete) any not renewed for the session
//! TTL: a holder that stops renewing loses the lock or permit after its TTL
//! while the session lives on for the others. A crashed client stops the
//! keep-alives and etcd expires the session lease, and its keys with it.
//!
//! One session's state (liveness, confirmed keep-alives, attached keys)
//! is [`state`]; its keep-alive and expiry task is [`keepalive`].

mod keepalive;
mod state;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireReply, AcquireRequest, ExtendReply, FencingToken, Grant, LockError, LockKey, OwnerToken,
    IN_LOCK_CALL,
};
use etcd_client::{KeyValue, Txn, TxnOpResponse, TxnResponse};
use tokio::sync::watch;

use crate::connection::Etcd;
use crate::fence::Fence;
use crate::keys::{encode_permit, encode_value, KeyLayout};
use crate::requests::Repeat;
use crate::txn::{self, AcquireOutcome};
use keepalive::Task;
pub(crate) use state::Session;

/// Set in [`Grant::handle`] for a lock attached to
/// a session lease (etcd lease ids are positive `i64`s, so the top bit is
/// free): such a lease is never revoked on behalf of one lock.
pub(crate) const SESSION_BIT: u64 = 1 << 63;

/// The lease handle of a lock attached to session lease `lease_id`.
pub(crate) fn session_handle(lease_id: i64) -> u64 {
    u64::try_from(lease_id).unwrap_or(0) | SESSION_BIT
}

/// The session lease id in a handle, if the handle is a session's.
pub(crate) fn session_lease_of(handle: u64) -> Option<i64> {
    (handle & SESSION_BIT != 0)
        .then(|| i64::try_from(handle & !SESSION_BIT).ok())
        .flatten()
}

/// etcd answered a transaction of `sent` reads with `got` responses.
fn answer_count(sent: usize, got: usize) -> LockError {
    LockError::unavailable(format!(
        "etcd answered a transaction of {sent} reads with {got} responses; try again"
    ))
}

/// One acquisition's key on a session lease, a lock or a permit: what the
/// session tracks, confirms and undoes.
///
/// A session keeps one per held lock, so its byte strings share one
/// allocation (a string that begins another is not stored twice: a lock's
/// key begins its label key and is its fence base); a clone costs no
/// allocation.
#[derive(Debug, Clone)]
pub(crate) struct Attached {
    bytes: Arc<[u8]>,
    /// Its etcd key.
    key: Span,
    /// The value a confirm or undo compares (a permit's name is reused by
    /// later acquisitions, see [`crate::permit_names`], whose permits hold
    /// other owners), and what the session tracks it by: unique per
    /// acquisition (it names the owner token; a permit's holds its limit
    /// too).
    value: Span,
    /// Its holder-label key, which goes with it.
    label_key: Option<Span>,
    /// Its holder's marker, if an attempt in line took it (see
    /// [`crate::marker`]), which goes with it too.
    marker: Option<Span>,
    /// The key its requests' fences go below (see [`crate::keys`]): never
    /// in the range of a semaphore's permits.
    fence_base: Span,
    /// "lock" or "permit", for messages.
    pub(crate) what: &'static str,
}

/// Where one byte string lies in [`Attached::bytes`].
#[derive(Debug, Clone, Copy)]
struct Span(u32, u32);

/// `parts` end to end, each stored once: a part that begins one stored
/// already is found there. With the spans of `parts`, in order.
fn pack<const N: usize>(parts: [&[u8]; N]) -> (Arc<[u8]>, [Span; N]) {
    let mut order: [usize; N] = std::array::from_fn(|i| i);
    // Longest first, so a prefix finds what it begins.
    order.sort_by_key(|&i| std::cmp::Reverse(parts[i].len()));
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    let mut spans = [Span(0, 0); N];
    let mut stored: Vec<usize> = Vec::with_capacity(N);
    for i in order {
        let part = parts[i];
        let start = match stored.iter().find(|&&j| parts[j].starts_with(part)) {
            Some(&j) => spans[j].0 as usize,
            None => {
                bytes.extend_from_slice(part);
                stored.push(i);
                bytes.len() - part.len()
            }
        };
        let at = |n: usize| u32::try_from(n).expect("etcd keys are far below 4 GiB");
        spans[i] = Span(at(start), at(start + part.len()));
    }
    (bytes.into(), spans)
}

impl Attached {
    /// `owner`'s lock on `key`.
    pub(crate) fn lock(layout: &KeyLayout, key: &LockKey, owner: OwnerToken) -> Self {
        Self::lock_in_line(layout, key, owner, None)
    }

    /// `owner`'s lock on `key`, taken by an attempt in line at the queue
    /// entry `marker` if it has one, which becomes its holder's marker.
    pub(crate) fn lock_in_line(
        layout: &KeyLayout,
        key: &LockKey,
        owner: OwnerToken,
        marker: Option<&[u8]>,
    ) -> Self {
        let etcd_key = layout.lock_key(key);
        let value = encode_value(owner);
        let label_key = layout.holder_key(key);
        // No marker: an empty part, which takes no byte.
        let (bytes, [key, value, label_key, marker_span]) =
            pack([&etcd_key, &value, &label_key, marker.unwrap_or_default()]);
        Self {
            bytes,
            key,
            value,
            label_key: Some(label_key),
            marker: marker.map(|_| marker_span),
            fence_base: key,
            what: "lock",
        }
    }

    /// `owner`'s permit of the semaphore `key`, named `name` (see
    /// [`crate::permit_names`]), granted under `limit`.
    pub(crate) fn permit(
        layout: &KeyLayout,
        key: &LockKey,
        owner: OwnerToken,
        name: &[u8],
        limit: u32,
    ) -> Self {
        let etcd_key = layout.permit_key(key, name);
        let value = encode_permit(owner, limit);
        let label_key = layout.permit_holder_key(key, owner);
        let base = layout.semaphore_base(key);
        let (bytes, [key, value, label_key, fence_base]) =
            pack([&etcd_key, &value, &label_key, &base]);
        Self {
            bytes,
            key,
            value,
            label_key: Some(label_key),
            marker: None,
            fence_base,
            what: "permit",
        }
    }

    fn get(&self, span: Span) -> &[u8] {
        &self.bytes[span.0 as usize..span.1 as usize]
    }

    /// What the session tracks it by: its value (see [`Attached`]).
    pub(crate) fn id(&self) -> &[u8] {
        self.value()
    }

    /// Its etcd key.
    pub(crate) fn key(&self) -> &[u8] {
        self.get(self.key)
    }

    /// The value a confirm or undo compares.
    pub(crate) fn value(&self) -> &[u8] {
        self.get(self.value)
    }

    /// Its holder-label key, if it has one.
    pub(crate) fn label_key(&self) -> Option<&[u8]> {
        self.label_key.map(|span| self.get(span))
    }

    /// Its holder's marker, if it has one.
    pub(crate) fn marker(&self) -> Option<&[u8]> {
        self.marker.map(|span| self.get(span))
    }

    /// A fresh fence for a request on this key attached to `lease_id`.
    pub(crate) fn fence(&self, lease_id: i64) -> Fence {
        Fence::new(self.get(self.fence_base), lease_id)
    }
}

/// The sessions of one client, by requested TTL in whole seconds.
pub(crate) struct Sessions {
    by_ttl: Mutex<HashMap<u64, Arc<Session>>>,
    /// Serializes session creation, so concurrent first acquires with one
    /// TTL grant one lease.
    creating: tokio::sync::Mutex<()>,
    /// Dropped with the client: closes the channel, which stops every
    /// session task (the leases then expire on the server, or are revoked:
    /// `revoke_at_shutdown`).
    _shutdown: watch::Sender<()>,
    shutdown: watch::Receiver<()>,
    /// The session tasks revoke their leases when the client is dropped.
    revoke_at_shutdown: bool,
    etcd: Etcd,
}

impl Sessions {
    /// The sessions of locks and permits: left to expire when the client
    /// is dropped, since a raw renewing lease taken on one (its holder
    /// counts it valid until its TTL) may outlive the client.
    pub(crate) fn new(etcd: Etcd) -> Self {
        let (tx, rx) = watch::channel(());
        Self {
            by_ttl: Mutex::new(HashMap::new()),
            creating: tokio::sync::Mutex::new(()),
            _shutdown: tx,
            shutdown: rx,
            revoke_at_shutdown: false,
            etcd,
        }
    }

    /// The sessions of queue entries alone, revoked when the client is
    /// dropped: a wait that ended with its client (its task holds the
    /// client weakly, so it cannot delete its entry then) leaves no entry
    /// holding up the line until the lease expires.
    pub(crate) fn for_queue_entries(etcd: Etcd) -> Self {
        Self {
            revoke_at_shutdown: true,
            ..Self::new(etcd)
        }
    }

    fn map(&self) -> MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.by_ttl.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live session for `ttl_secs`, if any.
    fn live(&self, ttl_secs: u64) -> Option<Arc<Session>> {
        self.map().get(&ttl_secs).filter(|s| s.is_alive()).cloned()
    }

    /// The session (live or dead but not yet replaced) with this lease id.
    pub(crate) fn by_lease(&self, lease_id: i64) -> Option<Arc<Session>> {
        self.map()
            .values()
            .find(|s| s.lease_id() == lease_id)
            .cloned()
    }

    /// Held while granting a session lease.
    async fn creating(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.creating.lock().await
    }

    /// Starts a session on the freshly granted lease `lease_id` (granted
    /// `ttl`, request sent at `sent_at`) and its keep-alive task.
    fn start(&self, ttl_secs: u64, lease_id: i64, ttl: Duration, sent_at: Instant) -> Arc<Session> {
        let session = Arc::new(Session::new(lease_id, ttl, sent_at));
        let task = Task {
            session: session.clone(),
            etcd: self.etcd.clone(),
            shutdown: self.shutdown.clone(),
            revoke_at_shutdown: self.revoke_at_shutdown,
        };
        tokio::spawn(task.run());
        tracing::debug!(lease_id, ttl = ?ttl, "etcd session lease started");
        self.map().insert(ttl_secs, session.clone());
        session
    }

    /// The live session lease for `ttl`, granted (one round trip, ending by
    /// `deadline`: the operation's) if there is none yet.
    pub(crate) async fn session(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Arc<Session>, LockError> {
        let secs = ttl.as_secs();
        if let Some(session) = self.live(secs) {
            return Ok(session);
        }
        let _creating = self.creating().await;
        if let Some(session) = self.live(secs) {
            return Ok(session);
        }
        // The server starts the lease's clock after this: the session's
        // first confirmed instant.
        let sent_at = Instant::now();
        let (lease_id, granted) = self.etcd.grant(ttl, deadline).await?;
        Ok(self.start(secs, lease_id, granted, sent_at))
    }

    /// The live session lease `handle` is on, if its TTL is `ttl`: a lock
    /// or permit on it is renewed by confirming it ([`confirm`](Self::confirm)).
    pub(crate) fn renewable(&self, handle: u64, ttl: Duration) -> Option<Arc<Session>> {
        session_lease_of(handle)
            .and_then(|id| self.by_lease(id))
            .filter(|session| session.is_alive() && session.ttl() == ttl)
    }

    /// Sends the one transaction of a renewing acquire that attaches
    /// `attached` to `session`: `write(fence, raise)`, fenced by `fence`
    /// and putting up `raise` (the fences of the owner's earlier requests
    /// whose outcome is unknown). Returns its reply and the instant the key
    /// is tracked from. On an error (unknown outcome) the key is still
    /// tracked; the caller has it undone. Answered after the client sent
    /// some request again, the fence stays pending (a try of this one may
    /// be applied later): releasing the key then undoes it too.
    pub(crate) async fn attach(
        &self,
        session: &Session,
        attached: &Attached,
        deadline: Instant,
        write: impl FnOnce(&Fence, &[Fence]) -> Txn,
    ) -> Result<(TxnResponse, Instant), LockError> {
        let fence = attached.fence(session.lease_id());
        // Tracked before it is sent: if this future is dropped before the
        // reply, the session still undoes the key a TTL after now, as any
        // its holder stopped renewing (the session lease itself lives as
        // long as the client). Now is after the client took its send time,
        // so the client's lease ends before that undo.
        let tracked_from = Instant::now();
        let raise = session.begin(attached, &fence, tracked_from);
        let sent_again = self.etcd.requests.sent_again();
        let reply = self
            .etcd
            .run_txn_until(deadline, IN_LOCK_CALL, Repeat::Safe, write(&fence, &raise))
            .await?;
        // A try that went unanswered before the one that answered (this
        // client sent some request again meanwhile) may still be applied
        // after it, even after a release: its fence stays pending, so the
        // release leaves the key due for an undo that puts the fence up.
        if self.etcd.requests.sent_again() == sent_again {
            session.settled(attached.id(), &raise, &fence);
        }
        Ok((reply, tracked_from))
    }

    /// The grant of `attached`, created at `fencing` on `session` by a
    /// request tracked from `tracked_from`, dated from the session's last
    /// confirmed keep-alive; an error if the session died meanwhile.
    pub(crate) fn granted(
        session: &Session,
        attached: &Attached,
        fencing: FencingToken,
        tracked_from: Instant,
    ) -> Result<Grant, LockError> {
        session.track(attached, Some(fencing), tracked_from);
        // The server keeps the session lease at least a TTL after the last
        // confirmed keep-alive was sent. A session that died while the
        // request was in flight is being revoked (or expires on the
        // server), taking the new key with it: no lease can be dated from it.
        let Some(confirmed) = session.confirmed_sent_at() else {
            tracing::debug!(key = %String::from_utf8_lossy(attached.key()), fencing = %fencing, "etcd session lost while acquiring; the key goes with it");
            return Err(LockError::unavailable(format!(
                "the {} was taken on an etcd session lease that was lost while the request was in flight (no keep-alive answered within its TTL), so it is gone again; try again",
                attached.what
            )));
        };
        Ok(Grant::new(fencing, session.ttl())
            .with_handle(session_handle(session.lease_id()))
            .clock_started(confirmed))
    }

    /// A renewing acquire: one transaction creates the key on the session
    /// lease of the request's TTL, by `deadline`.
    /// It takes a free key only if nobody is ahead in line (`turn`).
    pub(crate) async fn acquire(
        &self,
        request: AcquireRequest<'_>,
        mut turn: txn::Turn,
        deadline: Instant,
    ) -> Result<AcquireReply, LockError> {
        let key = request.key;
        // A first acquire grants the session lease: both by `deadline`.
        let session = self.session(request.ttl, deadline).await?;
        let marker = turn.place.as_ref().map(|(entry, _)| entry.as_slice());
        let attached = Attached::lock_in_line(&self.etcd.layout, key, request.owner, marker);
        let value = encode_value(request.owner);
        let label = txn::Label::of(&self.etcd.layout, &request);
        loop {
            // The transaction puts up the fences of this acquisition's
            // earlier requests whose outcome is unknown.
            let attaching = self.attach(&session, &attached, deadline, |fence, raise| {
                txn::acquire(
                    attached.key(),
                    &value,
                    &label,
                    session.lease_id(),
                    &turn,
                    Some(fence),
                    raise,
                )
            });
            let (reply, tracked_from) = match attaching.await {
                Ok(answered) => answered,
                Err(e) => {
                    // Unknown outcome, and the session lease cannot be
                    // revoked for one lock: make it due now, so the session
                    // undoes it at its next tick, fence first (see
                    // `crate::fence`): the request, applied after that,
                    // writes nothing.
                    let now = Instant::now();
                    let due = now.checked_sub(session.ttl()).unwrap_or(now);
                    session.track(&attached, None, due);
                    return Err(e);
                }
            };
            let fencing = match txn::acquire_outcome(key, request.owner, &turn, &reply) {
                Ok(AcquireOutcome::Created(fencing)) => fencing,
                Ok(AcquireOutcome::OutOfLine) if turn.place.is_some() => {
                    // Our entry is gone and the line empty: once more, as
                    // an attempt not in line.
                    session.untrack(attached.id());
                    turn.place = None;
                    continue;
                }
                Ok(AcquireOutcome::OutOfLine) => {
                    session.untrack(attached.id());
                    return Ok(crate::backend::try_again());
                }
                Ok(AcquireOutcome::Refused(refused)) => {
                    session.untrack(attached.id());
                    return Ok(refused);
                }
                Err(e) => {
                    session.untrack(attached.id());
                    return Err(e);
                }
            };
            return Self::granted(&session, &attached, fencing, tracked_from)
                .map(AcquireReply::Granted);
        }
    }

    /// Undoes `attached` (created at `fencing`, if known) at once, in the
    /// background: a key a renewing acquire put on `session` but must give
    /// back. The undo is the session's fenced one, as for a key its holder
    /// stopped renewing, so a later request of the same owner that adopts
    /// the key is never undone by it. The handle ends once the undo was
    /// answered (dropping it leaves the undo running).
    pub(crate) fn undo_now(
        &self,
        session: &Arc<Session>,
        attached: &Attached,
        fencing: Option<FencingToken>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        session
            .take(attached, fencing)
            .map(|undo| keepalive::undo_later(&self.etcd, session, undo))
    }

    /// Renews a lock or permit attached to the live `session` with the
    /// session's TTL: one transaction confirms the key is still the one
    /// created at `fencing` and on the session lease; the session's
    /// keep-alives renew it.
    pub(crate) async fn confirm(
        &self,
        attached: &Attached,
        fencing: FencingToken,
        session: &Session,
    ) -> Result<ExtendReply, LockError> {
        // After the client's send time, as in `acquire`.
        let renewed_at = Instant::now();
        let reply = self
            .etcd
            .run_txn(
                IN_LOCK_CALL,
                Repeat::Safe,
                txn::confirm(
                    attached.key(),
                    attached.value(),
                    fencing,
                    session.lease_id(),
                ),
            )
            .await?;
        if !reply.succeeded() {
            session.untrack(attached.id());
            return Ok(ExtendReply::NotHeld);
        }
        match session.confirmed_sent_at() {
            Some(confirmed) if session.renew(attached.id(), renewed_at) => {
                Ok(ExtendReply::Extended(
                    Grant::new(fencing, session.ttl())
                        .with_handle(session_handle(session.lease_id()))
                        .clock_started(confirmed),
                ))
            }
            _ => {
                tracing::debug!(key = %String::from_utf8_lossy(attached.key()), fencing = %fencing, "etcd session {} expired or its session was lost", attached.what);
                Ok(ExtendReply::NotHeld)
            }
        }
    }

    /// [`confirm`](Self::confirm) for many locks or permits of `session`
    /// (at most [`txn::MAX_CONFIRM_BATCH`]) in one transaction of at most
    /// `ranges` range reads over their sorted keys (see
    /// [`txn::read_ranges`]), and a second of single reads only for keys a
    /// range cut short did not reach: one answer per item, in order, each
    /// checked as `confirm`'s compares check it (created at its fencing
    /// token, its value if it has one, still on the session lease). Reads
    /// only: a resend is safe.
    pub(crate) async fn confirm_many(
        &self,
        items: &[(&Attached, FencingToken)],
        session: &Session,
        ranges: usize,
    ) -> Result<Vec<ExtendReply>, LockError> {
        // After the client's send time, as in `acquire`.
        let renewed_at = Instant::now();
        let mut sorted: Vec<usize> = (0..items.len()).collect();
        sorted.sort_by(|&a, &b| items[a].0.key().cmp(items[b].0.key()));
        let keys: Vec<&[u8]> = sorted.iter().map(|&at| items[at].0.key()).collect();
        let (read, runs) = txn::read_ranges(&keys, ranges);
        let reply = self.etcd.run_txn(IN_LOCK_CALL, Repeat::Safe, read).await?;
        let reads = reply.op_responses();
        if reads.len() != runs.len() {
            return Err(answer_count(runs.len(), reads.len()));
        }
        // Each item's entry: `Some(None)` read and absent, `None` not
        // reached by its range.
        let mut entries: Vec<Option<Option<KeyValue>>> = vec![None; items.len()];
        for (run, read) in runs.into_iter().zip(reads) {
            let TxnOpResponse::Get(range) = read else {
                return Err(LockError::unavailable(
                    "etcd answered a range read with another kind of response; try again",
                ));
            };
            let by_key: HashMap<&[u8], &KeyValue> =
                range.kvs().iter().map(|kv| (kv.key(), kv)).collect();
            // Past the last entry of a range cut short, nothing was read.
            let reached = range.kvs().iter().map(KeyValue::key).max();
            for at in run {
                let key = keys[at];
                entries[sorted[at]] = match by_key.get(key) {
                    Some(kv) => Some(Some((*kv).clone())),
                    None if !range.more() || reached.is_some_and(|last| key <= last) => Some(None),
                    None => None,
                };
            }
        }
        let unread: Vec<usize> = (0..items.len())
            .filter(|&at| entries[at].is_none())
            .collect();
        for chunk in unread.chunks(ranges.max(1)) {
            let read = txn::read_many(chunk.iter().map(|&at| items[at].0.key()));
            let reply = self.etcd.run_txn(IN_LOCK_CALL, Repeat::Safe, read).await?;
            let reads = reply.op_responses();
            if reads.len() != chunk.len() {
                return Err(answer_count(chunk.len(), reads.len()));
            }
            for (&at, read) in chunk.iter().zip(reads) {
                entries[at] = Some(match read {
                    TxnOpResponse::Get(range) => range.kvs().first().cloned(),
                    _ => None,
                });
            }
        }
        let confirmed = session.confirmed_sent_at();
        let mut answers = Vec::with_capacity(items.len());
        for ((attached, fencing), entry) in items.iter().zip(entries) {
            let ours = entry.flatten().is_some_and(|kv| {
                u64::try_from(kv.create_revision()).ok() == Some(fencing.get())
                    && kv.lease() == session.lease_id()
                    && kv.value() == attached.value()
            });
            if !ours {
                session.untrack(attached.id());
                answers.push(ExtendReply::NotHeld);
                continue;
            }
            answers.push(match confirmed {
                Some(confirmed) if session.renew(attached.id(), renewed_at) => {
                    ExtendReply::Extended(
                        Grant::new(*fencing, session.ttl())
                            .with_handle(session_handle(session.lease_id()))
                            .clock_started(confirmed),
                    )
                }
                _ => ExtendReply::NotHeld,
            });
        }
        Ok(answers)
    }

    /// Detaches a lock or permit on `handle` from its session's expiry
    /// tracking, if it had one.
    pub(crate) fn untrack(&self, handle: u64, attached: &Attached) {
        if let Some(id) = session_lease_of(handle) {
            if let Some(session) = self.by_lease(id) {
                session.untrack(attached.id());
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A permit's fences go below its semaphore's base, outside the
    /// permits range that attempts read and waiters watch whole (a fence
    /// there would read as a permit distlock did not write); a lock's go
    /// below its key.
    #[test]
    fn fences_lie_outside_the_permits() {
        let layout = KeyLayout::new("ns");
        let key = LockKey::new("sem").expect("a valid key");
        let owner = OwnerToken::random();
        let permit = Attached::permit(&layout, &key, owner, b"0123456789abcdef-0", 3);
        let fence = permit.fence(42);
        assert!(fence.key().starts_with(&layout.semaphore_base(&key)));
        assert!(!fence.key().starts_with(&layout.permits_prefix(&key)));
        assert!(!fence.key().starts_with(&layout.permit_queue_prefix(&key)));
        assert_eq!(permit.key(), layout.permit_key(&key, b"0123456789abcdef-0"));
        assert_eq!(permit.id(), encode_permit(owner, 3));
        assert_eq!(permit.value(), encode_permit(owner, 3));
        let lock = Attached::lock(&layout, &key, owner);
        assert!(lock.fence(42).key().starts_with(&layout.lock_key(&key)));
        assert_ne!(lock.id(), permit.id(), "a lock and a permit of one owner");
    }

    #[test]
    fn handles_round_trip() {
        assert_eq!(session_lease_of(session_handle(42)), Some(42));
        assert_eq!(session_lease_of(42), None);
        assert_eq!(session_lease_of(0), None);
        assert_eq!(session_lease_of(session_handle(i64::MAX)), Some(i64::MAX));
    }
}
