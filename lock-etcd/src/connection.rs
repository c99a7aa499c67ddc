//! [`Etcd`]: what every part of a client sends its requests with (the
//! kv and lease clients, the key layout and the request executor), and the
//! lease and transaction requests that locks, permits, sessions and waiter
//! queues share.

use std::time::{Duration, Instant};

use distlock_core::LockError;
use etcd_client::{KvClient, LeaseClient};

use crate::keys::KeyLayout;
use crate::requests::{Repeat, Requests};

/// One client's handles on its etcd cluster. Cheap to clone (the gRPC
/// clients share one channel).
#[derive(Clone)]
pub(crate) struct Etcd {
    pub(crate) kv: KvClient,
    pub(crate) leases: LeaseClient,
    pub(crate) layout: KeyLayout,
    /// Timeouts, and sending again what reached no server.
    pub(crate) requests: Requests,
}

impl Etcd {
    /// Grants an etcd lease of `ttl` (whole seconds); returns its id and
    /// the TTL the server granted.
    pub(crate) async fn grant(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<(i64, Duration), LockError> {
        let seconds = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX).max(1);
        let leases = &self.leases;
        let reply = self
            .requests
            .send_until(deadline, "granting a lease", Repeat::Safe, || {
                let mut leases = leases.clone();
                async move { leases.grant(seconds, None).await }
            })
            .await?;
        if !reply.error().is_empty() {
            return Err(LockError::unavailable(format!(
                "etcd refused to grant a lease: {}",
                reply.error()
            )));
        }
        let granted = u64::try_from(reply.ttl()).unwrap_or(0);
        if granted == 0 || reply.id() <= 0 {
            return Err(LockError::unavailable(format!(
                "etcd granted an unusable lease (id {}, ttl {})",
                reply.id(),
                reply.ttl()
            )));
        }
        Ok((reply.id(), Duration::from_secs(granted)))
    }

    /// Revokes a lease in the background, bounded by the operation timeout.
    /// Failing only means the lease lives until its TTL runs out.
    pub(crate) fn revoke_later(&self, lease_id: i64) {
        let leases = self.leases.clone();
        let requests = self.requests.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            if let Err(e) = revoke(leases, &requests, lease_id).await {
                tracing::debug!(lease_id, error = %e, "could not revoke an etcd lease; it expires by its TTL");
            }
        });
    }

    /// Runs one transaction under the operation timeout (sent again as
    /// [`Requests::send`] says).
    pub(crate) async fn run_txn(
        &self,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
    ) -> Result<etcd_client::TxnResponse, LockError> {
        self.run_txn_until(self.requests.deadline(), what, repeat, txn)
            .await
    }

    /// [`run_txn`](Self::run_txn) as one step of an operation that must end
    /// by `deadline`.
    pub(crate) async fn run_txn_until(
        &self,
        deadline: Instant,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
    ) -> Result<etcd_client::TxnResponse, LockError> {
        let mut sends = 0;
        self.send_txn(deadline, what, repeat, txn, &mut sends).await
    }

    /// [`run_txn`](Self::run_txn), saying whether the answer came to a
    /// resend (an earlier send may have been applied unanswered).
    pub(crate) async fn run_txn_resent(
        &self,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
    ) -> Result<(etcd_client::TxnResponse, bool), LockError> {
        let mut sends = 0;
        let deadline = self.requests.deadline();
        let reply = self
            .send_txn(deadline, what, repeat, txn, &mut sends)
            .await?;
        Ok((reply, sends > 1))
    }

    async fn send_txn(
        &self,
        deadline: Instant,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
        sends: &mut u32,
    ) -> Result<etcd_client::TxnResponse, LockError> {
        let kv = &self.kv;
        self.requests
            .send_until(deadline, what, repeat, || {
                *sends += 1;
                let mut kv = kv.clone();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            })
            .await
    }
}

/// Revokes an etcd lease (deleting its keys), under the operation timeout.
pub(crate) async fn revoke(
    leases: LeaseClient,
    requests: &Requests,
    lease_id: i64,
) -> Result<(), LockError> {
    requests
        .send("revoking a lease", Repeat::Safe, || {
            let mut leases = leases.clone();
            async move { leases.revoke(lease_id).await.map(|_| ()) }
        })
        .await
}
