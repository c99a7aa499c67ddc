//! Fan-out of server release notifications to the waiters of one client.
//!
//! A backend keeps one server subscription per channel (Redis pub/sub channel,
//! PostgreSQL LISTEN channel, etcd watch) however many local waiters wait on
//! it, and wakes them all when a message arrives. A backend that wakes
//! waiters one at a time (etcd's FIFO queue) gives each waiter a channel of
//! its own.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{watch, OnceCell};

use crate::LockError;

/// What a channel's watchers see: notifications so far, and resets so far
/// (a reset means the server subscription is gone).
type Wake = (u64, u64);

#[derive(Debug)]
struct Channel {
    wake: watch::Sender<Wake>,
    subscribers: usize,
    ready: Arc<OnceCell<()>>,
}

type Registry = Mutex<HashMap<String, Channel>>;

/// One client's registry of channels with local waiters.
///
/// ```
/// use distlock_core::ReleaseNotifier;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let notifier = ReleaseNotifier::new();
/// // The closure runs once per channel: subscribe on the server there.
/// let mut watch = notifier.subscribe("jobs:report", || async { Ok(()) }).await?;
/// notifier.notify("jobs:report"); // a message arrived from the server
/// watch.released().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct ReleaseNotifier {
    channels: Arc<Registry>,
}

impl ReleaseNotifier {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a waiter on `channel`. The first waiter of a channel runs
    /// `server_subscribe` (and every concurrent waiter awaits its success),
    /// so when this returns the server subscription is live. If it fails,
    /// the next waiter tries again.
    pub async fn subscribe<F, Fut>(
        &self,
        channel: &str,
        server_subscribe: F,
    ) -> Result<ReleaseWatch, LockError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), LockError>>,
    {
        let (watch, ready) = {
            let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
            let entry = channels
                .entry(channel.to_owned())
                .or_insert_with(|| Channel {
                    wake: watch::channel((0, 0)).0,
                    subscribers: 0,
                    ready: Arc::new(OnceCell::new()),
                });
            entry.subscribers += 1;
            let rx = entry.wake.subscribe();
            let epoch = rx.borrow().1;
            let watch = ReleaseWatch {
                rx: Some(rx),
                epoch,
                channel: channel.to_owned(),
                registry: Arc::downgrade(&self.channels),
            };
            (watch, entry.ready.clone())
        };
        // `watch` unregisters itself on drop, also when this fails.
        ready.get_or_try_init(server_subscribe).await?;
        Ok(watch)
    }

    /// Wakes every waiter of `channel`. Called when the server says a lock
    /// on it was released.
    pub fn notify(&self, channel: &str) {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = channels.get(channel) {
            entry.wake.send_modify(|(n, _)| *n = n.wrapping_add(1));
        }
    }

    /// Forgets that channels were subscribed on the server and wakes every
    /// waiter with an error from [`ReleaseWatch::released`], so each
    /// subscribes again (reconnecting) before its next attempt. Called when
    /// the notification connection is lost: messages may have been missed.
    pub fn reset(&self) {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        for entry in channels.values_mut() {
            entry.ready = Arc::new(OnceCell::new());
            entry
                .wake
                .send_modify(|(n, epoch)| (*n, *epoch) = (n.wrapping_add(1), *epoch + 1));
        }
    }

    /// Resolves once `channel` has no waiters left (every [`ReleaseWatch`]
    /// on it dropped); at once if it has none now. A backend that keeps
    /// per-waiter state on the server (a queue entry) learns here that the
    /// waiting call ended. Cancel-safe.
    pub fn closed(&self, channel: &str) -> impl Future<Output = ()> + Send + 'static {
        let wake = {
            let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
            channels.get(channel).map(|entry| entry.wake.clone())
        };
        async move {
            if let Some(wake) = wake {
                wake.closed().await;
            }
        }
    }

    /// The channels that currently have waiters.
    pub fn channels(&self) -> Vec<String> {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        channels.keys().cloned().collect()
    }

    /// Whether `channel` has waiters (a backend may unsubscribe on the server
    /// from channels that have none).
    pub fn has_waiters(&self, channel: &str) -> bool {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        channels.contains_key(channel)
    }
}

/// One waiter's subscription to release notifications for a key; see
/// [`LockBackend::watch`](crate::LockBackend::watch).
///
/// Dropping it unregisters the waiter. Cancel-safe.
#[derive(Debug)]
pub struct ReleaseWatch {
    rx: Option<watch::Receiver<Wake>>,
    epoch: u64,
    channel: String,
    registry: Weak<Registry>,
}

impl ReleaseWatch {
    /// A watch that never fires (waiters then rely on the holder's expiry
    /// and their deadline).
    pub fn never() -> Self {
        Self {
            rx: None,
            epoch: 0,
            channel: String::new(),
            registry: Weak::new(),
        }
    }

    /// Resolves at the first notification after this watch was created, or
    /// after the previous call returned. An error means the server
    /// subscription was lost (see [`ReleaseNotifier::reset`]): drop this
    /// watch and subscribe again before the next attempt. Cancel-safe.
    pub async fn released(&mut self) -> Result<(), LockError> {
        match &mut self.rx {
            Some(rx) => {
                if rx.changed().await.is_err() {
                    // The registry entry is gone; nobody will notify again.
                    std::future::pending::<()>().await;
                }
                if rx.borrow_and_update().1 != self.epoch {
                    return Err(LockError::unavailable(
                        "the release-notification connection was lost; subscribe again",
                    ));
                }
                Ok(())
            }
            None => std::future::pending().await,
        }
    }
}

impl Drop for ReleaseWatch {
    fn drop(&mut self) {
        let Some(registry) = self.registry.upgrade() else {
            return;
        };
        let mut channels = registry.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = channels.get_mut(&self.channel) {
            entry.subscribers -= 1;
            if entry.subscribers == 0 {
                channels.remove(&self.channel);
            }
        }
    }
}
