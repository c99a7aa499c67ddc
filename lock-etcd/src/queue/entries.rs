//! The requests on a waiter queue's entries: the transaction that puts an
//! entry and reads its place, the look-up's reads, the check that an
//! entry is distlock's, and the entry's delete.

use std::sync::Weak;

use distlock_core::LockError;
use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use etcd_client::{TxnOpResponse, TxnResponse};

use super::{Line, Position, Queues, RETRY_MAX, RETRY_MIN};
use crate::connection::Etcd;
use crate::fence::Fence;
use crate::keys::KeyLayout;
use crate::requests::Repeat;
use crate::session::Session;
use crate::txn;

/// The value of a queue entry (only its key and revisions matter).
const ENTRY_VALUE: &[u8] = b"dl1-waiter";

/// Reads of the waiters before a waiter at create revision below `below`
/// (0: any), newest first, and of what the line waits for. The first
/// read returns up to `limit` entries; a semaphore's, up to its waiter's
/// own limit (plus itself, with `below` 0) at least, so [`ahead`] can tell
/// whether the waiter is among the first `limit` of its line. (A count
/// would be cheaper, but etcd counts a whole range, ignoring its create
/// revision bound.)
pub(super) fn reads(layout: &KeyLayout, line: &Line, below: i64, limit: i64) -> Vec<TxnOp> {
    let limit = match line {
        Line::Permits(_, own) => limit.max(i64::from(*own) + i64::from(below == 0)),
        Line::Lock(_) => limit,
    };
    let mut queue = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_limit(limit);
    if below > 0 {
        queue = queue.with_max_create_revision(below - 1);
    }
    vec![
        TxnOp::get(line.queue_prefix(layout), Some(queue)),
        line.read_held(layout),
    ]
}

/// How many of the entries a [`reads`] found wait before `entry` (at
/// create revision `place`), for a semaphore's line (at most its waiter's
/// own limit: as many as matter); `None` for a lock's.
pub(super) fn ahead(
    line: &Line,
    found: Option<&Vec<KeyValue>>,
    entry: &[u8],
    place: i64,
) -> Option<i64> {
    let Line::Permits(..) = line else {
        return None;
    };
    let before = found
        .into_iter()
        .flatten()
        .filter(|kv| kv.key() != entry && kv.create_revision() < place)
        .count();
    Some(i64::try_from(before).unwrap_or(i64::MAX))
}

/// The look-up of a waiter at `place` (its entry `entry`): the newest
/// entry before it (etcd finds it by reading every entry in the line: it
/// sorts a range by create revision only after reading all of it), what
/// the line waits for, and its own entry.
///
/// `predecessor_gone_at`: the revision in which the lock waiter's watched
/// predecessor entry was deleted. If the lock key was created in that same
/// revision, the predecessor took the lock (only a grant deletes an entry
/// and creates the key at once; an adoption rewrites the key), so nobody
/// was ahead of it, and nobody can be ahead of the waiter now: an entry's
/// place is its create revision, and later entries are behind. The
/// transaction compares that and then reads the lock key and the entry
/// alone. Read-only either way.
pub(super) fn look_up(
    layout: &KeyLayout,
    line: &Line,
    entry: &[u8],
    place: i64,
    predecessor_gone_at: Option<i64>,
) -> Txn {
    let own = || TxnOp::get(entry, Some(GetOptions::new().with_keys_only()));
    let mut full = reads(layout, line, place, 1);
    full.push(own());
    match predecessor_gone_at {
        Some(revision) => Txn::new()
            .when([Compare::create_revision(
                layout.lock_key(line.key()),
                CompareOp::Equal,
                revision,
            )])
            .and_then([line.read_held(layout), own()])
            .or_else(full),
        None => Txn::new().and_then(full),
    }
}

/// The position a [`look_up`] found (`compared`: it was given the
/// predecessor's deletion revision).
pub(super) fn looked_up(
    layout: &KeyLayout,
    line: &Line,
    entry: &[u8],
    place: i64,
    compared: bool,
    reply: &TxnResponse,
) -> Result<Position, LockError> {
    let revision = revision_of(reply)?;
    let ranges = ranges(reply);
    if compared && reply.succeeded() {
        tracing::trace!(key = %line.key(), place, "etcd waiter's predecessor took the lock: first");
        let queued = ranges.get(1).is_some_and(|kvs| !kvs.is_empty());
        return Ok(Position::read(
            line,
            revision,
            None,
            None,
            ranges.first(),
            queued,
        ));
    }
    check_entries(layout, line, ranges.first())?;
    Ok(Position::read(
        line,
        revision,
        ranges
            .first()
            .and_then(|kvs| kvs.first())
            .map(|kv| (kv.key(), kv.create_revision())),
        ahead(line, ranges.first(), entry, place),
        ranges.get(1),
        ranges.get(2).is_some_and(|kvs| !kvs.is_empty()),
    ))
}

