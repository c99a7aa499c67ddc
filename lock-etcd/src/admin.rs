//! The operator calls of [`EtcdLock`]: read or clear a lock whoever holds
//! it, and watch who holds it.

use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    FencingToken, HolderId, LockAdmin, LockError, LockKey, LockState, ReleaseWatch, IN_LOCK_CALL,
};
use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp, TxnOpResponse};

use crate::backend::EtcdLock;
use crate::keys::decode_holder;
use crate::listener::Topic;
use crate::marker;
use crate::requests::Repeat;
use crate::txn;

/// The local channel of `key`'s observers. Waiters' channels end with
/// `#<decimal number>` (see [`crate::queue`]); this one never does.
fn observers_channel(key: &LockKey) -> String {
    format!("{}#holder", key.as_str())
}

impl EtcdLock {
    /// The time to live of lease `lease_id`, by etcd's clock: `None` once
    /// it expired (its keys go with it).
    pub(crate) async fn time_left(&self, lease_id: i64) -> Result<Option<Duration>, LockError> {
        let leases = &self.etcd().leases;
        let ttl = self
            .etcd()
            .requests
            .send("reading the lease's time to live", Repeat::Safe, || {
                let mut leases = leases.clone();
                async move { leases.time_to_live(lease_id, None).await }
            })
            .await?;
        Ok(u64::try_from(ttl.ttl()).ok().map(Duration::from_secs))
    }

    /// Reads the lock key and its holder-label key in one transaction:
    /// `None` if the lock is absent, else the lock's key-value (after
    /// checking distlock wrote it) and the label, if one is stored by the
    /// lock's own owner. Whatever else is at the label key (another
    /// owner's, left behind; bad data) is ignored.
    async fn read_lock(
        &self,
        key: &LockKey,
    ) -> Result<Option<(KeyValue, Option<HolderId>)>, LockError> {
        let layout = &self.etcd().layout;
        let read = Txn::new().and_then([
            TxnOp::get(layout.lock_key(key), None),
            TxnOp::get(layout.holder_key(key), None),
        ]);
        let reply = self
            .etcd()
            .run_txn(IN_LOCK_CALL, Repeat::Safe, read)
            .await?;
        let mut found = reply.op_responses().into_iter().map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().cloned(),
            _ => None,
        });
        let (Some(lock), label) = (found.next().flatten(), found.next().flatten()) else {
            return Ok(None);
        };
        let owner = txn::check_found(lock.value(), lock.lease())?;
        let holder = label
            .and_then(|label| decode_holder(label.value()))
            .filter(|(labelled, _)| *labelled == owner)
            .map(|(_, holder)| holder);
        Ok(Some((lock, holder)))
    }
}

impl EtcdLock {
    /// The holders' markers in `key`'s line on `lease` (the lock's): the
    /// marker of the lock on it, and any a client left with the lock
    /// gone.
    async fn markers_on(&self, key: &LockKey, lease: i64) -> Result<Vec<Vec<u8>>, LockError> {
        let line = self.etcd().layout.queue_prefix(key);
        let kv = &self.etcd().kv;
        let reply = self
            .etcd()
            .requests
            .send("reading the lock's waiter line", Repeat::Safe, || {
                let mut kv = kv.clone();
                let line = line.clone();
                async move { kv.get(line, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        Ok(reply
            .kvs()
            .iter()
            .filter(|kv| marker::is_marker(kv) && kv.lease() == lease)
            .map(|kv| kv.key().to_vec())
            .collect())
    }
}

#[async_trait]
impl LockAdmin for EtcdLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let Some((found, holder)) = self.read_lock(key).await? else {
            return Ok(LockState::Free);
        };
        Ok(LockState::Held {
            expires_in: self.time_left(found.lease()).await?,
            fencing_token: FencingToken::new(u64::try_from(found.create_revision()).unwrap_or(0)),
            holder,
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let Some((found, _)) = self.read_lock(key).await? else {
            return Ok(false);
        };
        // Delete exactly the lock that was read (and checked to be ours), so
        // a value written in between is never removed unseen; its label
        // goes with it.
        let layout = &self.etcd().layout;
        let etcd_key = layout.lock_key(key);
        // Its holder's marker (see `crate::marker`), if a waiter took it,
        // goes with it: its successor waits on it.
        let markers = self.markers_on(key, found.lease()).await?;
        let mut then = vec![
            TxnOp::delete(etcd_key.clone(), None),
            TxnOp::delete(layout.holder_key(key), None),
        ];
        then.extend(markers.iter().map(|m| marker::delete(m)));
        let delete = Txn::new()
            .when([Compare::mod_revision(
                etcd_key,
                CompareOp::Equal,
                found.mod_revision(),
            )])
            .and_then(then);
        let reply = self
            .etcd()
            .run_txn(IN_LOCK_CALL, Repeat::IfUnapplied, delete)
            .await?;
        if !reply.succeeded() {
            return Err(LockError::unavailable(
                "the lock changed while it was being force-released; try again",
            ));
        }
        // The key's lease is not revoked: it may be a session lease that
        // other locks of the holder's client share. Without keys, it just
        // runs out.
        Ok(true)
    }

    /// One etcd watch on the lock key per client and key, however many
    /// observers: its creations (a take) and deletions (a release, a force
    /// release, the lease running out) fire it; renewals, which rewrite
    /// the key, do not. It shares the waiters' watch stream but not their
    /// queue, so an observer never takes a waiter's place or wake-up.
    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let topic = Topic {
            channel: observers_channel(key),
            key: self.etcd().layout.lock_key(key),
            prefix: false,
            confirmed_at: Default::default(),
            creations: true,
            deleted_at: Default::default(),
            rewritten_at: None,
        };
        self.inner.queues.listener.watch(topic).await.map(Some)
    }

    async fn inspect_permits(
        &self,
        key: &LockKey,
    ) -> Result<Vec<distlock_core::PermitState>, LockError> {
        self.list_permits(key).await
    }
}
