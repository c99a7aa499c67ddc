//! The operator calls of [`EtcdLock`]: read or clear a lock whoever holds it.

use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{FencingToken, LockAdmin, LockError, LockKey, LockState, IN_LOCK_CALL};
use etcd_client::{Compare, CompareOp, KeyValue, Txn, TxnOp};

use crate::backend::EtcdLock;
use crate::requests::Repeat;
use crate::txn;

impl EtcdLock {
    /// Reads the lock key: `None` if absent, else the key-value after
    /// checking distlock wrote it.
    async fn read_lock(&self, key: &LockKey) -> Result<Option<KeyValue>, LockError> {
        let etcd_key = self.etcd().layout.lock_key(key);
        let kv = &self.etcd().kv;
        let reply = self
            .etcd()
            .requests
            .send(IN_LOCK_CALL, Repeat::Safe, || {
                let mut kv = kv.clone();
                let etcd_key = etcd_key.clone();
                async move { kv.get(etcd_key, None).await }
            })
            .await?;
        let Some(found) = reply.kvs().first() else {
            return Ok(None);
        };
        txn::check_found(found.value(), found.lease())?;
        Ok(Some(found.clone()))
    }
}

#[async_trait]
impl LockAdmin for EtcdLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let Some(found) = self.read_lock(key).await? else {
            return Ok(LockState::Free);
        };
        let leases = &self.etcd().leases;
        let lease_id = found.lease();
        let ttl = self
            .etcd()
            .requests
            .send("reading the lease's time to live", Repeat::Safe, || {
                let mut leases = leases.clone();
                async move { leases.time_to_live(lease_id, None).await }
            })
            .await?;
        Ok(LockState::Held {
            // -1 once the lease expired (the key goes with it).
            expires_in: u64::try_from(ttl.ttl()).ok().map(Duration::from_secs),
            fencing_token: FencingToken::new(u64::try_from(found.create_revision()).unwrap_or(0)),
            holder: None,
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let Some(found) = self.read_lock(key).await? else {
            return Ok(false);
        };
        // Delete exactly the lock that was read (and checked to be ours), so
        // a value written in between is never removed unseen.
        let etcd_key = self.etcd().layout.lock_key(key);
        let delete = Txn::new()
            .when([Compare::mod_revision(
                etcd_key.clone(),
                CompareOp::Equal,
                found.mod_revision(),
            )])
            .and_then([TxnOp::delete(etcd_key, None)]);
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
}
