//! The etcd transactions behind acquire, extend and release.
//!
//! Each is one `Txn` request, so the comparison and the write happen
//! atomically on the server:
//!
//! - acquire: `if create_revision(key) == 0 and <no waiter ahead> then
//!   put(key, value, lease); hold(own queue entry) else (if value(key) ==
//!   ours then put(key, value, lease); hold(own queue entry); get(key) else
//!   get(key)); get(line's head)` (a renewing one also only while its
//!   fence is down, see
//!   [`crate::fence`]). "No waiter ahead" ([`Turn`]) is one compare over the
//!   key's waiter queue prefix: for an attempt without a queue entry (a
//!   `try_lock`), `create_revision == 0` over the whole range, which etcd
//!   evaluates on an empty range as on one missing key (create revision 0,
//!   true) and otherwise on every entry (false); for a waiter whose entry
//!   was created at revision `R`, `create_revision > R - 1` over the range:
//!   every entry, its own included, is at `R` or later. The refused
//!   branch reads the line's head, so a refusal on a free key is told from
//!   a vanished key in the same request;
//!   the put's revision (the transaction's header revision) is the key's
//!   `create_revision` and becomes the fencing token. The nested branch
//!   adopts a lock an earlier attempt of the same acquisition took: its TTL
//!   starts again on this attempt's lease, its fencing token is unchanged.
//!   `hold`: a waiter's entry becomes the holder's marker, on the lock's
//!   lease (see [`crate::marker`]).
//! - extend: `if value(key) == ours and create_revision(key) == fencing then
//!   put(key, value, new_lease)`; a missing key fails the comparison, so an
//!   expired lock is never recreated.
//! - confirm (renewing a lock or permit on a session lease): `if value(key)
//!   == ours and create_revision(key) == fencing and lease(key) == session`
//!   (a permit's value unchecked: its key names its owner) with only a
//!   count-only read; the session's keep-alive does the renewing.
//! - release: `if value(key) == ours and create_revision(key) == fencing then delete(key)`.
//!
//! A lock's holder label (its sibling key, see [`crate::keys`]) rides in
//! the same transactions, so it costs no round trip: an acquire (and an
//! adoption) puts it on the lock's lease, or deletes whatever an earlier
//! holder left there when it has none; an extend moves it with the key to
//! the new lease; a release, the session's undo and a force release
//! delete it with the key. So does the holder's marker, when a waiter took
//! the lock: an extend moves it, a release, the session's undo and a force
//! release delete it.
//!
//! Permits (see [`crate::semaphore`]), whose key names their owner:
//!
//! - join: `if create_revision(permit) == 0 then put(permit, value, lease);
//!   get(permits) else (if value(permit) == ours then put(permit, value,
//!   lease); get(permits) else get(permits))`: the permit's place is its
//!   create revision, which is also its fencing token; a put again (the
//!   nested branch, adoption) keeps it. A renewing one on a session lease
//!   is fenced as a renewing acquire.
//! - move (extend, unless on a session lease and its TTL: then confirm):
//!   `if create_revision(permit) == fencing then put(permit, same value,
//!   new_lease)`.
//! - release: `if create_revision(permit) == fencing then delete(permit)`.
//!
//! A permit's holder label (its sibling key, named by its owner as the
//! permit is) rides in the same transactions: join puts it on the permit's
//! lease with the permit (a permit without a label writes none), move
//! moves it, release and the session's undo delete it.

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};
use std::time::Duration;

use distlock_core::{
    AcquireReply, AcquireRequest, FencingToken, LockError, LockKey, OwnerToken, PermitRequest,
};

use crate::fence::Fence;
use crate::keys::{decode_value, encode_holder, KeyLayout};
use crate::marker;

/// A lock's holder-label key, and the label value an acquisition stores
/// there (`None`: it has no label).
#[derive(Debug, Clone)]
pub(crate) struct Label {
    /// The label key ([`KeyLayout::holder_key`]).
    pub(crate) key: Vec<u8>,
    /// [`encode_holder`] of the owner and label.
    pub(crate) value: Option<Vec<u8>>,
}

impl Label {
    /// What `request` stores as its holder's label.
    pub(crate) fn of(layout: &KeyLayout, request: &AcquireRequest<'_>) -> Self {
        Self {
            key: layout.holder_key(request.key),
            value: request
                .holder
                .map(|holder| encode_holder(request.owner, holder)),
        }
    }

    /// What `request` stores as its permit's holder label.
    pub(crate) fn of_permit(layout: &KeyLayout, request: &PermitRequest<'_>) -> Self {
        Self {
            key: layout.permit_holder_key(request.key, request.owner),
            value: request
                .holder
                .map(|holder| encode_holder(request.owner, holder)),
        }
    }

    /// Stores a permit's label on `lease_id` with it; nothing without one
    /// (the key is the permit owner's own: nobody else's label is there).
    fn put_on(&self, lease_id: i64) -> Option<TxnOp> {
        let value = self.value.as_ref()?;
        Some(TxnOp::put(
            self.key.clone(),
            value.clone(),
            Some(PutOptions::new().with_lease(lease_id)),
        ))
    }

    /// Stores the label on `lease_id` with the lock; without one, deletes
    /// whatever an earlier holder left (it is never shown for this owner
    /// anyway, but it need not linger).
    fn write(&self, lease_id: i64) -> TxnOp {
        match &self.value {
            Some(value) => TxnOp::put(
                self.key.clone(),
                value.clone(),
                Some(PutOptions::new().with_lease(lease_id)),
            ),
            None => TxnOp::delete(self.key.clone(), None),
        }
    }
}

