//! The in-memory backend's waiter lines: a release wakes the first waiter
//! of its key alone, in arrival order, as the server backends' lines do.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::{LockError, LockKey, OwnerToken, ReleaseNotifier, ReleaseWatch};

/// The lines of one kind (locks, or semaphores), and their waiters' watches.
#[derive(Debug, Default)]
pub(super) struct Lines {
    notifier: ReleaseNotifier,
    lines: Mutex<HashMap<LockKey, VecDeque<OwnerToken>>>,
}

impl Lines {
    fn lines(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, VecDeque<OwnerToken>>> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `waiter`'s watch on `key`; the future resolves once that
    /// watch is dropped (the wait ended).
    pub(super) async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<
        (
            ReleaseWatch,
            impl std::future::Future<Output = ()> + Send + 'static,
        ),
        LockError,
    > {
        let name = waiter.to_hex();
        let watch = self
            .notifier
            .subscribe_as(key.as_str(), Some(&name), || async { Ok(()) })
            .await?;
        let closed = self.notifier.waiter_closed(key.as_str(), &name);
        Ok((watch, closed))
    }

    /// An attempt of `owner` found `key` taken: a waiter joins the line
    /// (keeping its place if it has one).
    pub(super) fn refused(&self, key: &LockKey, owner: OwnerToken) {
        if !self.notifier.is_waiting(key.as_str(), &owner.to_hex()) {
            return;
        }
        let mut lines = self.lines();
        let line = lines.entry(key.clone()).or_default();
        if !line.contains(&owner) {
            line.push_back(owner);
        }
    }

    /// `owner` got the key, or stopped waiting: it leaves the line.
    pub(super) fn leave(&self, key: &LockKey, owner: OwnerToken) {
        let mut lines = self.lines();
        if let Some(line) = lines.get_mut(key) {
            line.retain(|o| *o != owner);
            if line.is_empty() {
                lines.remove(key);
            }
        }
    }

    /// `key` came free: wakes the first waiter still waiting, taking it
    /// off the line (it joins again if its attempt is refused).
    pub(super) fn wake_next(&self, key: &LockKey) {
        let mut lines = self.lines();
        let Some(line) = lines.get_mut(key) else {
            return;
        };
        while let Some(owner) = line.pop_front() {
            if self.notifier.notify_waiter(key.as_str(), &owner.to_hex()) {
                break;
            }
        }
        if line.is_empty() {
            lines.remove(key);
        }
    }

    /// How many wait in lines (for tests: nothing left behind).
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.lines().values().map(VecDeque::len).sum()
    }
}