/// The reads of a transaction's branch that ran, in order (not those of
/// transactions nested in it).
pub(super) fn ranges(reply: &TxnResponse) -> Vec<Vec<KeyValue>> {
    reply
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().to_vec()),
            _ => None,
        })
        .collect()
}

pub(super) fn revision_of(reply: &TxnResponse) -> Result<i64, LockError> {
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
pub(super) async fn put_entry(
    etcd: &Etcd,
    line: &Line,
    entry: &[u8],
    session: &Session,
    fence: &Fence,
    deadline: std::time::Instant,
) -> Result<(i64, Position), LockError> {
    let lease = session.lease_id();
    let ops = join_ops(&etcd.layout, line, entry, lease);
    let txn = txn::enqueue(entry, ENTRY_VALUE, lease, fence, ops);
    let reply = etcd
        .run_txn_until(deadline, "etcd queue waiter", Repeat::IfUnapplied, txn)
        .await?;
    if !reply.succeeded() {
        return Err(LockError::unavailable(
            "etcd refused a queue entry whose request was given up",
        ));
    }
    joined(&etcd.layout, line, entry, &reply)
}

/// What a joining waiter's transaction does besides putting its entry
/// `entry` (on `lease`): reads its predecessor and what the line waits
/// for. A lock's line reads its tail (see [`crate::keys`]), the newest
/// entry's name, and names the new entry there; only with no tail (an
/// empty line, or its newest waiter gone) does it read the line, which
/// etcd does by reading every entry in it. A semaphore's line reads the
/// line (it counts the waiters ahead).
pub(super) fn join_ops(layout: &KeyLayout, line: &Line, entry: &[u8], lease: i64) -> Vec<TxnOp> {
    let mut ops = reads(layout, line, 0, 2);
    let Some(tail) = line.tail(layout) else {
        return ops;
    };
    let held = ops.pop().expect("reads: the line, then what it waits for");
    let predecessor = Txn::new()
        .when([Compare::create_revision(
            tail.clone(),
            CompareOp::Greater,
            0,
        )])
        .and_then([TxnOp::get(tail.clone(), None)])
        .or_else(ops);
    vec![
        TxnOp::txn(predecessor),
        TxnOp::put(tail, entry, Some(PutOptions::new().with_lease(lease))),
        held,
    ]
}

/// Where a joining waiter stands, from the reply to its transaction
/// ([`join_ops`]): its place (the entry's create revision) and position.
pub(super) fn joined(
    layout: &KeyLayout,
    line: &Line,
    entry: &[u8],
    reply: &TxnResponse,
) -> Result<(i64, Position), LockError> {
    let revision = revision_of(reply)?;
    // The transaction's writes share its revision: the entry's is ours.
    let place = revision;
    let reads = ranges(reply);
    let nested = reply.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Txn(nested) => Some(nested),
        _ => None,
    });
    let (found, held) = match nested {
        // A lock's line: its tail or the whole line, then the lock key.
        Some(nested) => {
            let found = ranges(&nested).into_iter().next();
            if nested.succeeded() {
                let tail = found.and_then(|kvs| kvs.into_iter().next());
                let predecessor = tail_entry(layout, line, tail)?;
                let before = Some((predecessor.0.as_slice(), predecessor.1));
                let mut position =
                    Position::read(line, revision, before, None, reads.first(), true);
                // The tail named it as the newest entry: whether it is
                // still there is checked once its watch is live.
                position.verify = true;
                return Ok((place, position));
            }
            (found, reads.first().cloned())
        }
        None => (reads.first().cloned(), reads.get(1).cloned()),
    };
    check_entries(layout, line, found.as_ref())?;
    // Newest first; skip our own entry (whether or not the read saw it).
    let before = found.as_ref().and_then(|kvs| {
        kvs.iter()
            .find(|kv| kv.key() != entry && kv.create_revision() < place)
            .map(|kv| (kv.key(), kv.create_revision()))
    });
    let ahead = ahead(line, found.as_ref(), entry, place);
    Ok((
        place,
        Position::read(line, revision, before, ahead, held.as_ref(), true),
    ))
}