/// The acquire transaction. A `fence`d one writes nothing once its fence
/// is up; either branch puts the fences in `raise` up (earlier requests of
/// the same acquisition whose outcome is unknown; see [`crate::fence`]).
/// Whatever takes or adopts the lock also writes its `label`.
/// The `turn` the attempt claims: it takes a free key only if no waiter
/// queued before it ([`Turn`]); a waiter that takes it leaves its line in
/// the same transaction.
pub(crate) fn acquire(
    key: &[u8],
    value: &[u8],
    label: &Label,
    lease_id: i64,
    turn: &Turn,
    fence: Option<&Fence>,
    raise: &[Fence],
) -> Txn {
    let put = || TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease_id)));
    let mut when = vec![Compare::create_revision(key, CompareOp::Equal, 0)];
    when.extend(turn.no_one_ahead());
    when.extend(fence.map(Fence::down));
    let mut then = vec![put(), label.write(lease_id)];
    then.extend(turn.leave(lease_id));
    // Adoption: a key that holds this acquisition's value was taken by an
    // earlier attempt whose reply was lost. Putting it again on this
    // attempt's lease resets its TTL from now (a put keeps the key's
    // create revision, so the fencing token stays), and the earlier
    // attempt's lease, revoked once its outcome was unknown, no longer
    // bounds it.
    let mut adopt_when = vec![Compare::value(key, CompareOp::Equal, value)];
    adopt_when.extend(fence.map(Fence::down));
    // The label moves to this lease too, or would go with the revoked one.
    // A waiter leaves its line here too (its entry may be a newer one than
    // the attempt that took the key claimed).
    let mut adopted = vec![put(), label.write(lease_id), TxnOp::get(key, None)];
    adopted.extend(turn.leave(lease_id));
    let adopt = Txn::new()
        .when(adopt_when)
        .and_then(adopted)
        .or_else([TxnOp::get(key, None)]);
    let mut otherwise = vec![TxnOp::txn(adopt), turn.read_head()];
    then.extend(raise.iter().map(Fence::raise));
    otherwise.extend(raise.iter().map(Fence::raise));
    Txn::new().when(when).and_then(then).or_else(otherwise)
}

/// The line an acquire attempt must not cut into, and the requester's
/// place in it (see [`crate::queue`]): rule one of fair handoff, no
/// cut-in. A free key is granted only if no queue entry of another waiter
/// is ahead of the requester's.
#[derive(Debug, Clone)]
pub(crate) struct Turn {
    /// The key's waiter queue prefix, `NS/lock/<escaped key>/waiters/`.
    pub(crate) line: Vec<u8>,
    /// The requester's queue entry and its create revision (its place);
    /// `None`: an attempt that is not in line (a `try_lock`), which only
    /// an empty line lets through.
    pub(crate) place: Option<(Vec<u8>, i64)>,
    /// The waiter's task found nobody ahead of `place` (a linearizable
    /// read of the entries created before it). Nobody can be ahead later
    /// either: an entry's create revision is its place, and entries join
    /// with new revisions, behind. The attempt then skips the compare over
    /// the line, which etcd evaluates by reading every entry in it, in
    /// the serial apply of every write (a crowd of 256: 256 entries read
    /// in each handoff's grant).
    pub(crate) known_first: bool,
}

impl Turn {
    /// Nobody is ahead: an empty line (no place), or no entry created
    /// before ours. An empty range compares as one missing key (create
    /// revision 0): true for `== 0`, false for `> R - 1`, so a waiter
    /// whose own entry is gone is refused, and tries again without a
    /// place ([`AcquireOutcome::OutOfLine`]).
    /// `None` for a waiter known first (see [`Turn::known_first`]): it
    /// would always hold, but for an empty line (the waiter's own entry
    /// gone), which would only refuse it until it tries without a place.
    fn no_one_ahead(&self) -> Option<Compare> {
        let (op, revision) = match &self.place {
            Some(_) if self.known_first => return None,
            None => (CompareOp::Equal, 0),
            Some((_, place)) => (CompareOp::Greater, place.saturating_sub(1)),
        };
        Some(Compare::create_revision(self.line.clone(), op, revision).with_prefix())
    }

    /// A waiter that takes the key leaves the line with it: its entry
    /// stays as the holder's marker, on the lock's lease, which tells its
    /// successor's watch it is first now (see [`crate::marker`]).
    fn leave(&self, lease_id: i64) -> Option<TxnOp> {
        self.place
            .as_ref()
            .map(|(entry, place)| marker::hold(entry, *place, lease_id))
    }

    /// The line's first entry (the oldest), read where the attempt is
    /// refused.
    fn read_head(&self) -> TxnOp {
        TxnOp::get(
            self.line.clone(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(1),
            ),
        )
    }

    /// Whether `head` (the line's first entry) is someone else's.
    fn ahead(&self, head: &KeyValue) -> bool {
        self.place
            .as_ref()
            .is_none_or(|(entry, place)| head.key() != entry && head.create_revision() < *place)
    }
}

/// What a [`probe`] reads of the line besides the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ahead {
    /// Nothing (a waiter first in line).
    Nobody,
    /// One queue entry: the one a waiter's task watches, or one of this
    /// client's own waiters (ahead of an attempt not in line).
    Entry(Vec<u8>),
    /// The line's first key in key order (`limit 1`, no sort: etcd reads
    /// that one key), for an attempt not in line.
    AnyOf(Vec<u8>),
}

/// A read-only look at whether an acquire would take `key`, sent first by
/// an attempt that expects to be refused (so a refusal costs one read, no
/// lease and no Raft proposal): the key, and what `ahead` names. Point
/// reads: the acquire's own compare over the line reads every entry in
/// it, and a waiter's task knows who is ahead (entries only leave the line
/// before it; none joins there).
pub(crate) fn probe(key: &[u8], ahead: &Ahead) -> Txn {
    let mut reads = vec![TxnOp::get(key, None)];
    match ahead {
        Ahead::Nobody => {}
        // With its value (a few bytes): an entry is checked for foreign
        // data as the acquire checks the line.
        Ahead::Entry(entry) => reads.push(TxnOp::get(entry.as_slice(), None)),
        Ahead::AnyOf(line) => reads.push(TxnOp::get(
            line.as_slice(),
            Some(GetOptions::new().with_prefix().with_limit(1)),
        )),
    }
    Txn::new().and_then(reads)
}

