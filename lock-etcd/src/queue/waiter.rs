//! The task of one waiting call: moves it up its line as the waiters
//! before it leave, wakes the caller when it is first and what the line
//! waits for is free, and deletes its entry when the call ends.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::{Departure, ErrorKind, LockError, OwnerToken};

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
    /// The channel of the caller's [`ReleaseWatch`](distlock_core::ReleaseWatch).
    pub(super) channel: String,
    /// Numbers the channels of our own watches (one per watched target).
    pub(super) watches: u64,
    /// The watch of the etcd key watched now (predecessor entry, holder's
    /// marker or lock key).
    pub(super) watched: TargetWatch,
    /// The watched entry ahead is the marker of the lock's holder (see
    /// [`crate::marker`]): the waiter is first, and the marker's deletion
    /// is the lock's end.
    pub(super) holder_ahead: bool,
    /// The caller was woken for the end of that marker: if its attempt is
    /// refused (`refusals` moves), the marker went without the lock, and
    /// the task looks its place up again.
    pub(super) ahead_ended: bool,
    /// The seat's refusals (see [`Seat::refused`]); a lock waiter's only.
    pub(super) refusals: Option<tokio::sync::watch::Receiver<u64>>,
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
    /// [`ReleaseWatch::close`](distlock_core::ReleaseWatch::close) waits for it.
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
        self.holder_ahead
            || self
                .line
                .is_held_target(&queues.etcd.layout, &self.watched.target)
    }

    /// The watched entry ahead was put again as its holder's marker (and
    /// maybe deleted after: that lock ended too).
    fn marked_ahead(&self) -> bool {
        let Some(rewritten_at) = &self.watched.rewritten_at else {
            return false;
        };
        let rewritten = rewritten_at.load(Ordering::Acquire);
        let deleted = self.watched.deleted_at.load(Ordering::Acquire);
        rewritten > 0 && (deleted == 0 || deleted > rewritten)
    }

    /// The waiter is first, behind its holder's marker: no request (the
    /// watch already covers the marker's end).
    fn behind_holder(&mut self) {
        self.holder_ahead = true;
        if let Some((_, seat)) = &self.seat {
            *seat.ahead.lock().unwrap_or_else(|e| e.into_inner()) = None;
            seat.first_at.store(self.place, Ordering::Release);
        }
        self.expect_refusal(true);
    }

    /// The caller is woken past the marker ahead (it ended, or its lock
    /// is gone): a refusal from now on (not one before) means the marker
    /// went without its lock, and the task looks its place up again.
    fn past_marker(&mut self) {
        self.ahead_ended = true;
        if let Some(refusals) = self.refusals.as_mut() {
            refusals.borrow_and_update();
        }
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
            let refusals = self.refusals.as_mut().filter(|_| self.ahead_ended);
            let refused = async move {
                match refusals {
                    Some(refusals) => refusals.changed().await,
                    None => std::future::pending().await,
                }
            };
            let mut recheck = false;
            tokio::select! {
                woke = self.watched.watch.released() => {
                    if let Err(e) = woke {
                        // The watch stream was lost: a deletion may have
                        // been missed, and this watch is gone.
                        tracing::debug!(key = %self.line.key(), error = %e, "etcd watch lost; looking the waiter's place up again");
                        self.stale = true;
                    }
                }
                _ = &mut departed => break,
                _ = retry_sleep => {}
                changed = refused => {
                    // Woken for the marker's end and refused: the marker
                    // went without the lock.
                    recheck = changed.is_ok();
                }
            }
            if !self.waiting() {
                break;
            }
            let Some(queues) = self.queues() else {
                return;
            };
            let clean = retry.is_none() && !self.stale && !recheck;
            if clean && !self.is_first(&queues) && self.marked_ahead() {
                // The waiter ahead took the lock and left its entry as the
                // holder's marker: first now.
                tracing::trace!(key = %self.line.key(), place = self.place, "etcd waiter's predecessor holds the lock: first");
                self.behind_holder();
                if self.watched.deleted_at.load(Ordering::Acquire) == 0 {
                    continue;
                }
            }
            // A waiter whose grant took its entry out of line, yet still
            // waits (it gave a grant back, too late to use), queues again.
            if clean && self.is_first(&queues) && !self.taken() {
                if self.holder_ahead && self.watched.deleted_at.load(Ordering::Acquire) == 0 {
                    // The marker moved with its lock to a new lease.
                    continue;
                }
                // The lock key, or the holder's marker, was deleted: try now.
                tracing::trace!(key = %self.line.key(), place = self.place, "etcd lock released; waking the first waiter");
                if self.holder_ahead {
                    self.past_marker();
                }
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
        let marker_of = match (&self.seat, self.queues()) {
            (Some((owner, _)), Some(queues))
                if self.taken() && queues.markers.holds(*owner, &self.entry) =>
            {
                Some((*owner, queues))
            }
            _ => None,
        };
        if let Some((owner, queues)) = marker_of {
            // The entry is its lock's marker, deleted with the lock (see
            // `crate::marker`), which keeps the name's number till then.
            // Unsettled, the number is retired (see `crate::slots`).
            let slot = settled
                .then(|| queues.markers.keep(owner, &self.entry, self.slot).err())
                .flatten();
            if !self.fences.is_empty() {
                // Re-queueing puts whose outcome is unknown are fenced off
                // (place 0: an existing entry, the marker, is left alone).
                drop(queues);
                delete_entry(self.client.clone(), self.entry, Some(0), self.fences, slot).await;
            } else if let Some(slot) = slot {
                // Its lock ended already, marker and all.
                slot.free();
            }
            return;
        }
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
        let deleted_at = self.watched.deleted_at.load(Ordering::Acquire);
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
        // A marker seen again is watched again: the one watched may have
        // been deleted, and its name reused (see `crate::marker`).
        if self.stale || target != self.watched.target || self.ahead_ended {
            self.watched =
                match early.filter(|early| early.target == target && early.covers(&position)) {
                    Some(early) => early,
                    None => {
                        let channel = self.next_channel();
                        watch_target(queues, &self.line, channel, &target, &position).await?
                    }
                };
            self.stale = false;
        }
        self.holder_ahead = position.holder_ahead;
        self.ahead_ended = false;
        if let Some((_, seat)) = &self.seat {
            *seat.ahead.lock().unwrap_or_else(|e| e.into_inner()) = position.waiting_behind();
            seat.first_at
                .store(position.first_at(self.place), Ordering::Release);
        }
        let first = position.first();
        tracing::trace!(key = %self.line.key(), place = self.place, first, holder_ahead = self.holder_ahead, "etcd waiter moved up");
        if first && !position.held {
            if self.holder_ahead {
                // A marker without its lock: the caller takes the lock
                // past it.
                self.past_marker();
            }
            self.wake_caller(queues);
        } else {
            self.expect_refusal(true);
        }
        Ok(())
    }
}
