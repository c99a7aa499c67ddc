//! The requests on a waiter queue's entries: the transaction that puts an
//! entry and reads its place, the look-up's reads, the check that an
//! entry is distlock's, and the entry's delete.

use std::sync::Weak;

use distlock_core::LockError;
use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget, TxnOp};
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
            "etcd refused a queue entry whose request was given up",
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
pub(super) fn delete_later(client: Weak<Queues>, entry: Vec<u8>, fences: Vec<Fence>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(delete_entry(client, entry, fences));
}

/// Deletes a queue entry and puts up `fences` (of its puts whose outcome
/// is unknown) in one transaction, retrying while the client lives.
pub(super) async fn delete_entry(client: Weak<Queues>, entry: Vec<u8>, fences: Vec<Fence>) {
    let txn = txn::dequeue(&entry, &fences);
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
