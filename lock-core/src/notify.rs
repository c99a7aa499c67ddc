//! Fan-out of server release notifications to the waiters of one client.
//!
//! A backend keeps one server subscription per channel (Redis pub/sub channel,
//! PostgreSQL LISTEN channel, etcd watch) however many local waiters wait on
//! it, and wakes them all when a message arrives. A backend whose server
//! names the one waiter to wake (Redis's waiter queue) registers each
//! waiter under its owner token and wakes it alone; etcd's FIFO queue gives
//! each waiter a channel of its own.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{oneshot, watch, Notify, OnceCell};

use crate::LockError;

/// What a channel's watchers see: notifications so far, and resets so far
/// (a reset means the server subscription is gone).
type Wake = (u64, u64);

#[derive(Debug)]
struct Channel {
    wake: watch::Sender<Wake>,
    /// Waiters registered by name, each woken alone by
    /// [`ReleaseNotifier::notify_waiter`] (and with everyone by `notify`).
    named: HashMap<String, watch::Sender<Wake>>,
    subscribers: usize,
    ready: Arc<OnceCell<()>>,
}

impl Channel {
    /// Every sender of the channel: the shared one and each named waiter's.
    fn senders(&self) -> impl Iterator<Item = &watch::Sender<Wake>> {
        std::iter::once(&self.wake).chain(self.named.values())
    }
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
    /// Told when a channel's last waiter leaves (see
    /// [`Listener::unsubscribe_on_leave`](crate::Listener::unsubscribe_on_leave)).
    emptied: Option<Arc<Notify>>,
}

impl ReleaseNotifier {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry that tells `emptied` each time a channel's last
    /// waiter leaves.
    pub(crate) fn telling_emptied(emptied: Arc<Notify>) -> Self {
        Self {
            channels: Arc::default(),
            emptied: Some(emptied),
        }
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
        self.subscribe_as(channel, None, server_subscribe).await
    }