/// What a [`probe`] found: `Some(refusal)` if the key is held by another
/// owner or the entry ahead is still there, before `turn`'s place (an
/// entry put again after its lease was lost is behind; every entry is
/// ahead of an attempt not in line); `None` if the
/// acquire may be granted or adopted (then it goes, and its compares
/// decide).
pub(crate) fn probed(
    key: &LockKey,
    owner: OwnerToken,
    turn: &Turn,
    reply: &TxnResponse,
) -> Result<Option<AcquireReply>, LockError> {
    let mut gets = reply.op_responses().into_iter().filter_map(|op| match op {
        TxnOpResponse::Get(get) => Some(get.kvs().first().cloned()),
        _ => None,
    });
    let (found, ahead) = (gets.next().flatten(), gets.next().flatten());
    if let Some(kv) = found {
        if check_found(kv.value(), kv.lease())? == owner {
            return Ok(None);
        }
        return Ok(Some(held_by_another(key, &kv)));
    }
    // Not in line: any entry is ahead.
    let place = turn.place.as_ref().map_or(i64::MAX, |(_, place)| *place);
    let Some(entry) = ahead.filter(|entry| entry.create_revision() < place) else {
        return Ok(None);
    };
    // A key distlock did not write is reported, as the acquire would.
    crate::queue::check_entry(&turn.line, &entry)?;
    tracing::trace!(key = %key, ahead = %String::from_utf8_lossy(entry.key()), "etcd lock free, but a waiter is ahead in line");
    // Woken by its task's watch once that one leaves, as in `behind`.
    Ok(Some(AcquireReply::Held { expires_in: None }))
}

/// The refusal of an attempt on a key held by another owner.
fn held_by_another(key: &LockKey, kv: &KeyValue) -> AcquireReply {
    tracing::trace!(key = %key, holder_lease = kv.lease(), "etcd lock held by another owner");
    // The holder's lease may be a session lease, renewed for as long as
    // its holder wants: no expiry to predict.
    AcquireReply::Held { expires_in: None }
}

/// The refusal of an attempt on a free key whose line's `head` is another
/// waiter's. No expiry to wait for: the head is woken by its own watch, and
/// a refused waiter by its own when it becomes first (its turn ends with
/// the head's, whose entry goes when its wait ends or with its client's
/// session lease). A head distlock did not write is reported.
fn behind(key: &LockKey, turn: &Turn, head: &KeyValue) -> Result<AcquireReply, LockError> {
    crate::queue::check_entry(&turn.line, head)?;
    tracing::trace!(key = %key, head = %String::from_utf8_lossy(head.key()), "etcd lock free, but another waiter is first in line");
    Ok(AcquireReply::Held { expires_in: None })
}

/// The session's undo of a lock or permit attached to `session_lease`
/// whose holder stopped renewing it (or whose acquire's outcome is
/// unknown): deletes it if it is still `value`'s (its owner's: a permit's
/// name is reused by later acquisitions) and, if known, still the
/// acquisition of `fencing`, and in either branch puts up `raise`, the
/// fences of the owner's requests whose outcome is unknown, so none of
/// them takes the key after this. The undo is itself fenced by `fence`:
/// applied after a later undo or acquire of the same owner put it up, it
/// does nothing. A lock's `label_key` goes with it, and its holder's
/// `marker` if it has one; so does the marker of a lock no longer
/// `value`'s (see [`release`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn undo_session_lock(
    key: &[u8],
    value: &[u8],
    label_key: Option<&[u8]>,
    session_lease: i64,
    fencing: Option<FencingToken>,
    fence: &Fence,
    raise: &[Fence],
    marker: Option<&[u8]>,
) -> Txn {
    let mut when = vec![
        Compare::value(key, CompareOp::Equal, value),
        Compare::lease(key, CompareOp::Equal, session_lease),
    ];
    when.push(fence.down());
    if let Some(fencing) = fencing {
        when.push(Compare::create_revision(
            key,
            CompareOp::Equal,
            i64::try_from(fencing.get()).unwrap_or(i64::MAX),
        ));
    }
    let mut then = vec![TxnOp::delete(key, None)];
    then.extend(label_key.map(|label| TxnOp::delete(label, None)));
    then.extend(raise.iter().map(Fence::raise));
    then.extend(marker.map(marker::delete));
    let mut otherwise: Vec<TxnOp> = raise.iter().map(Fence::raise).collect();
    otherwise.extend(marker.map(|m| marker::delete_unless_held(key, value, m)));
    Txn::new().when(when).and_then(then).or_else(otherwise)
}

/// A waiter's queue entry `entry` on `lease`, with `reads` in the same
/// transaction; fenced by `fence`: applied after the entry's undo (see
/// [`dequeue`]), it writes nothing. Nor does it where the entry exists:
/// a put keeps a key's create revision, so it would take over an older
/// entry's place (names are reused, see `queue::slots`).
pub(crate) fn enqueue(
    entry: &[u8],
    value: &[u8],
    lease: i64,
    fence: &Fence,
    reads: impl IntoIterator<Item = TxnOp>,
) -> Txn {
    let mut ops = vec![TxnOp::put(
        entry,
        value,
        Some(PutOptions::new().with_lease(lease)),
    )];
    ops.extend(reads);
    Txn::new()
        .when([
            fence.down(),
            Compare::create_revision(entry, CompareOp::Equal, 0),
        ])
        .and_then(ops)
}

