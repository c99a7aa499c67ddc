//! The task of one waiting call: moves it up its line as the waiters
//! before it leave, wakes the caller when it is first and what the line
//! waits for is free, and deletes its entry when the call ends.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::{Departure, ErrorKind, LockError, OwnerToken, ReleaseWatch};

use super::entries::{delete_entry, look_up, looked_up, put_entry};
use super::{
    target_of, watch_target, Line, Position, Queues, Seat, TargetWatch, RETRY_MAX, RETRY_MIN,
};
use crate::config::WAITER_TTL;
use crate::fence::Fence;
use crate::requests::Repeat;
use crate::slots::Slot;

/// One waiting call's place in the queue of one lock key.
pub(super) struct Waiter {
    /// The client's queues, held weakly: the task ends with the client.
    pub(super) client: Weak<Queues>,
    pub(super) line: Line,
    /// Our queue entry's etcd key.
    pub(super) entry: Vec<u8>,
    /// Its create revision: our place in line.
    pub(super) place: i64,
    /// The channel of the caller's [`ReleaseWatch`].
    pub(super) channel: String,
    /// Numbers the channels of our own watches (one per watched target).
    pub(super) watches: u64,
    /// The etcd key watched now (predecessor entry or lock key) and the
    /// subscription.
    pub(super) target: Vec<u8>,
    pub(super) watch: ReleaseWatch,
    /// The revision of the last deletion of `target` the watch reported
    /// (0: none yet; see [`crate::listener::Topic::deleted_at`]).
    pub(super) deleted_at: Arc<AtomicI64>,
    /// The watch was lost with its stream: replace it at the next look-up.
    pub(super) stale: bool,
    /// Fences of re-queueing puts whose outcome is unknown: put up with
    /// the entry's final delete.
    pub(super) fences: Vec<Fence>,
    /// A lock waiter's place, as its attempts claim it (registered by its
    /// owner token until the task ends).
    pub(super) seat: Option<(OwnerToken, Arc<Seat>)>,
    /// The entry was put again (its first one lost): it is deleted at the
    /// end even if an acquire took the lock out of line.
    pub(super) requeued: bool,
    /// The number in the entry's name: freed for another waiter once the
    /// entry is known deleted, else retired (see [`crate::slots`]).
    pub(super) slot: Slot,
    /// Dropped with the task, once the entry is deleted: the caller's
    /// [`ReleaseWatch::close`] waits for it.
    pub(super) _departure: Departure,
}

impl Waiter {
    fn queues(&self) -> Option<Arc<Queues>> {
        self.client.upgrade()
    }

    /// Whether the waiting call is still on (its watch not dropped).
    fn waiting(&self) -> bool {
        self.client
            .upgrade()
            .is_some_and(|queues| queues.waiting.has_waiters(&self.channel))
    }

    fn is_first(&self, queues: &Queues) -> bool {
        self.line.is_held_target(&queues.etcd.layout, &self.target)
    }

    fn wake_caller(&self, queues: &Queues) {
        self.expect_refusal(false);
        if let Some((_, seat)) = &self.seat {
            seat.woken.store(true, Ordering::Release);
        }
        queues.waiting.notify(&self.channel);
    }

    /// Tells the waiter's attempts whether they are likely refused (read
    /// first) or may take the lock now.
    fn expect_refusal(&self, refused: bool) {
        if let Some((_, seat)) = &self.seat {
            seat.expects_refusal.store(refused, Ordering::Release);
        }
    }

    /// An acquire that claimed our place took the lock, and deleted our
    /// entry with it.
    fn taken(&self) -> bool {
        self.seat
            .as_ref()
            .is_some_and(|(_, seat)| seat.taken.load(Ordering::Acquire))
    }