/// The entry a line's tail names, with its create revision (the tail's
/// mod revision: it is put in the entry's own transaction). A tail
/// distlock did not write (not an entry of this line, or on no lease) is
/// reported.
fn tail_entry(
    layout: &KeyLayout,
    line: &Line,
    tail: Option<KeyValue>,
) -> Result<(Vec<u8>, i64), LockError> {
    let prefix = line.queue_prefix(layout);
    match tail {
        Some(kv)
            if kv.lease() != 0
                && kv
                    .value()
                    .strip_prefix(prefix.as_slice())
                    .is_some_and(is_waiter_id) =>
        {
            Ok((kv.value().to_vec(), kv.mod_revision()))
        }
        other => Err(LockError::corrupted(format!(
            "the {}'s etcd waiter queue tail holds a value distlock did not write ({:?}); it was left untouched — remove it or use another namespace",
            line.what(),
            other.map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
        ))),
    }
}

/// Refuses queue entries distlock did not write (a key not named
/// `<session lease>-<number>` in hex, another value, or no lease): obeying
/// one would stall every waiter behind it, and deleting it would destroy
/// data that is not ours.
pub(super) fn check_entries(
    layout: &KeyLayout,
    line: &Line,
    kvs: Option<&Vec<KeyValue>>,
) -> Result<(), LockError> {
    let prefix = line.queue_prefix(layout);
    for kv in kvs.into_iter().flatten() {
        if is_foreign(&prefix, kv) {
            return Err(LockError::corrupted(format!(
                "the {}'s etcd waiter queue holds a key distlock did not write ({:?}); it was left untouched — remove it or use another namespace",
                line.what(),
                String::from_utf8_lossy(kv.key())
            )));
        }
    }
    Ok(())
}