/// Deletes a queue entry and puts up `fences` (of its puts whose outcome
/// is unknown), in one transaction. Given its `place` (its create
/// revision), it deletes only the entry created there: entry names are
/// reused (see `queue::slots`), and a dequeue applied late must not take
/// a newer entry of the same name.
pub(crate) fn dequeue(entry: &[u8], place: Option<i64>, fences: &[Fence]) -> Txn {
    let mut then = vec![TxnOp::delete(entry, None)];
    then.extend(fences.iter().map(Fence::raise));
    match place {
        Some(place) => Txn::new()
            .when([Compare::create_revision(entry, CompareOp::Equal, place)])
            .and_then(then)
            .or_else(fences.iter().map(Fence::raise).collect::<Vec<_>>()),
        None => Txn::new().and_then(then),
    }
}

/// The comparisons that prove the lock is still this acquisition's.
fn ours(key: &[u8], value: &[u8], fencing: FencingToken) -> Vec<Compare> {
    vec![
        Compare::value(key, CompareOp::Equal, value),
        created_at(key, fencing),
    ]
}

/// The key was created by the acquisition of `fencing`.
fn created_at(key: &[u8], fencing: FencingToken) -> Compare {
    Compare::create_revision(
        key,
        CompareOp::Equal,
        i64::try_from(fencing.get()).unwrap_or(i64::MAX),
    )
}

/// The extend transaction: moves the key, and its label key and its
/// holder's `marker` if there are, to `new_lease_id` (the old lease is
/// revoked after, which would take a label or marker left on it).
pub(crate) fn extend(
    key: &[u8],
    value: &[u8],
    label_key: &[u8],
    fencing: FencingToken,
    new_lease_id: i64,
    marker: Option<&[u8]>,
) -> Txn {
    // The label may be an earlier holder's, left by a client that did not
    // remove it: moved, it just goes with our lease.
    let mut then = vec![
        TxnOp::put(key, value, Some(PutOptions::new().with_lease(new_lease_id))),
        move_label(label_key, new_lease_id),
    ];
    then.extend(marker.map(|m| marker::move_to(m, new_lease_id)));
    Txn::new().when(ours(key, value, fencing)).and_then(then)
}

/// Moves `label_key`, if there is one, to `new_lease_id`, its value kept.
/// A put that keeps the value fails the whole transaction on a missing
/// key, hence the nested check.
fn move_label(label_key: &[u8], new_lease_id: i64) -> TxnOp {
    TxnOp::txn(
        Txn::new()
            .when([Compare::version(label_key, CompareOp::Greater, 0)])
            .and_then([TxnOp::put(
                label_key,
                Vec::new(),
                Some(
                    PutOptions::new()
                        .with_lease(new_lease_id)
                        .with_ignore_value(),
                ),
            )]),
    )
}

/// The most operations etcd takes in one transaction by default
/// (`--max-txn-ops`): a batched confirm sends at most this many reads.
pub(crate) const MAX_TXN_OPS: usize = 128;

/// The most locks one batched confirm answers: they are read as ranges
/// over runs of their sorted keys, at most `--max-txn-ops` ranges a
/// transaction.
pub(crate) const MAX_CONFIRM_BATCH: usize = 1024;

/// The batched confirm (see [`confirm`]), first read: `keys` (sorted) as at
/// most `ranges` linearizable range reads, each over a run of consecutive
/// keys, so one transaction reads more keys than `--max-txn-ops`. The
/// client checks each key's entry as `confirm`'s compares would. A range
/// also returns whatever else lies between its keys (holder labels, other
/// clients' locks), at most [`range_limit`] entries; where that limit cuts
/// it short (its reply says `more`), the keys past its last entry are read
/// again alone ([`read_many`]). Returns the transaction and each range's
/// run, as index ranges into `keys`. Every read is linearizable (the
/// default), so the transaction is served by the leader's state, as
/// `confirm` is.
pub(crate) fn read_ranges(keys: &[&[u8]], ranges: usize) -> (Txn, Vec<std::ops::Range<usize>>) {
    let runs = runs(keys.len(), ranges);
    let reads = runs
        .iter()
        .map(|run| {
            let first = keys[run.start];
            // The smallest key after the run's last: the range includes it.
            let mut end = keys[run.end - 1].to_vec();
            end.push(0);
            TxnOp::get(
                first,
                Some(
                    GetOptions::new()
                        .with_range(end)
                        .with_limit(range_limit(run.len())),
                ),
            )
        })
        .collect::<Vec<_>>();
    (Txn::new().and_then(reads), runs)
}

/// How many range reads [`read_ranges`] sends for `n` keys.
pub(crate) fn range_reads(n: usize, ranges: usize) -> usize {
    runs(n, ranges).len()
}

/// `n` items in at most `ranges` runs of nearly equal length (none empty).
fn runs(n: usize, ranges: usize) -> Vec<std::ops::Range<usize>> {
    let per = n.div_ceil(ranges.max(1)).max(1);
    (0..n)
        .step_by(per)
        .map(|start| start..(start + per).min(n))
        .collect()
}

/// The most entries a range over `keys` of ours returns: each key, its
/// holder label and room for some foreign keys between them. A bound, so a
/// namespace crowded with other keys cannot make one reply huge.
fn range_limit(keys: usize) -> i64 {
    i64::try_from(keys.saturating_mul(3).saturating_add(16)).unwrap_or(i64::MAX)
}

/// The batched confirm's second read (see [`read_ranges`]): one
/// linearizable read of each key, for keys a cut-short range did not reach.
pub(crate) fn read_many<'a>(keys: impl IntoIterator<Item = &'a [u8]>) -> Txn {
    Txn::new().and_then(
        keys.into_iter()
            .map(|key| TxnOp::get(key, None))
            .collect::<Vec<_>>(),
    )
}