    /// [`subscribe`](Self::subscribe) for a waiter named `waiter` (its
    /// owner token, say): [`notify_waiter`](Self::notify_waiter) wakes it
    /// alone. A name already waiting on `channel` is refused.
    pub async fn subscribe_as<F, Fut>(
        &self,
        channel: &str,
        waiter: Option<&str>,
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
                    named: HashMap::new(),
                    subscribers: 0,
                    ready: Arc::new(OnceCell::new()),
                });
            let rx = match waiter {
                None => entry.wake.subscribe(),
                Some(name) if entry.named.contains_key(name) => {
                    return Err(LockError::invalid_input(format!(
                        "waiter {name:?} already waits on {channel:?}"
                    )));
                }
                Some(name) => {
                    let (tx, rx) = watch::channel(*entry.wake.borrow());
                    entry.named.insert(name.to_owned(), tx);
                    rx
                }
            };
            entry.subscribers += 1;
            let epoch = rx.borrow().1;
            let watch = ReleaseWatch {
                rx: Some(rx),
                epoch,
                channel: channel.to_owned(),
                waiter: waiter.map(str::to_owned),
                registry: Arc::downgrade(&self.channels),
                emptied: self.emptied.clone(),
                departures: Vec::new(),
                dropped: Vec::new(),
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
            for sender in entry.senders() {
                sender.send_modify(|(n, _)| *n = n.wrapping_add(1));
            }
        }
    }

    /// Wakes only the waiter named `waiter` on `channel` (the server chose
    /// it). `false` if no such waiter waits here: the wake-up reached
    /// nobody, and the caller may pass it on.
    pub fn notify_waiter(&self, channel: &str, waiter: &str) -> bool {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        match channels.get(channel).and_then(|e| e.named.get(waiter)) {
            Some(sender) => {
                sender.send_modify(|(n, _)| *n = n.wrapping_add(1));
                true
            }
            None => false,
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
            for sender in entry.senders() {
                sender.send_modify(|(n, epoch)| (*n, *epoch) = (n.wrapping_add(1), *epoch + 1));
            }
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

    /// Whether a waiter named `waiter` waits on `channel`.
    pub fn is_waiting(&self, channel: &str, waiter: &str) -> bool {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        channels
            .get(channel)
            .is_some_and(|entry| entry.named.contains_key(waiter))
    }

    /// Resolves once the waiter named `waiter` no longer waits on
    /// `channel` (its [`ReleaseWatch`] dropped); at once if it does not
    /// wait there now. A backend that queued the waiter on the server
    /// learns here that it left. Cancel-safe.
    pub fn waiter_closed(
        &self,
        channel: &str,
        waiter: &str,
    ) -> impl Future<Output = ()> + Send + 'static {
        let wake = {
            let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
            channels
                .get(channel)
                .and_then(|entry| entry.named.get(waiter))
                .cloned()
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

/// What becomes of a wake-up that names one waiter who no longer waits
/// here (its watch dropped: the wait ended, or the waiter never was this
/// client's): a backend's notification source hands each one it receives
/// to [`pass_on_if_unclaimed`](Self::pass_on_if_unclaimed).
///
/// A server line that keeps the woken waiter first, with a turn, waits
/// for that waiter until the turn runs out; one that takes the waiter off
/// the line as it wakes it has lost the wake-up. The wait's own leave
/// usually prevents both, but not when it failed, nor when a request of
/// the wait whose outcome was unknown reached the server after it and put
/// the waiter back in line. So the client that receives such a wake-up
/// leaves the line for the waiter (`pass_on`, called with the channel and
/// the waiter's name): a second leave changes nothing, and a leave wakes
/// the next waiter if the lock or a permit is free.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use distlock_core::{ReleaseNotifier, Unclaimed};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let notifier = ReleaseNotifier::new();
/// let passed = Arc::new(AtomicUsize::new(0));
/// let unclaimed = {
///     let passed = passed.clone();
///     // A backend sends its leave statement here, on a task of its own.
///     Unclaimed::new(notifier.clone(), move |_channel: &str, _waiter: &str| {
///         passed.fetch_add(1, Ordering::SeqCst);
///     })
/// };
/// let watch = notifier.subscribe_as("jobs:report", Some("a"), || async { Ok(()) }).await?;
/// assert!(!unclaimed.pass_on_if_unclaimed("jobs:report", "a"), "a waits");
/// drop(watch);
/// assert!(unclaimed.pass_on_if_unclaimed("jobs:report", "a"), "a's wait ended");
/// assert_eq!(passed.load(Ordering::SeqCst), 1);
/// # Ok(()) }
/// ```
pub struct Unclaimed {
    notifier: ReleaseNotifier,
    pass_on: Box<PassOn>,
}

/// What passes a wake-up on: called with its channel and the waiter's name.
type PassOn = dyn Fn(&str, &str) + Send + Sync;

impl Unclaimed {
    /// Wake-ups for waiters not registered with `notifier` go to `pass_on`.
    pub fn new(
        notifier: ReleaseNotifier,
        pass_on: impl Fn(&str, &str) + Send + Sync + 'static,
    ) -> Self {
        Self {
            notifier,
            pass_on: Box::new(pass_on),
        }
    }

    /// Passes the wake-up of `waiter` on `channel` on if no such waiter
    /// waits here; whether it did.
    pub fn pass_on_if_unclaimed(&self, channel: &str, waiter: &str) -> bool {
        let unclaimed = !self.notifier.is_waiting(channel, waiter);
        if unclaimed {
            (self.pass_on)(channel, waiter);
        }
        unclaimed
    }
}

impl std::fmt::Debug for Unclaimed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unclaimed").finish_non_exhaustive()
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
    /// The name it was registered under, if any.
    waiter: Option<String>,
    registry: Weak<Registry>,
    /// Told if this watch was its channel's last (see
    /// [`ReleaseNotifier::telling_emptied`]).
    emptied: Option<Arc<Notify>>,
    /// Ends of the backend's work after the drop (see [`Departure`]).
    departures: Vec<oneshot::Receiver<()>>,
    /// Dropped with the watch: starts the work given to
    /// [`leave_with`](Self::leave_with).
    dropped: Vec<oneshot::Sender<()>>,
}

/// The backend's work after a [`ReleaseWatch`] drops (taking its waiter
/// out of the server's line), held by the task that does it and dropped
/// when done: [`ReleaseWatch::close`] waits for it. Made by
/// [`ReleaseWatch::departure`].
#[derive(Debug)]
pub struct Departure {
    _done: oneshot::Sender<()>,
}

impl ReleaseWatch {
    /// A watch that never fires (waiters then rely on the holder's expiry
    /// and their deadline).
    pub fn never() -> Self {
        Self {
            rx: None,
            epoch: 0,
            channel: String::new(),
            waiter: None,
            registry: Weak::new(),
            emptied: None,
            departures: Vec::new(),
            dropped: Vec::new(),
        }
    }

    /// Runs `leave` in a task of its own once this watch drops: the
    /// backend's work to take its waiter out of the server's line. The task
    /// holds a [`Departure`] until `leave` is done, so [`close`](Self::close)
    /// waits for it; a plain drop leaves it running in the background.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock_core::LockError> {
    /// use std::time::Duration;
    /// use distlock_core::ReleaseNotifier;
    ///
    /// let notifier = ReleaseNotifier::new();
    /// let mut watch = notifier.subscribe_as("k", Some("waiter"), || async { Ok(()) }).await?;
    /// watch.leave_with(async {
    ///     // ... take the waiter out of the server's line ...
    /// });
    /// watch.close(Duration::from_secs(1)).await; // returns once it is done
    /// # Ok(()) }
    /// ```
    pub fn leave_with<F>(&mut self, leave: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (dropped, watch_gone) = oneshot::channel();
        self.dropped.push(dropped);
        let departure = self.departure();
        tokio::spawn(async move {
            // An error is the sender's drop, with the watch: what this waits for.
            let _ = watch_gone.await;
            leave.await;
            drop(departure);
        });
    }

    /// A [`Departure`] for the work a backend does once this watch drops
    /// (a waiter leaving its line on the server, in a task of its own):
    /// the task holds it until that work is done, and [`close`](Self::close)
    /// waits for that. Without one, `close` is a drop. Most backends want
    /// [`leave_with`](Self::leave_with), which holds one for its leave; this
    /// is for a task that holds its departure in state of its own.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock_core::LockError> {
    /// use std::time::Duration;
    /// use distlock_core::ReleaseNotifier;
    ///
    /// let notifier = ReleaseNotifier::new();
    /// let mut watch = notifier.subscribe_as("k", Some("waiter"), || async { Ok(()) }).await?;
    /// let closed = notifier.waiter_closed("k", "waiter");
    /// let departure = watch.departure();
    /// tokio::spawn(async move {
    ///     closed.await;
    ///     // ... take the waiter out of the server's line ...
    ///     drop(departure);
    /// });
    /// watch.close(Duration::from_secs(1)).await; // returns once the task is done
    /// # Ok(()) }
    /// ```
    pub fn departure(&mut self) -> Departure {
        let (done, ended) = oneshot::channel();
        self.departures.push(ended);
        Departure { _done: done }
    }

    /// Drops the watch, then waits until the backend's work after the drop
    /// (its [`departure`](Self::departure)s) is done, at most `bound`: a
    /// wait that ended without the lock returns once its place in the
    /// server's line is given up, so the caller's next attempt does not
    /// meet its own departed turn. Cancel-safe: dropped, the work goes on
    /// in the background, as after a plain drop.
    pub async fn close(mut self, bound: Duration) {
        let departures = std::mem::take(&mut self.departures);
        drop(self);
        let all_done = async {
            for ended in departures {
                // An error is the departure's drop: what this waits for.
                let _ = ended.await;
            }
        };
        let _ = tokio::time::timeout(bound, all_done).await;
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
            if let Some(name) = &self.waiter {
                entry.named.remove(name);
            }
            entry.subscribers -= 1;
            if entry.subscribers == 0 {
                channels.remove(&self.channel);
                if let Some(emptied) = &self.emptied {
                    emptied.notify_one();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn woken(watch: &mut ReleaseWatch) -> bool {
        tokio::time::timeout(Duration::from_millis(20), watch.released())
            .await
            .is_ok()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn close_returns_once_the_departures_are_done() {
        let notifier = ReleaseNotifier::new();
        let ok = || async { Ok(()) };
        let mut watch = notifier.subscribe_as("k", Some("a"), ok).await.unwrap();
        let closed = notifier.waiter_closed("k", "a");
        let departure = watch.departure();
        let left = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = left.clone();
        tokio::spawn(async move {
            closed.await;
            // The backend's leave: a request, then the departure goes.
            tokio::time::sleep(Duration::from_millis(50)).await;
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            drop(departure);
        });
        watch.close(Duration::from_secs(10)).await;
        assert!(
            left.load(std::sync::atomic::Ordering::SeqCst),
            "close returned before the departure was done"
        );
        assert!(!notifier.is_waiting("k", "a"), "the watch is gone");

        // Bounded: a departure that never ends holds close up `bound` only.
        let mut watch = notifier.subscribe_as("k", Some("b"), ok).await.unwrap();
        let stuck = watch.departure();
        let started = tokio::time::Instant::now();
        tokio::time::pause();
        watch.close(Duration::from_secs(2)).await;
        assert!(started.elapsed() >= Duration::from_secs(2));
        drop(stuck);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn leave_with_runs_after_the_drop_and_close_waits_for_it() {
        use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
        let notifier = ReleaseNotifier::new();
        let ok = || async { Ok(()) };
        let mut watch = notifier.subscribe_as("k", Some("a"), ok).await.unwrap();
        // 0: not started, 1: started, 2: done.
        let step = Arc::new(AtomicU8::new(0));
        let seen = step.clone();
        let waiting = notifier.is_waiting("k", "a");
        let registry = Arc::downgrade(&notifier.channels);
        watch.leave_with(async move {
            seen.store(1, SeqCst);
            // The watch is unregistered before its leave starts.
            let gone = registry
                .upgrade()
                .is_none_or(|channels| !channels.lock().unwrap().contains_key("k"));
            assert!(gone, "leave started while the watch was still registered");
            tokio::time::sleep(Duration::from_millis(50)).await;
            seen.store(2, SeqCst);
        });
        assert!(waiting);
        tokio::task::yield_now().await;
        assert_eq!(step.load(SeqCst), 0, "leave ran before the watch dropped");
        watch.close(Duration::from_secs(10)).await;
        assert_eq!(
            step.load(SeqCst),
            2,
            "close returned before the leave was done"
        );

        // A plain drop: the leave still runs, in the background.
        let mut watch = notifier.subscribe_as("k", Some("b"), ok).await.unwrap();
        let (done, left) = oneshot::channel();
        watch.leave_with(async move {
            let _ = done.send(());
        });
        drop(watch);
        left.await.expect("the leave ran after a plain drop");
    }

    #[tokio::test]
    async fn a_named_wake_up_wakes_that_waiter_alone() {
        let notifier = ReleaseNotifier::new();
        let ok = || async { Ok(()) };
        let mut a = notifier.subscribe_as("k", Some("a"), ok).await.unwrap();
        let mut b = notifier.subscribe_as("k", Some("b"), ok).await.unwrap();
        let mut anyone = notifier.subscribe("k", ok).await.unwrap();
        assert!(notifier.notify_waiter("k", "b"));
        assert!(woken(&mut b).await);
        assert!(!woken(&mut a).await);
        assert!(!woken(&mut anyone).await);
        // A wake-up for a waiter that is not here reaches nobody.
        assert!(!notifier.notify_waiter("k", "c"));
        assert!(!notifier.notify_waiter("other", "a"));
        // A channel-wide notification still wakes everyone.
        notifier.notify("k");
        assert!(woken(&mut a).await && woken(&mut b).await && woken(&mut anyone).await);
    }

    #[tokio::test]
    async fn a_reset_reaches_named_waiters_and_a_name_waits_once() {
        let notifier = ReleaseNotifier::new();
        let ok = || async { Ok(()) };
        let mut a = notifier.subscribe_as("k", Some("a"), ok).await.unwrap();
        let again = notifier.subscribe_as("k", Some("a"), ok).await;
        assert_eq!(again.unwrap_err().kind(), crate::ErrorKind::InvalidInput);
        notifier.reset();
        assert!(a.released().await.is_err());
    }

    #[tokio::test]
    async fn waiter_closed_resolves_when_its_watch_drops() {
        let notifier = ReleaseNotifier::new();
        let ok = || async { Ok(()) };
        let a = notifier.subscribe_as("k", Some("a"), ok).await.unwrap();
        let _b = notifier.subscribe_as("k", Some("b"), ok).await.unwrap();
        let closed = notifier.waiter_closed("k", "a");
        tokio::pin!(closed);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), &mut closed)
                .await
                .is_err(),
            "a still waits"
        );
        drop(a);
        closed.await;
        // Its name is free again; the other waiter is untouched.
        assert!(!notifier.notify_waiter("k", "a"));
        assert!(notifier.notify_waiter("k", "b"));
        notifier.subscribe_as("k", Some("a"), ok).await.unwrap();
    }
}
