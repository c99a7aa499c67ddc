//! The requests on a waiter queue's entries: the transaction that puts an
//! entry and reads its place, the look-up's reads, the check that an
//! entry is distlock's, and the entry's delete.

use std::sync::Weak;

use distlock_core::LockError;
use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp};
use etcd_client::{TxnOpResponse, TxnResponse};

use super::{Line, Position, Queues, RETRY_MAX, RETRY_MIN};
use crate::connection::Etcd;
use crate::fence::Fence;
use crate::keys::KeyLayout;
use crate::requests::Repeat;
use crate::session::Session;
use crate::slots::Slot;
use crate::txn;

use crate::marker::ENTRY_VALUE;

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
        ranges.first().and_then(|kvs| kvs.first()),
        ahead(line, ranges.first(), entry, place),
        ranges.get(1),
        ranges.get(2).is_some_and(|kvs| !kvs.is_empty()),
    ))
}

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
    let txn = txn::enqueue(
        entry,
        ENTRY_VALUE,
        session.lease_id(),
        fence,
        reads(&etcd.layout, line, 0, 2),
    );
    let reply = etcd
        .run_txn_until(deadline, "etcd queue waiter", Repeat::IfUnapplied, txn)
        .await?;
    if !reply.succeeded() {
        return Err(LockError::unavailable(
            "etcd refused a queue entry: its request was given up, or its name is in use",
        ));
    }
    let revision = revision_of(&reply)?;
    // The put is the transaction's only write: its revision is ours.
    let place = revision;
    let ranges = ranges(&reply);
    check_entries(&etcd.layout, line, ranges.first())?;
    // Newest first; skip our own entry (whether or not the read saw it).
    let before = ranges.first().and_then(|kvs| {
        kvs.iter()
            .find(|kv| kv.key() != entry && kv.create_revision() < place)
    });
    let ahead = ahead(line, ranges.first(), entry, place);
    Ok((
        place,
        Position::read(line, revision, before, ahead, ranges.get(1), true),
    ))
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
    kv.value() != ENTRY_VALUE || kv.lease() == 0 || !crate::slots::is_slot_name(id)
}

/// Deletes a queue entry in the background, retrying (each attempt under
/// the operation timeout) while the client lives; a dropped client's
/// entries go with its session lease.
pub(super) fn delete_later(
    client: Weak<Queues>,
    entry: Vec<u8>,
    place: Option<i64>,
    fences: Vec<Fence>,
    slot: Option<Slot>,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(delete_entry(client, entry, place, fences, slot));
}

/// Deletes a queue entry and puts up `fences` (of its puts whose outcome
/// is unknown) in one transaction, retrying while the client lives. With
/// its `place` known, only the entry created there is deleted, and once
/// that is answered the entry's name is free again (`slot`); otherwise
/// the slot is retired (see [`crate::slots`]).
pub(super) async fn delete_entry(
    client: Weak<Queues>,
    entry: Vec<u8>,
    place: Option<i64>,
    fences: Vec<Fence>,
    slot: Option<Slot>,
) {
    let txn = txn::dequeue(&entry, place, &fences);
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
            Ok(_) => {
                if let Some(slot) = slot.filter(|_| place.is_some()) {
                    slot.free();
                }
                return;
            }
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

    /// A waiter whose predecessor took the lock (its entry deleted in the
    /// revision that created the lock key) finds itself first from the
    /// lock key and its own entry: here, in a state the line never reaches
    /// (an entry left ahead of the one that took the key), it reports no
    /// predecessor, which shows the line is not read. A predecessor that
    /// left without the key (or a look-up not given a deletion) reads the
    /// line and finds who is still ahead.
    #[tokio::test]
    async fn a_waiter_whose_predecessor_took_the_lock_is_first_without_reading_the_line() {
        let server = ServerProcess::start(Arc::new(EtcdServer)).expect("an etcd server must start");
        let mut client = Client::connect([server.addr().to_string()], None)
            .await
            .expect("connect");
        let lease = client.lease_grant(60, None).await.expect("lease").id();
        let layout = KeyLayout::new("ns");
        let key = LockKey::new("moved").unwrap();
        let line = Line::Lock(key.clone());
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
}