/// The confirm transaction for a lock or permit on a session lease:
/// succeeds, without writing anything, if the key is still this
/// acquisition's (created at `fencing`, and holding `value` if given: a
/// permit's key names its owner) and still attached to `session_lease_id`.
///
/// It carries a read of the key (a linearizable one, the default): etcd
/// serves a transaction whose every operation is a serializable read (and
/// so one with no operation at all) from the answering member's own state,
/// which on a cluster may lag the leader. A compare-only confirm then said
/// "not held" for a lock just taken (seen on a loaded 3-member cluster: a
/// confirm answered at revision 5195 for a lock created at 5196), and
/// could as well confirm a lock already deleted and taken by another
/// client.
pub(crate) fn confirm(
    key: &[u8],
    value: &[u8],
    fencing: FencingToken,
    session_lease_id: i64,
) -> Txn {
    let mut when = ours(key, value, fencing);
    when.push(Compare::lease(key, CompareOp::Equal, session_lease_id));
    let linearizable = || TxnOp::get(key, Some(GetOptions::new().with_count_only()));
    Txn::new()
        .when(when)
        .and_then([linearizable()])
        .or_else([linearizable()])
}

/// The release transaction; the label key goes with the lock, and so
/// does its holder's `marker` if it has one (see [`crate::marker`]),
/// which also goes if the lock no longer holds our value: its successor
/// waits on it.
pub(crate) fn release(
    key: &[u8],
    value: &[u8],
    label_key: &[u8],
    fencing: FencingToken,
    marker: Option<&[u8]>,
) -> Txn {
    let mut then = vec![TxnOp::delete(key, None), TxnOp::delete(label_key, None)];
    then.extend(marker.map(marker::delete));
    Txn::new()
        .when(ours(key, value, fencing))
        .and_then(then)
        .or_else(
            marker
                .map(|m| marker::delete_unless_held(key, value, m))
                .into_iter()
                .collect::<Vec<_>>(),
        )
}

/// A permit is still the one granted with `fencing` (its key names its
/// owner, its create revision the grant).
fn permit_held(permit: &[u8], fencing: i64) -> Compare {
    Compare::create_revision(permit, CompareOp::Equal, fencing)
}

/// Reads every permit of a semaphore, oldest first.
pub(crate) fn read_permits(permits: &[u8]) -> TxnOp {
    TxnOp::get(
        permits,
        Some(
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend),
        ),
    )
}

/// The permit attempt: puts `permit` on `lease` and reads every permit,
/// oldest first. A permit that holds this attempt's `value` already (an
/// earlier attempt of the owner, applied unseen) is put again on `lease`,
/// which keeps its create revision (its place and fencing token) and
/// starts its TTL again; any other value is only read. As a renewing
/// acquire's, an attempt on a session lease is `fence`d (it writes nothing
/// once its fence is up) and puts up `raise` in either branch.
pub(crate) fn join_permits(
    permit: &[u8],
    value: &[u8],
    label: &Label,
    lease: i64,
    permits: &[u8],
    fence: Option<&Fence>,
    raise: &[Fence],
) -> Txn {
    // The permit, its label (if any) on the same lease, and the read.
    let put = || {
        let mut ops = vec![TxnOp::put(
            permit,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )];
        ops.extend(label.put_on(lease));
        ops.push(read_permits(permits));
        ops
    };
    let mut adopt_when = vec![Compare::value(permit, CompareOp::Equal, value)];
    adopt_when.extend(fence.map(Fence::down));
    let adopt = Txn::new()
        .when(adopt_when)
        .and_then(put())
        .or_else([read_permits(permits)]);
    let mut when = vec![Compare::create_revision(permit, CompareOp::Equal, 0)];
    when.extend(fence.map(Fence::down));
    let mut then = put();
    let mut otherwise = vec![TxnOp::txn(adopt)];
    then.extend(raise.iter().map(Fence::raise));
    otherwise.extend(raise.iter().map(Fence::raise));
    Txn::new().when(when).and_then(then).or_else(otherwise)
}

/// What [`join_permits`] read, and whether it put the permit.
pub(crate) fn joined_permits(reply: &TxnResponse) -> (bool, Vec<KeyValue>) {
    let read = |ops: Vec<TxnOpResponse>| {
        ops.into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().to_vec()),
            _ => None,
        })
    };
    if reply.succeeded() {
        return (true, read(reply.op_responses()).unwrap_or_default());
    }
    reply
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            TxnOpResponse::Txn(nested) => Some((
                nested.succeeded(),
                read(nested.op_responses()).unwrap_or_default(),
            )),
            _ => None,
        })
        .unwrap_or_default()
}

/// Moves the permit created at `fencing` to `lease` (its value kept), so
/// its TTL starts again; its label (at `label_key`) moves with it.
pub(crate) fn move_permit(permit: &[u8], label_key: &[u8], fencing: i64, lease: i64) -> Txn {
    Txn::new().when([permit_held(permit, fencing)]).and_then([
        TxnOp::put(
            permit,
            Vec::new(),
            Some(PutOptions::new().with_lease(lease).with_ignore_value()),
        ),
        move_label(label_key, lease),
    ])
}

/// Deletes the permit created at `fencing`, and its label at `label_key`.
pub(crate) fn release_permit(permit: &[u8], label_key: &[u8], fencing: i64) -> Txn {
    Txn::new()
        .when([permit_held(permit, fencing)])
        .and_then([TxnOp::delete(permit, None), TxnOp::delete(label_key, None)])
}

/// What the acquire transaction found.
#[derive(Debug)]
pub(crate) enum AcquireOutcome {
    /// We created the key; its create revision.
    Created(FencingToken),
    /// Someone else holds it, or another waiter is ahead in line (or,
    /// impossible in one transaction but answered as "try again at once",
    /// the key vanished between compare and get).
    Refused(AcquireReply),
    /// The key is free and the line empty, but the attempt claimed a place
    /// whose entry is gone (its session lease was lost, or an earlier grant
    /// of this wait took it out): try again without a place.
    OutOfLine,
}

