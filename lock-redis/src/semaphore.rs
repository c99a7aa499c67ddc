//! Counting semaphores: [`RedisLock`]'s [`SemaphoreBackend`].
//!
//! A semaphore is a sorted set of permits in its own names
//! ([`RedisKeys::semaphore`]: the lock's hash tag, other suffixes), its
//! own fencing counter and released-by markers, its holder labels, and its
//! own channel. Each
//! operation is one script (see `scripts.rs`), run as the lock's are:
//! under the operation timeout, waiting for `min_replicas` after an
//! acquisition or an extension (not for a settling attempt), and a grant
//! those replicas did not acknowledge is given back. Waiters subscribe to
//! the semaphore's channel through the client's one pub/sub listener.

use std::time::{Duration, Instant};

use distlock_core::{
    async_trait, ExtendReply, HeldLock, LockError, LockKey, OwnerToken, PermitReply, PermitRequest,
    PermitState, ReleaseReply, ReleaseWatch, SemaphoreBackend,
};

use crate::backend::{arg_millis, not_replicated, Call, RedisLock};
use crate::keys::RedisKeys;
use crate::replies;
use crate::scripts::{
    ACQUIRE_PERMIT_SCRIPT, EXTEND_PERMIT_SCRIPT, INSPECT_PERMITS_SCRIPT, RELEASE_PERMIT_SCRIPT,
};
use crate::waiters::Line;

impl RedisLock {
    /// Gives back the permit of `owner` and `fencing` within `timeout`.
    async fn release_permit_within(
        &self,
        key: &LockKey,
        keys: &RedisKeys,
        owner: &str,
        fencing: u64,
        timeout: Duration,
    ) -> Result<ReleaseReply, LockError> {
        let args = [
            owner.to_owned(),
            fencing.to_string(),
            keys.channel.clone(),
            self.publish_command().to_owned(),
            self.released_marker_ms(),
            // As the lock's release: a resend of this request carries this
            // id, another release call does not.
            OwnerToken::random().to_hex(),
        ];
        let call = Call {
            keys,
            script: &RELEASE_PERMIT_SCRIPT,
            redis_keys: &[&keys.lock, &keys.gone, &keys.waiters, &keys.holder],
            args: &args,
        };
        let (reply, _) = self.execute(call, None, timeout).await?;
        replies::release_reply(key, &reply)
    }

    /// The live permits of `key`'s semaphore with their labels
    /// ([`distlock_core::LockAdmin::inspect_permits`]).
    pub(crate) async fn list_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        let keys = self.semaphore_keys(key);
        let reply = self
            .run(Call {
                keys: &keys,
                script: &INSPECT_PERMITS_SCRIPT,
                redis_keys: &[&keys.lock, &keys.holder],
                args: &[],
            })
            .await?;
        replies::inspect_permits_reply(&reply)
    }
}

#[async_trait]
impl SemaphoreBackend for RedisLock {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        let key = request.key;
        let keys = self.semaphore_keys(key);
        let owner = request.owner.to_hex();
        let args = [
            owner.clone(),
            arg_millis(request.ttl),
            self.retention_ms(request.ttl),
            request.limit.to_string(),
            self.line_member(Line::Permits, key, request.owner, request.settling),
            request
                .holder
                .map_or_else(String::new, |h| h.as_str().to_owned()),
        ];
        // The give-back below shares this operation's timeout.
        let sent = Instant::now();
        let call = Call {
            keys: &keys,
            script: &ACQUIRE_PERMIT_SCRIPT,
            redis_keys: &[&keys.lock, &keys.fence, &keys.waiters, &keys.holder],
            args: &args,
        };
        let (reply, replicated) = self.run_acquire(call, request.settling).await?;
        let reply = replies::acquire_permit_reply(key, &keys, request.ttl, &reply)?;
        let PermitReply::Granted(grant) = &reply else {
            return Ok(reply);
        };
        self.line_granted(Line::Permits, key, request.owner, request.settling);
        let Some(shortfall) = replicated.shortfall("it was released again") else {
            return Ok(reply);
        };
        // Not replicated enough to survive a failover: given back, as the
        // lock is (the outcome is known: the primary granted it).
        let left = self.time_left(sent);
        let given_back = self
            .release_permit_within(key, &keys, &owner, grant.fencing.get(), left)
            .await;
        Err(not_replicated(shortfall, given_back))
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let keys = self.semaphore_keys(permit.key);
        let args = [
            permit.owner.to_hex(),
            permit.fencing.get().to_string(),
            arg_millis(ttl),
            self.retention_ms(ttl),
        ];
        let call = Call {
            keys: &keys,
            script: &EXTEND_PERMIT_SCRIPT,
            redis_keys: &[&keys.lock, &keys.fence, &keys.holder],
            args: &args,
        };
        self.run_extend(call, permit, ttl).await
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let keys = self.semaphore_keys(permit.key);
        let timeout = self.config().client().operation_timeout();
        self.release_permit_within(
            permit.key,
            &keys,
            &permit.owner.to_hex(),
            permit.fencing.get(),
            timeout,
        )
        .await
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        _limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let keys = self.semaphore_keys(key);
        Ok(Some(
            self.watch_line(Line::Permits, key, keys, waiter).await?,
        ))
    }
}