    pub(super) async fn run(mut self) {
        // Resolves when the waiting call ends (its ReleaseWatch dropped).
        let departed = match self.client.upgrade() {
            Some(queues) => queues.waiting.closed(&self.channel),
            None => return,
        };
        tokio::pin!(departed);
        // Set after a failed look-up: retry then.
        let mut retry: Option<Duration> = None;
        loop {
            let retry_sleep = async {
                match retry {
                    Some(pause) => tokio::time::sleep(pause).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                woke = self.watch.released() => {
                    if let Err(e) = woke {
                        // The watch stream was lost: a deletion may have
                        // been missed, and this watch is gone.
                        tracing::debug!(key = %self.line.key(), error = %e, "etcd watch lost; looking the waiter's place up again");
                        self.stale = true;
                    }
                }
                _ = &mut departed => break,
                _ = retry_sleep => {}
            }
            if !self.waiting() {
                break;
            }
            let Some(queues) = self.queues() else {
                return;
            };
            // A waiter whose grant took its entry out of line, yet still
            // waits (it gave a grant back, too late to use), queues again.
            if retry.is_none() && !self.stale && self.is_first(&queues) && !self.taken() {
                // The lock key was deleted: try now.
                tracing::trace!(key = %self.line.key(), place = self.place, "etcd lock released; waking the first waiter");
                self.wake_caller(&queues);
                continue;
            }
            // Our predecessor left, or the watch was lost: find our place
            // again.
            match self.move_up(&queues).await {
                Ok(()) => retry = None,
                Err(e) if e.kind() == ErrorKind::Corrupted => {
                    // Not obeyed (it would stall the line) and not deleted:
                    // every waiting call of this client queues again, and
                    // one that finds it in its way reports it.
                    tracing::error!(key = %self.line.key(), error = %e, "foreign data in an etcd waiter queue");
                    queues.waiting.reset();
                    break;
                }
                Err(e) => {
                    tracing::debug!(key = %self.line.key(), error = %e, "etcd queue look-up failed; retrying");
                    let pause = retry.map_or(RETRY_MIN, |p| (p * 2).min(RETRY_MAX));
                    retry = Some(pause);
                }
            }
        }
        tracing::trace!(key = %self.line.key(), place = self.place, "etcd waiter left the queue");
        if let (Some((owner, seat)), Some(queues)) = (&self.seat, self.queues()) {
            queues.unseat(*owner, seat);
        }
        // An attempt still in flight, or unanswered, may yet delete the
        // entry by its name: the name is retired then (see `crate::slots`).
        let settled = self.seat.as_ref().is_none_or(|(_, seat)| seat.settled());
        if self.taken() && !self.requeued && self.fences.is_empty() {
            // The acquire that took the lock deleted the entry.
            if settled {
                self.slot.free();
            }
            return;
        }
        // A put of the entry whose outcome is unknown may have moved its
        // place: the delete then takes whatever entry has the name.
        let place = self.fences.is_empty().then_some(self.place);
        let slot = settled.then_some(self.slot);
        delete_entry(self.client.clone(), self.entry, place, self.fences, slot).await;
    }

    /// Reads our predecessor and the lock key; watches the new predecessor,
    /// or the lock key if we are first now (waking the caller if the lock
    /// is free). A lost watch is replaced even if its target is unchanged.
    /// One read-only transaction ([`look_up`]).
    async fn move_up(&mut self, queues: &Queues) -> Result<(), LockError> {
        let etcd = &queues.etcd;
        let deleted_at = self.deleted_at.load(Ordering::Acquire);
        let predecessor_gone_at = (matches!(self.line, Line::Lock(_))
            && !self.stale
            && deleted_at > 0
            && !self.is_first(queues))
        .then_some(deleted_at);
        // A predecessor that left most likely took the lock, which makes
        // this waiter first: the lock key is watched before the look-up, so
        // a look-up that finds it first needs no read after it to cover
        // the time between the two (see `moved_up`). Without it (the
        // subscribe failed: the stream is lost, and every watch with it),
        // the look-up goes on as ever.
        let early = match predecessor_gone_at {
            Some(_) => {
                let target = self.line.held_target(&etcd.layout);
                let channel = self.next_channel();
                TargetWatch::subscribe(queues, &self.line, channel, &target)
                    .await
                    .ok()
            }
            None => None,
        };
        let txn = look_up(
            &etcd.layout,
            &self.line,
            &self.entry,
            self.place,
            predecessor_gone_at,
        );
        let reply = etcd
            .run_txn("etcd queue look-up", Repeat::Safe, txn)
            .await?;
        let mut position = looked_up(
            &etcd.layout,
            &self.line,
            &self.entry,
            self.place,
            predecessor_gone_at.is_some(),
            &reply,
        )?;
        if !position.queued {
            // Our entry is gone (our session lease was lost): queue again,
            // at the end of the line.
            let deadline = etcd.requests.deadline();
            let session = queues.sessions.session(WAITER_TTL, deadline).await?;
            let fence = Fence::new(&self.line.base(&etcd.layout), session.lease_id());
            self.requeued = true;
            let (place, again) =
                match put_entry(etcd, &self.line, &self.entry, &session, &fence, deadline).await {
                    Ok(placed) => placed,
                    Err(e) => {
                        // Its outcome is unknown: fenced off when we leave.
                        self.fences.push(fence);
                        return Err(e);
                    }
                };
            tracing::debug!(key = %self.line.key(), place, "etcd queue entry lost; queued again");
            self.place = place;
            if let Some((_, seat)) = &self.seat {
                seat.place.store(place, Ordering::Release);
                seat.taken.store(false, Ordering::Release);
            }
            position = again;
        }
        self.moved_up(queues, position, early).await
    }

    /// The channel of the waiter's next watch.
    fn next_channel(&mut self) -> String {
        let channel = format!("{}#{}", self.channel, self.watches);
        self.watches += 1;
        channel
    }

    /// Watches what `position` says to watch and tells the seat and the
    /// caller. `early`, a watch made before `position` was read, is kept
    /// if it watches that target and covers everything after the read.
    async fn moved_up(
        &mut self,
        queues: &Queues,
        position: Position,
        early: Option<TargetWatch>,
    ) -> Result<(), LockError> {
        let etcd = &queues.etcd;
        let target = target_of(&etcd.layout, &self.line, &position);
        if self.stale || target != self.target {
            match early.filter(|early| early.target == target && early.covers(&position)) {
                Some(early) => (self.watch, self.deleted_at) = (early.watch, early.deleted_at),
                None => {
                    let channel = self.next_channel();
                    (self.watch, self.deleted_at) =
                        watch_target(queues, &self.line, channel, &target, &position).await?;
                }
            }
            self.target = target;
            self.stale = false;
        }
        if let Some((_, seat)) = &self.seat {
            *seat.ahead.lock().unwrap_or_else(|e| e.into_inner()) = position.predecessor.clone();
            seat.first_at
                .store(position.first_at(self.place), Ordering::Release);
        }
        let first = position.predecessor.is_none();
        tracing::trace!(key = %self.line.key(), place = self.place, first, "etcd waiter moved up");
        if first && !position.held {
            self.wake_caller(queues);
        } else {
            self.expect_refusal(true);
        }
        Ok(())
    }
}