/// Reads the acquire transaction's reply. A value we did not write, or a
/// lock without a lease (it would never expire), is `Corrupted`. A lock
/// that holds `owner`'s token is this acquisition's: an earlier send of
/// the same transaction took it (its reply was lost), so it was created.
pub(crate) fn acquire_outcome(
    key: &LockKey,
    owner: OwnerToken,
    turn: &Turn,
    reply: &TxnResponse,
) -> Result<AcquireOutcome, LockError> {
    if reply.succeeded() {
        let revision = reply.header().map(|h| h.revision()).unwrap_or(0);
        return u64::try_from(revision)
            .ok()
            .filter(|r| *r > 0)
            .map(|r| AcquireOutcome::Created(FencingToken::new(r)))
            .ok_or_else(|| {
                LockError::unavailable(format!(
                    "etcd acquired the lock but returned no revision (header {revision})"
                ))
            });
    }
    let gone = AcquireOutcome::Refused(AcquireReply::Held {
        expires_in: Some(Duration::ZERO),
    });
    let Some(nested) = reply.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Txn(nested) => Some(nested),
        _ => None,
    }) else {
        return Err(LockError::unavailable(
            "etcd answered without the adoption step's reply",
        ));
    };
    // The line's head, read in the refused branch.
    let head = reply.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => Some(get.kvs().first().cloned()),
        _ => None,
    });
    for op in nested.op_responses() {
        if let TxnOpResponse::Get(get) = op {
            let Some(kv) = get.kvs().first() else {
                // Free: refused for the line (or by a fence).
                return match head {
                    Some(Some(head)) if turn.ahead(&head) => {
                        behind(key, turn, &head).map(AcquireOutcome::Refused)
                    }
                    Some(None) if turn.place.is_some() => Ok(AcquireOutcome::OutOfLine),
                    _ => Ok(gone),
                };
            };
            if check_found(kv.value(), kv.lease())? == owner {
                if !nested.succeeded() {
                    // Ours by its value, yet the adoption's comparison
                    // failed: only its fence (a later undo) can do that.
                    return Ok(gone);
                }
                tracing::debug!(key = %key, "etcd acquire adopted the lock an earlier attempt took");
                return u64::try_from(kv.create_revision())
                    .ok()
                    .filter(|r| *r > 0)
                    .map(|r| AcquireOutcome::Created(FencingToken::new(r)))
                    .ok_or_else(|| {
                        LockError::unavailable("etcd returned the lock without a create revision")
                    });
            }
            return Ok(AcquireOutcome::Refused(held_by_another(key, kv)));
        }
    }
    Ok(gone)
}

/// Refuses a value distlock did not write at a lock key.
pub(crate) fn check_found(value: &[u8], lease_id: i64) -> Result<OwnerToken, LockError> {
    let Some(owner) = decode_value(value) else {
        return Err(LockError::corrupted(format!(
            "the lock's etcd key holds a value distlock did not write ({} bytes); it was left untouched — remove it or use another namespace",
            value.len()
        )));
    };
    if lease_id == 0 {
        return Err(LockError::corrupted(
            "the lock's etcd key has no lease, so it would never expire; distlock never writes that — it was left untouched, delete it by hand",
        ));
    }
    Ok(owner)
}

#[cfg(test)]
mod tests {
    //! The fences against a real etcd: a request whose outcome was unknown,
    //! applied by the server only after its undo (a request that sat in a
    //! socket buffer, or came over a connection the client had given up),
    //! writes nothing. Each test replays the request after the undo, as
    //! such a late application does; the control shows the same request
    //! without its fence would have taken effect.

    use std::sync::Arc;

    use distlock_conformance::server::{Etcd, ServerProcess};
    use etcd_client::Client;

    use super::*;

    /// Every item in exactly one run, in order, at most `ranges` runs.
    #[test]
    fn runs_cover_every_item_once() {
        for (n, ranges) in [
            (1, 128),
            (10, 128),
            (128, 128),
            (129, 128),
            (1024, 128),
            (10, 3),
            (10, 0),
            (7, 1),
        ] {
            let runs = runs(n, ranges);
            assert!(runs.len() <= ranges.max(1), "{n} in {ranges}: {runs:?}");
            assert!(runs.iter().all(|r| !r.is_empty()), "{runs:?}");
            let covered: Vec<usize> = runs.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(covered, (0..n).collect::<Vec<_>>(), "{n} in {ranges}");
        }
    }

    async fn etcd() -> (ServerProcess, Client, i64) {
        let server = ServerProcess::start(Arc::new(Etcd)).expect("an etcd server must start");
        let mut client = Client::connect([server.addr().to_string()], None)
            .await
            .expect("connect");
        let lease = client.lease_grant(60, None).await.expect("lease").id();
        (server, client, lease)
    }

    /// No label: these tests are about the lock key.
    fn unlabelled() -> Label {
        Label {
            key: b"ns/lock/unlabelled/holder".to_vec(),
            value: None,
        }
    }

    /// An attempt not in line, on a key nobody waits for.
    fn no_line() -> Turn {
        Turn {
            line: b"ns/lock/unlabelled/waiters/".to_vec(),
            place: None,
            known_first: false,
        }
    }

    async fn exists(client: &mut Client, key: &[u8]) -> bool {
        !client.get(key, None).await.expect("get").kvs().is_empty()
    }

    /// The place (create revision) and lease of the holder's marker at
    /// `entry`, if it is one.
    async fn marker_of(client: &mut Client, entry: &[u8]) -> Option<(i64, i64)> {
        let reply = client.get(entry, None).await.expect("get");
        let kv = reply.kvs().first()?;
        marker::is_marker(kv).then(|| (kv.create_revision(), kv.lease()))
    }