/// Whether `kv`, found below the queue prefix `prefix`, is not an entry
/// distlock wrote.
pub(super) fn is_foreign(prefix: &[u8], kv: &KeyValue) -> bool {
    let id = kv.key().strip_prefix(prefix).unwrap_or_default();
    kv.value() != ENTRY_VALUE || kv.lease() == 0 || !is_waiter_id(id)
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
pub(super) fn delete_later(
    client: Weak<Queues>,
    entry: Vec<u8>,
    tail: Option<Vec<u8>>,
    fences: Vec<Fence>,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(delete_entry(client, entry, tail, fences));
}

/// Deletes a queue entry and puts up `fences` (of its puts whose outcome
/// is unknown) in one transaction, retrying while the client lives; the
/// line's `tail` goes with it if it names it.
pub(super) async fn delete_entry(
    client: Weak<Queues>,
    entry: Vec<u8>,
    tail: Option<Vec<u8>>,
    fences: Vec<Fence>,
) {
    let txn = txn::dequeue(&entry, tail.as_deref(), &fences);
    let mut pause = RETRY_MIN;
    loop {
        let Some(queues) = client.upgrade() else {
            return;
        };
        let kv = &queues.etcd.kv;
        let result = queues
            .etcd
            .requests
            .send("etcd dequeue waiter", Repeat::Safe, || {
                let mut kv = kv.clone();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            })
            .await;
        drop(queues);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use distlock_conformance::server::{Etcd as EtcdServer, ServerProcess};
    use distlock_core::LockKey;
    use etcd_client::{Client, PutOptions};

    use super::*;

    /// A server, a raw client with a lease of 60 s, and the lock line of
    /// `name` in namespace `ns`.
    async fn scene(name: &str) -> (ServerProcess, Client, i64, KeyLayout, LockKey, Line) {
        let server = ServerProcess::start(Arc::new(EtcdServer)).expect("an etcd server must start");
        let mut client = Client::connect([server.addr().to_string()], None)
            .await
            .expect("connect");
        let lease = client.lease_grant(60, None).await.expect("lease").id();
        let key = LockKey::new(name).unwrap();
        let line = Line::Lock(key.clone());
        (server, client, lease, KeyLayout::new("ns"), key, line)
    }

    /// A waiter whose predecessor took the lock (its entry deleted in the
    /// revision that created the lock key) finds itself first from the
    /// lock key and its own entry: here, in a state the line never reaches
    /// (an entry left ahead of the one that took the key), it reports no
    /// predecessor, which shows the line is not read. A predecessor that
    /// left without the key (or a look-up not given a deletion) reads the
    /// line and finds who is still ahead.
    #[tokio::test]
    async fn a_waiter_whose_predecessor_took_the_lock_is_first_without_reading_the_line() {
        let (_server, mut client, lease, layout, key, line) = scene("moved").await;
        let put = |id: &str| {
            let entry = layout.queue_entry(&key, id);
            let mut client = client.clone();
            async move {
                let reply = client
                    .put(
                        entry.clone(),
                        ENTRY_VALUE.to_vec(),
                        Some(PutOptions::new().with_lease(lease)),
                    )
                    .await
                    .expect("put entry");
                (entry, reply.header().expect("header").revision())
            }
        };
        let (early, _) = put("1-0").await;
        let (predecessor, _) = put("1-1").await;
        let (waiter, place) = put("1-2").await;
        // The predecessor's grant: its entry goes as the lock key comes.
        let grant = Txn::new().and_then([
            TxnOp::put(
                layout.lock_key(&key),
                b"granted".to_vec(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::delete(predecessor.clone(), None),
        ]);
        let granted = client.txn(grant).await.expect("grant");
        let granted_at = granted.header().expect("header").revision();
        let position = |gone_at: Option<i64>| {
            let mut client = client.clone();
            let (layout, line, waiter) = (layout.clone(), line.clone(), waiter.clone());
            async move {
                let txn = look_up(&layout, &line, &waiter, place, gone_at);
                let reply = client.txn(txn).await.expect("look-up");
                looked_up(&layout, &line, &waiter, place, gone_at.is_some(), &reply)
                    .expect("position")
            }
        };
        let first = position(Some(granted_at)).await;
        assert_eq!(first.predecessor, None, "the line was read");
        assert!(first.held && first.queued);
        for gone_at in [None, Some(granted_at - 1)] {
            let full = position(gone_at).await;
            assert_eq!(
                full.predecessor.as_deref(),
                Some(early.as_slice()),
                "{gone_at:?}"
            );
            assert!(full.held && full.queued);
        }
    }

    /// A joining waiter finds its predecessor from the line's tail alone:
    /// here, in a state the line never reaches (the tail naming an older
    /// entry than the newest), it reports the one the tail names, which
    /// shows the line is not read; it names itself as the tail; and with
    /// no tail it reads the line and finds the newest entry.
    #[tokio::test]
    async fn a_joiner_reads_the_tail_not_the_line() {
        let (_server, mut client, lease, layout, key, line) = scene("tailed").await;
        let tail = layout.queue_tail(&key);
        let on_lease = || Some(PutOptions::new().with_lease(lease));
        let (older, newer) = (
            layout.queue_entry(&key, "1-0"),
            layout.queue_entry(&key, "1-1"),
        );
        // The older entry names itself as the tail in its own transaction,
        // as a join does; the newer one does not.
        let older_at = client
            .txn(Txn::new().and_then([
                TxnOp::put(older.clone(), ENTRY_VALUE.to_vec(), on_lease()),
                TxnOp::put(tail.clone(), older.clone(), on_lease()),
            ]))
            .await
            .expect("put")
            .header()
            .expect("header")
            .revision();
        client
            .put(newer.clone(), ENTRY_VALUE.to_vec(), on_lease())
            .await
            .expect("put");
        let joining = client.clone();
        let join = |id: &str| {
            let entry = layout.queue_entry(&key, id);
            let (mut client, layout, line) = (joining.clone(), layout.clone(), line.clone());
            async move {
                let ops = join_ops(&layout, &line, &entry, lease);
                let txn = Txn::new().and_then(
                    [TxnOp::put(
                        entry.clone(),
                        ENTRY_VALUE.to_vec(),
                        Some(PutOptions::new().with_lease(lease)),
                    )]
                    .into_iter()
                    .chain(ops)
                    .collect::<Vec<_>>(),
                );
                let reply = client.txn(txn).await.expect("join");
                let (_, position) = joined(&layout, &line, &entry, &reply).expect("position");
                (entry, position)
            }
        };
        let (joiner, position) = join("1-2").await;
        assert_eq!(
            position.predecessor.as_deref(),
            Some(older.as_slice()),
            "the line was read"
        );
        assert_eq!(position.seen, vec![(older.clone(), older_at)]);
        assert!(
            position.verify,
            "a predecessor named by the tail is checked"
        );
        let named = client.get(tail.clone(), None).await.expect("get");
        assert_eq!(
            named.kvs().first().map(|kv| kv.value()),
            Some(joiner.as_slice())
        );
        client
            .delete(tail.clone(), None)
            .await
            .expect("delete tail");
        let (_, position) = join("1-3").await;
        assert_eq!(
            position.predecessor.as_deref(),
            Some(joiner.as_slice()),
            "the newest entry"
        );
        assert!(!position.verify);
    }
}