    /// A renewing acquire on a session lease whose undo ran first.
    #[tokio::test]
    async fn a_renewing_acquire_applied_after_its_undo_takes_nothing() {
        let (_server, mut client, session) = etcd().await;
        let (key, value) = (b"ns/lock/late".to_vec(), b"owner".to_vec());
        let fence = Fence::new(&key, session);
        let late = acquire(
            &key,
            &value,
            &unlabelled(),
            session,
            &no_line(),
            Some(&fence),
            &[],
        );
        let undo_fence = Fence::new(&key, session);
        let undo = undo_session_lock(
            &key,
            &value,
            None,
            session,
            None,
            &undo_fence,
            std::slice::from_ref(&fence),
            None,
        );
        client.txn(undo).await.expect("undo");
        let reply = client.txn(late).await.expect("late acquire");
        assert!(!reply.succeeded(), "the late acquire took the lock");
        assert!(!exists(&mut client, &key).await, "a lock was left");
        let unfenced = acquire(&key, &value, &unlabelled(), session, &no_line(), None, &[]);
        assert!(
            client.txn(unfenced).await.expect("control").succeeded(),
            "control: the same acquire without its fence takes the free lock"
        );
    }

    /// The confirm of a session lock is not a compare-only transaction:
    /// etcd serves those from the answering member's own (possibly stale)
    /// state. Its read makes etcd answer it linearizably; the reply shows
    /// the read in either branch. A permit's confirm (no value to compare)
    /// still fails for another acquisition's create revision.
    #[tokio::test]
    async fn a_confirm_carries_a_linearizable_read() {
        let (_server, mut client, session) = etcd().await;
        let (key, value) = (b"ns/lock/confirmed".to_vec(), b"owner".to_vec());
        let created = client
            .txn(acquire(
                &key,
                &value,
                &unlabelled(),
                session,
                &no_line(),
                None,
                &[],
            ))
            .await
            .expect("acquire");
        let fencing = FencingToken::new(created.header().expect("header").revision() as u64);
        let other = FencingToken::new(fencing.get() - 1);
        for (value, fencing, lease, held) in [
            (&value[..], fencing, session, true),
            (&value[..], fencing, session + 1, false),
            (&b"another"[..], fencing, session, false),
            (&value[..], other, session, false),
        ] {
            let reply = client
                .txn(confirm(&key, value, fencing, lease))
                .await
                .expect("confirm");
            assert_eq!(
                reply.succeeded(),
                held,
                "confirm of value {value:?}, fencing {fencing}, lease {lease}"
            );
            assert!(
                matches!(reply.op_responses().as_slice(), [TxnOpResponse::Get(_)]),
                "the confirm (held: {held}) carries no read, so a cluster member may answer it from stale state"
            );
        }
    }

    /// No cut-in, on a real etcd (range compares, etcd >= 3.3): an attempt
    /// not in line takes a free key only while its line is empty (an empty
    /// range compares as a missing key); a waiter only while no entry is
    /// older than its own, and it leaves the line with the key; a waiter
    /// whose entry is gone is refused as out of line.
    #[tokio::test]
    async fn a_free_key_goes_to_the_head_of_its_line() {
        let (_server, mut client, lease) = etcd().await;
        let layout = KeyLayout::new("ns");
        let lock_key = LockKey::new("fair").unwrap();
        let key = layout.lock_key(&lock_key);
        let line = layout.queue_prefix(&lock_key);
        let label = Label {
            key: layout.holder_key(&lock_key),
            value: None,
        };
        let place = |id: &str| {
            let entry = layout.queue_entry(&lock_key, id);
            let mut client = client.clone();
            async move {
                let put = client
                    .put(
                        entry.clone(),
                        b"dl1-waiter".to_vec(),
                        Some(PutOptions::new().with_lease(lease)),
                    )
                    .await
                    .expect("put entry");
                (entry, put.header().expect("header").revision())
            }
        };
        let (first, second) = (place("1-1").await, place("1-2").await);
        let turn = |place: Option<(Vec<u8>, i64)>| Turn {
            line: line.clone(),
            place,
            known_first: false,
        };
        let owner = OwnerToken::random();
        let value = crate::keys::encode_value(owner);
        let attempt = |turn: Turn| acquire(&key, &value, &label, lease, &turn, None, &[]);
        let outcome = |turn: &Turn, reply: &TxnResponse| {
            acquire_outcome(&lock_key, owner, turn, reply).expect("outcome")
        };
        // A waiter known first is not compared with the line at all: here,
        // in a state its task never reports (someone ahead), it takes the
        // key, which shows that the line, every entry of which etcd would
        // read, is not read.
        let known_first = Turn {
            known_first: true,
            ..turn(Some(second.clone()))
        };
        let mut other = client.clone();
        let reply = other.txn(attempt(known_first)).await.expect("txn");
        assert!(
            reply.succeeded(),
            "a waiter known first was compared with the line"
        );
        assert_eq!(
            marker_of(&mut other, &second.0).await,
            Some((second.1, lease)),
            "the entry of the waiter that took the lock is not its marker"
        );
        // The release takes the marker with the lock.
        let fencing = FencingToken::new(reply.header().expect("header").revision() as u64);
        let released = release(&key, &value, &label.key, fencing, Some(&second.0));
        assert!(other.txn(released).await.expect("release").succeeded());
        assert!(
            !exists(&mut other, &second.0).await,
            "the marker outlived its lock's release"
        );
        let second = place("1-2").await;
        for claim in [None, Some(second.clone())] {
            let reply = client.txn(attempt(turn(claim.clone()))).await.expect("txn");
            assert!(!reply.succeeded(), "{claim:?} cut in before the head");
            assert!(
                matches!(
                    outcome(&turn(claim.clone()), &reply),
                    AcquireOutcome::Refused(AcquireReply::Held { expires_in: None })
                ),
                "{claim:?}: refused with no expiry to wait for"
            );
        }
        // The second waiter's probe reads the entry ahead of it: refused.
        let reply = client
            .txn(probe(&key, &Ahead::Entry(first.0.clone())))
            .await
            .expect("probe");
        assert!(
            probed(&lock_key, owner, &turn(Some(second.clone())), &reply)
                .expect("probed")
                .is_some(),
            "the probe of a waiter behind another foresees the refusal"
        );
        // An attempt not in line reads the line's first key: refused while
        // anyone waits.
        let any = Ahead::AnyOf(line.clone());
        let reply = client.txn(probe(&key, &any)).await.expect("probe");
        assert!(
            probed(&lock_key, owner, &turn(None), &reply)
                .expect("probed")
                .is_some(),
            "the probe of an attempt not in line foresees the refusal"
        );
        let head = turn(Some(first.clone()));
        let reply = client
            .txn(probe(&key, &Ahead::Nobody))
            .await
            .expect("probe");
        assert!(probed(&lock_key, owner, &head, &reply)
            .expect("probed")
            .is_none());
        // An entry "ahead" created after the waiter's own refuses nothing
        // (an entry put again after its lease was lost is behind).
        let reply = client
            .txn(probe(&key, &Ahead::Entry(second.0.clone())))
            .await
            .expect("probe");
        assert!(probed(&lock_key, owner, &head, &reply)
            .expect("probed")
            .is_none());
        let reply = client.txn(attempt(head.clone())).await.expect("txn");
        assert!(reply.succeeded(), "the head is refused");
        assert_eq!(
            marker_of(&mut client, &first.0).await,
            Some((first.1, lease)),
            "the head's entry is not its marker"
        );
        let fencing = FencingToken::new(reply.header().expect("header").revision() as u64);
        let released = release(&key, &value, &label.key, fencing, Some(&first.0));
        assert!(client.txn(released).await.expect("release").succeeded());
        // The second is first now: a waiter whose entry (after it) is gone
        // is refused behind it, then out of line once the line is empty.
        let gone = turn(Some((layout.queue_entry(&lock_key, "1-0"), second.1 + 1)));
        let reply = client.txn(attempt(gone.clone())).await.expect("txn");
        assert!(!reply.succeeded(), "a waiter cut in before the head");
        assert!(matches!(outcome(&gone, &reply), AcquireOutcome::Refused(_)));
        client
            .delete(second.0.clone(), None)
            .await
            .expect("dequeue");
        let reply = client.txn(attempt(gone.clone())).await.expect("txn");
        assert!(matches!(outcome(&gone, &reply), AcquireOutcome::OutOfLine));
        let reply = client.txn(probe(&key, &any)).await.expect("probe");
        assert!(
            probed(&lock_key, owner, &turn(None), &reply)
                .expect("probed")
                .is_none(),
            "an empty line: the attempt not in line goes"
        );
        let reply = client.txn(attempt(turn(None))).await.expect("txn");
        assert!(
            reply.succeeded(),
            "an empty line lets an attempt not in line take the key"
        );
    }

    /// A waiter's queue entry whose dequeue ran first.
    #[tokio::test]
    async fn a_queue_entry_put_after_its_dequeue_writes_nothing() {
        let (_server, mut client, session) = etcd().await;
        let lock = b"ns/lock/queued".to_vec();
        let entry = b"ns/lock/queued/waiters/1-1".to_vec();
        let fence = Fence::new(&lock, session);
        let reads = || {
            [
                TxnOp::get(lock.clone(), None),
                TxnOp::get(lock.clone(), None),
            ]
        };
        let late = enqueue(&entry, b"dl1-waiter", session, &fence, reads());
        client
            .txn(dequeue(&entry, None, std::slice::from_ref(&fence)))
            .await
            .expect("dequeue");
        let reply = client.txn(late).await.expect("late put");
        assert!(!reply.succeeded(), "the late put wrote the entry");
        assert!(!exists(&mut client, &entry).await, "a ghost entry was left");
        let unfenced = enqueue(
            &entry,
            b"dl1-waiter",
            session,
            &Fence::new(&lock, session),
            reads(),
        );
        assert!(
            client.txn(unfenced).await.expect("control").succeeded(),
            "control: a put with a fence that is down writes the entry"
        );
    }

    /// Entry names are reused (`queue::slots`): a dequeue of an earlier
    /// entry of the name, applied late, leaves the newer one alone, and a
    /// put of a name whose entry exists does not take over its place.
    #[tokio::test]
    async fn a_late_dequeue_or_put_leaves_a_newer_entry_of_its_name_alone() {
        let (_server, mut client, session) = etcd().await;
        let lock = b"ns/lock/reused".to_vec();
        let entry = b"ns/lock/reused/waiters/1-0".to_vec();
        let put = |fence: &Fence| enqueue(&entry, b"dl1-waiter", session, fence, []);
        let placed = |reply: &TxnResponse| reply.header().expect("header").revision();
        let first = client
            .txn(put(&Fence::new(&lock, session)))
            .await
            .expect("put");
        let earlier = placed(&first);
        let late = dequeue(&entry, Some(earlier), &[]);
        client
            .txn(dequeue(&entry, Some(earlier), &[]))
            .await
            .expect("dequeue");
        let second = client
            .txn(put(&Fence::new(&lock, session)))
            .await
            .expect("put again");
        assert!(second.succeeded(), "the name's new entry was refused");
        let newer = placed(&second);
        client.txn(late).await.expect("late dequeue");
        let kvs = client
            .get(entry.clone(), None)
            .await
            .expect("read")
            .kvs()
            .to_vec();
        assert_eq!(
            kvs.iter()
                .map(|kv| kv.create_revision())
                .collect::<Vec<_>>(),
            vec![newer],
            "a late dequeue of the earlier entry took the newer one"
        );
        let over = client
            .txn(put(&Fence::new(&lock, session)))
            .await
            .expect("put over");
        assert!(!over.succeeded(), "a put over an existing entry went");
        client
            .txn(dequeue(&entry, Some(newer), &[]))
            .await
            .expect("dequeue the newer");
        assert!(!exists(&mut client, &entry).await, "control: not deleted");
    }
}
