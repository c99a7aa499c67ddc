//! One notification listener for every backend: a lazily opened server
//! connection that carries release notifications to the waiters of one
//! client.
//!
//! A backend describes its connection as a [`NotificationSource`] (Redis
//! pub/sub, PostgreSQL `LISTEN`, an etcd watch stream); [`Listener`] does
//! the rest, the same way for all of them:
//!
//! - connects on the first waiter, under the connect timeout;
//! - subscribes a topic on the server when its first local waiter arrives,
//!   and returns only once the server confirmed (so a waiter that subscribes
//!   and then attempts never misses the release in between);
//! - reads notifications on one task and wakes the waiters of their channel
//!   (or the one waiter a [`Notification`] names);
//! - pings a connection that stayed quiet, so a silently dead one (a network
//!   black hole) is noticed;
//! - unsubscribes topics whose waiters all left;
//! - treats *every* failure — the connection ending, a read error, a failed
//!   ping, a failed or timed-out subscribe — as one event: the connection
//!   is dropped and every waiter is woken with an error from
//!   [`ReleaseWatch::released`], so each subscribes again (reconnecting)
//!   before its next attempt. Releases published during the gap are
//!   therefore never missed, and reconnection follows the waiting loop's
//!   one backoff policy (waiters retry transient errors with backoff until
//!   their deadline).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::{with_timeout, ClientOptions, LockError, ReleaseNotifier, ReleaseWatch};

/// What a notification wakes: every waiter of a channel, or only the one
/// waiter the server named (see [`Listener::watch_as`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The local channel ([`NotificationSource::channel`]).
    pub channel: String,
    /// The one waiter to wake, if the server named one.
    pub waiter: Option<String>,
}

impl Notification {
    /// Wakes only `waiter` on `channel`.
    pub fn for_waiter(channel: impl Into<String>, waiter: impl Into<String>) -> Self {
        Self {
            channel: channel.into(),
            waiter: Some(waiter.into()),
        }
    }
}

/// Wakes every waiter of the channel.
impl From<String> for Notification {
    fn from(channel: String) -> Self {
        Self {
            channel,
            waiter: None,
        }
    }
}

/// A server connection that delivers release notifications, as a backend
/// sees it. The [`Listener`] owns the lifecycle; this says how to talk.
#[async_trait]
pub trait NotificationSource: Send + Sync + 'static {
    /// What a waiter subscribes to (a channel name; an etcd key and the
    /// revision to watch from).
    type Topic: Clone + Send + Sync + 'static;
    /// Subscribes and pings while the stream is being read.
    type Sink: Clone + Send + Sync + 'static;
    /// The receiving side, read by the listener's task.
    type Stream: Send + 'static;

    /// The local channel a topic's notifications wake: the
    /// [`ReleaseNotifier`] channel that [`next`](Self::next) returns for it.
    fn channel(&self, topic: &Self::Topic) -> String;

    /// Opens a connection (the listener bounds it by the connect timeout).
    async fn connect(&self) -> Result<(Self::Sink, Self::Stream), LockError>;

    /// Subscribes `topics`; resolves once the server confirmed (the
    /// listener bounds it by the operation timeout).
    async fn subscribe(&self, sink: &Self::Sink, topics: &[Self::Topic]) -> Result<(), LockError>;

    /// Unsubscribes topics nobody waits on any more. The default keeps them
    /// (right for a source with one server-side subscription for all).
    async fn unsubscribe(
        &self,
        sink: &Self::Sink,
        topics: &[Self::Topic],
    ) -> Result<(), LockError> {
        let _ = (sink, topics);
        Ok(())
    }

    /// The next notification: the channel to wake (a `String` converts). `None` or an error ends
    /// the connection. Must be cancel-safe (the listener stops reading to
    /// ping a quiet connection).
    async fn next(&self, stream: &mut Self::Stream) -> Option<Result<Notification, LockError>>;

    /// Checks that a quiet connection is alive (the listener bounds it by
    /// the operation timeout). The default trusts the transport's own
    /// keep-alive.
    async fn ping(&self, sink: &Self::Sink, stream: &mut Self::Stream) -> Result<(), LockError> {
        let _ = (sink, stream);
        Ok(())
    }
}

/// How long a connection may stay quiet before it is pinged, and how often
/// topics without waiters are unsubscribed.
const HEALTH_CHECK_AFTER: Duration = Duration::from_secs(10);

/// How long a sweep on leave ([`Listener::unsubscribe_on_leave`]) waits
/// for more waiters to leave.
const SWEEP_GATHERS: Duration = Duration::from_millis(10);

/// The notification listener of one client: connects on the first waiter,
/// subscribes a topic when its first waiter arrives (returning once the
/// server confirmed), wakes a topic's waiters on each release notification,
/// pings a quiet connection, and on any failure drops the connection and
/// wakes every waiter with an error so each subscribes again. A backend
/// describes its connection as a [`NotificationSource`].
///
/// ```
/// use distlock_core::{async_trait, ClientOptions, Listener, LockError, Notification, NotificationSource};
/// use tokio::sync::mpsc;
///
/// /// A toy source: notifications come from an in-process channel.
/// struct Toy(std::sync::Mutex<Option<mpsc::UnboundedReceiver<String>>>);
///
/// #[async_trait]
/// impl NotificationSource for Toy {
///     type Topic = String;
///     type Sink = ();
///     type Stream = mpsc::UnboundedReceiver<String>;
///     fn channel(&self, topic: &String) -> String { topic.clone() }
///     async fn connect(&self) -> Result<((), Self::Stream), LockError> {
///         let rx = self.0.lock().unwrap().take();
///         rx.map(|rx| ((), rx)).ok_or_else(|| LockError::unavailable("toy server gone"))
///     }
///     async fn subscribe(&self, _: &(), _: &[String]) -> Result<(), LockError> { Ok(()) }
///     async fn next(&self, stream: &mut Self::Stream) -> Option<Result<Notification, LockError>> {
///         stream.recv().await.map(|channel| Ok(channel.into()))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), LockError> {
/// let (server, rx) = mpsc::unbounded_channel();
/// let listener = Listener::new(Toy(std::sync::Mutex::new(Some(rx))), &ClientOptions::default());
/// let mut watch = listener.watch("jobs:report".to_owned()).await?;
/// server.send("jobs:report".to_owned()).unwrap(); // a release on the server
/// watch.released().await?;
/// # Ok(()) }
/// ```
pub struct Listener<S: NotificationSource> {
    inner: Arc<Inner<S>>,
}

impl<S: NotificationSource> std::fmt::Debug for Listener<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("channels", &self.inner.notifier.channels().len())
            .finish_non_exhaustive()
    }
}

struct Inner<S: NotificationSource> {
    source: Arc<S>,
    options: ClientOptions,
    health_check_after: Duration,
    notifier: ReleaseNotifier,
    live: tokio::sync::Mutex<Option<Live<S>>>,
    generation: AtomicU64,
    /// The generation whose reader is running (0: none). Its reader clears
    /// it when it ends without the lost path (see [`ReaderExit`]).
    reading: AtomicU64,
    /// Told when a channel's last waiter leaves, if topics are unsubscribed
    /// then ([`Listener::unsubscribe_on_leave`]).
    emptied: Option<Arc<Notify>>,
}

struct Live<S: NotificationSource> {
    sink: S::Sink,
    generation: u64,
    /// The topic of every channel subscribed (or being subscribed) on this
    /// connection, for the sweep to unsubscribe once idle.
    subscribed: HashMap<String, S::Topic>,
    reader: JoinHandle<()>,
    /// Unsubscribes topics whose last waiter left, if the listener does
    /// that at once ([`Listener::unsubscribe_on_leave`]).
    sweeper: Option<JoinHandle<()>>,
}

impl<S: NotificationSource> Drop for Live<S> {
    fn drop(&mut self) {
        self.reader.abort();
        if let Some(sweeper) = &self.sweeper {
            sweeper.abort();
        }
    }
}

impl<S: NotificationSource> Listener<S> {
    /// A listener over `source`, with the client's timeouts. Connects on
    /// the first [`watch`](Self::watch).
    pub fn new(source: S, options: &ClientOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                source: Arc::new(source),
                options: options.clone(),
                health_check_after: HEALTH_CHECK_AFTER,
                notifier: ReleaseNotifier::new(),
                live: tokio::sync::Mutex::new(None),
                generation: AtomicU64::new(0),
                reading: AtomicU64::new(0),
                emptied: None,
            }),
        }
    }

    /// Pings a connection quiet for `after` (default 10 s), and sweeps
    /// unused topics as often.
    pub fn health_check_after(mut self, after: Duration) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.health_check_after = after.max(Duration::from_millis(10));
        }
        self
    }

    /// Unsubscribes a topic on the server as soon as its last waiter
    /// leaves, not at the next sweep. For a source whose every waiter has
    /// a topic of its own (etcd's queue: a watch per waiter): there, idle
    /// topics pile up at the rate waiters come and go, and the server
    /// sends each of them every event of its key until it is swept. Call
    /// before the first [`watch`](Self::watch) and
    /// [`notifier`](Self::notifier).
    pub fn unsubscribe_on_leave(mut self) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            let emptied = Arc::new(Notify::new());
            inner.notifier = ReleaseNotifier::telling_emptied(emptied.clone());
            inner.emptied = Some(emptied);
        }
        self
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.inner.source
    }

    /// The local fan-out, for sources that wake channels themselves.
    pub fn notifier(&self) -> &ReleaseNotifier {
        &self.inner.notifier
    }

    /// Registers a waiter on `topic`; when this returns, the server
    /// subscription is confirmed. An error leaves nothing registered.
    pub async fn watch(&self, topic: S::Topic) -> Result<ReleaseWatch, LockError> {
        self.watch_named(topic, None).await
    }

    /// [`watch`](Self::watch) for a waiter named `waiter`: woken by every
    /// notification of its channel, and alone by a [`Notification`] that
    /// names it (a server that wakes one waiter per release).
    pub async fn watch_as(&self, topic: S::Topic, waiter: &str) -> Result<ReleaseWatch, LockError> {
        self.watch_named(topic, Some(waiter)).await
    }

    async fn watch_named(
        &self,
        topic: S::Topic,
        waiter: Option<&str>,
    ) -> Result<ReleaseWatch, LockError> {
        let inner = &self.inner;
        let channel = inner.source.channel(&topic);
        inner
            .notifier
            .subscribe_as(&channel, waiter, || inner.subscribe(channel.clone(), topic))
            .await
    }
}

impl<S: NotificationSource> Inner<S> {
    async fn subscribe(
        self: &Arc<Self>,
        channel: String,
        topic: S::Topic,
    ) -> Result<(), LockError> {
        let mut live = self.live.lock().await;
        let reading = self.reading.load(Ordering::SeqCst);
        if live
            .as_ref()
            .is_none_or(|l| l.reader.is_finished() || l.generation != reading)
        {
            // Dropped, the dead connection's tasks are aborted.
            *live = None;
            *live = Some(self.connect().await?);
        }
        let Some(current) = live.as_mut() else {
            return Err(LockError::unavailable(
                "release-notification connection missing",
            ));
        };
        // Recorded before the request: if this future is dropped while the
        // subscribe is in flight, the server may still subscribe, and the
        // sweep must unsubscribe the topic once nobody waits on it.
        current.subscribed.insert(channel, topic.clone());
        let sink = current.sink.clone();
        let result = with_timeout(
            self.options.operation_timeout(),
            "subscribing to release notifications",
            self.source.subscribe(&sink, std::slice::from_ref(&topic)),
        )
        .await;
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                // The connection is in an unknown state: the one lost path.
                let generation = current.generation;
                self.lost(&mut live, generation, &e);
                Err(e)
            }
        }
    }

    async fn connect(self: &Arc<Self>) -> Result<Live<S>, LockError> {
        let (sink, stream) = with_timeout(
            self.options.connect_timeout(),
            "connecting for release notifications",
            self.source.connect(),
        )
        .await?;
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.reading.store(generation, Ordering::SeqCst);
        let reader = tokio::spawn(read(
            ReaderExit {
                inner: Arc::downgrade(self),
                generation,
            },
            self.source.clone(),
            sink.clone(),
            stream,
            self.health_check_after,
            self.options.operation_timeout(),
        ));
        let sweeper = self
            .emptied
            .clone()
            .map(|emptied| tokio::spawn(sweep_on_leave(Arc::downgrade(self), emptied, generation)));
        tracing::debug!(generation, "release-notification connection established");
        Ok(Live {
            sink,
            generation,
            subscribed: HashMap::new(),
            reader,
            sweeper,
        })
    }

    /// The connection of `generation` is gone or must be assumed gone:
    /// drop it and make every waiter subscribe again.
    fn lost(&self, live: &mut Option<Live<S>>, generation: u64, why: &LockError) {
        if let Some(current) = live.take_if(|l| l.generation == generation) {
            let _ =
                self.reading
                    .compare_exchange(generation, 0, Ordering::SeqCst, Ordering::SeqCst);
            // Its reader and sweeper are aborted.
            drop(current);
            tracing::debug!(generation, error = %why, "release-notification connection lost; waiters subscribe again");
            self.notifier.reset();
        }
    }

    /// Unsubscribes channels without waiters on connection `generation`
    /// (skipped while a subscribe is in flight: it may need this reader).
    async fn sweep(&self, generation: u64) {
        let Ok(mut live) = self.live.try_lock() else {
            return;
        };
        self.sweep_idle(&mut live, generation).await;
    }

    /// [`sweep`](Self::sweep) with the live connection locked.
    async fn sweep_idle(&self, live: &mut Option<Live<S>>, generation: u64) {
        let Some(current) = live.as_mut().filter(|l| l.generation == generation) else {
            return;
        };
        let (idle, topics): (Vec<String>, Vec<S::Topic>) = current
            .subscribed
            .iter()
            .filter(|(c, _)| !self.notifier.has_waiters(c))
            .map(|(c, t)| (c.clone(), t.clone()))
            .unzip();
        if idle.is_empty() {
            return;
        }
        let sink = current.sink.clone();
        let result = with_timeout(
            self.options.operation_timeout(),
            "unsubscribing idle release notifications",
            self.source.unsubscribe(&sink, &topics),
        )
        .await;
        match result {
            Ok(()) => {
                for channel in &idle {
                    current.subscribed.remove(channel);
                }
            }
            Err(e) => self.lost(live, generation, &e),
        }
    }
}

/// Sweeps connection `generation` each time a channel's last waiter
/// leaves ([`Listener::unsubscribe_on_leave`]). A task of its own, not the
/// reader's: a subscribe in flight holds the connection until the reader
/// delivers its confirmation, so this waits for it instead of skipping.
async fn sweep_on_leave<S: NotificationSource>(
    inner: Weak<Inner<S>>,
    emptied: Arc<Notify>,
    generation: u64,
) {
    loop {
        emptied.notified().await;
        // The leaves of the next moments go in the same sweep: under a
        // crowd a waiter leaves at every handoff, and each sweep takes the
        // connection from the subscribes.
        tokio::time::sleep(SWEEP_GATHERS).await;
        let Some(inner) = inner.upgrade() else { return };
        let mut live = inner.live.lock().await;
        inner.sweep_idle(&mut live, generation).await;
    }
}

/// Reads one connection's notifications until it fails; pings it when it
/// stayed quiet and sweeps idle topics, every `every`.
async fn read<S: NotificationSource>(
    // An argument, not a local: dropped with the future even if it was
    // never polled.
    exit: ReaderExit<S>,
    source: Arc<S>,
    sink: S::Sink,
    mut stream: S::Stream,
    every: Duration,
    operation_timeout: Duration,
) {
    let (weak, generation) = (&exit.inner, exit.generation);
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    let mut heard = Instant::now();
    // Only a weak reference to the listener is held while waiting, so a
    // dropped client aborts this task (and closes the connection).
    let error = loop {
        tokio::select! {
            received = source.next(&mut stream) => match received {
                Some(Ok(notification)) => {
                    heard = Instant::now();
                    let Some(inner) = weak.upgrade() else { return };
                    match &notification.waiter {
                        None => inner.notifier.notify(&notification.channel),
                        Some(waiter) => {
                            if !inner.notifier.notify_waiter(&notification.channel, waiter) {
                                // It left; its backend passes the turn on.
                                tracing::trace!(channel = %notification.channel, %waiter, "wake-up for a waiter that left");
                            }
                        }
                    }
                }
                Some(Err(e)) => break e,
                None => break LockError::unavailable("the server closed the notification connection"),
            },
            _ = tick.tick() => {
                if heard.elapsed() >= every {
                    let ping = with_timeout(
                        operation_timeout,
                        "pinging the release-notification connection",
                        source.ping(&sink, &mut stream),
                    )
                    .await;
                    match ping {
                        Ok(()) => heard = Instant::now(),
                        Err(e) => break e,
                    }
                }
                let Some(inner) = weak.upgrade() else { return };
                inner.sweep(generation).await;
            }
        }
    };
    let Some(inner) = weak.upgrade() else { return };
    let mut live = inner.live.lock().await;
    inner.lost(&mut live, generation, &error);
}

/// Dropped with a reader that ends without the lost path — its runtime
/// shut down (the client lives on in another), or it panicked — and so
/// could not take the live lock: marks its connection dead, so the next
/// subscribe reconnects, and wakes every waiter, so each subscribes again.
/// A no-op after the lost path, which cleared the mark first.
struct ReaderExit<S: NotificationSource> {
    inner: Weak<Inner<S>>,
    generation: u64,
}

impl<S: NotificationSource> Drop for ReaderExit<S> {
    fn drop(&mut self) {
        let Some(inner) = self.inner.upgrade() else {
            return;
        };
        let ended =
            inner
                .reading
                .compare_exchange(self.generation, 0, Ordering::SeqCst, Ordering::SeqCst);
        if ended.is_ok() {
            tracing::debug!(generation = self.generation, "release-notification reader ended (runtime shut down or panic); waiters subscribe again");
            inner.notifier.reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    use tokio::sync::mpsc;

    use super::*;

    /// Notifications from in-process channels, one per connection; its
    /// subscribe can be made to hang, and it records what it unsubscribes.
    #[derive(Default)]
    struct Toy {
        connections: Mutex<Vec<mpsc::UnboundedSender<String>>>,
        hang: AtomicBool,
        unsubscribed: Mutex<Vec<String>>,
    }

    #[async_trait]
    impl NotificationSource for Toy {
        type Topic = String;
        type Sink = ();
        type Stream = mpsc::UnboundedReceiver<String>;
        fn channel(&self, topic: &String) -> String {
            topic.clone()
        }
        async fn connect(&self) -> Result<((), Self::Stream), LockError> {
            let (tx, rx) = mpsc::unbounded_channel();
            self.connections.lock().unwrap().push(tx);
            Ok(((), rx))
        }
        async fn subscribe(&self, _: &(), _: &[String]) -> Result<(), LockError> {
            if self.hang.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
        async fn unsubscribe(&self, _: &(), topics: &[String]) -> Result<(), LockError> {
            let mut unsubscribed = self.unsubscribed.lock().unwrap();
            unsubscribed.extend(topics.iter().cloned());
            Ok(())
        }
        async fn next(&self, stream: &mut Self::Stream) -> Option<Result<Notification, LockError>> {
            stream.recv().await.map(|channel| Ok(channel.into()))
        }
    }

    #[test]
    fn a_reader_whose_runtime_shut_down_wakes_its_waiters_and_is_replaced() {
        let listener = Arc::new(Listener::new(Toy::default(), &ClientOptions::default()));
        // The reader starts on a runtime that will shut down.
        let first = crate::tests::current_thread_runtime();
        first.block_on(async { drop(listener.watch("k".to_owned()).await.unwrap()) });
        let second = crate::tests::one_worker_runtime();
        let waiting = {
            let listener = listener.clone();
            second.spawn(async move {
                let mut watch = listener.watch("k".to_owned()).await?;
                watch.released().await
            })
        };
        while !listener.notifier().has_waiters("k") {
            std::thread::yield_now();
        }
        drop(first);
        second.block_on(async {
            let woken = tokio::time::timeout(Duration::from_secs(10), waiting)
                .await
                .expect("a waiter slept on after its reader died with its runtime")
                .unwrap();
            assert!(woken.is_err(), "woken without an error: {woken:?}");
            // The next waiter gets a new connection, which delivers.
            let mut watch = listener.watch("k".to_owned()).await.unwrap();
            let connections = listener.source().connections.lock().unwrap().clone();
            assert_eq!(connections.len(), 2);
            connections[1].send("k".to_owned()).unwrap();
            tokio::time::timeout(Duration::from_secs(10), watch.released())
                .await
                .expect("the new connection delivers")
                .unwrap();
        });
    }

    /// A watch dropped while its subscribe is in flight: the server may
    /// still subscribe it, so the idle sweep must unsubscribe it.
    #[tokio::test]
    async fn a_watch_dropped_during_its_subscribe_is_swept() {
        let listener = Listener::new(Toy::default(), &ClientOptions::default())
            .health_check_after(Duration::from_millis(10));
        let source = listener.source();
        drop(listener.watch("first".to_owned()).await.unwrap());
        source.hang.store(true, Ordering::SeqCst);
        let dropped = tokio::time::timeout(
            Duration::from_millis(50),
            listener.watch("dropped".to_owned()),
        )
        .await;
        assert!(dropped.is_err(), "the subscribe hangs");
        source.hang.store(false, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let unsubscribed = source.unsubscribed.lock().unwrap().clone();
            if unsubscribed.contains(&"dropped".to_owned()) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the dropped watch's topic was never unsubscribed: {unsubscribed:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether `source` unsubscribed `topic`.
    fn unsubscribed(source: &Toy, topic: &str) -> bool {
        source
            .unsubscribed
            .lock()
            .unwrap()
            .iter()
            .any(|t| t == topic)
    }

    /// Waits (up to 10 s) until `topic` was unsubscribed.
    async fn until_unsubscribed(source: &Toy, topic: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !unsubscribed(source, topic) {
            assert!(
                Instant::now() < deadline,
                "{topic:?} was not unsubscribed when its last waiter left: {:?}",
                source.unsubscribed.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// With `unsubscribe_on_leave`, a topic is unsubscribed when its last
    /// waiter leaves, not at the sweep (an hour away here); a subscribe in
    /// flight holds that up.
    #[tokio::test]
    async fn a_topic_is_unsubscribed_when_its_last_waiter_leaves() {
        let listener = Arc::new(
            Listener::new(Toy::default(), &ClientOptions::default())
                .health_check_after(Duration::from_secs(3600))
                .unsubscribe_on_leave(),
        );
        let source = listener.source();
        let first = listener.watch("a".to_owned()).await.unwrap();
        let second = listener.watch("a".to_owned()).await.unwrap();
        drop(first);
        let b = listener.watch("b".to_owned()).await.unwrap();
        drop(b);
        until_unsubscribed(source, "b").await;
        assert!(
            !unsubscribed(source, "a"),
            "a topic with a waiter left was unsubscribed"
        );
        drop(second);
        until_unsubscribed(source, "a").await;

        // A subscribe hangs, holding the connection, while "c" is left.
        let c = listener.watch("c".to_owned()).await.unwrap();
        source.hang.store(true, Ordering::SeqCst);
        let hanging = {
            let listener = listener.clone();
            tokio::spawn(async move {
                tokio::time::timeout(Duration::from_millis(300), listener.watch("d".to_owned()))
                    .await
                    .is_err()
            })
        };
        while listener.inner.live.try_lock().is_ok() {
            tokio::task::yield_now().await;
        }
        drop(c);
        tokio::task::yield_now().await;
        assert!(
            !unsubscribed(source, "c"),
            "unsubscribed while a subscribe held the connection"
        );
        assert!(hanging.await.unwrap(), "the subscribe hung");
        source.hang.store(false, Ordering::SeqCst);
        until_unsubscribed(source, "c").await;
    }

    /// The topics the listener keeps (to unsubscribe them later).
    async fn known_topics<S: NotificationSource>(listener: &Listener<S>) -> Vec<String> {
        let live = listener.inner.live.lock().await;
        let mut names: Vec<String> = live
            .iter()
            .flat_map(|l| l.subscribed.keys().cloned())
            .collect();
        names.sort();
        names
    }

    /// A topic subscribed on a connection that was lost, whose waiter then
    /// left, is forgotten by a later sweep (it is never unsubscribed: the
    /// connection it was on is gone). Sources whose channels are unique per
    /// waiter (etcd) would otherwise grow the map at every reconnect.
    #[tokio::test]
    async fn topics_of_a_lost_connection_are_forgotten() {
        let listener = Listener::new(Toy::default(), &ClientOptions::default())
            .health_check_after(Duration::from_millis(10));
        let mut lost = listener.watch("lost".to_owned()).await.unwrap();
        // The server ends the connection.
        listener.source().connections.lock().unwrap().clear();
        assert!(lost.released().await.is_err(), "the connection ended");
        drop(lost);
        let _stays = listener.watch("stays".to_owned()).await.unwrap();
        let give_up = Instant::now() + Duration::from_secs(5);
        while known_topics(&listener).await != ["stays"] {
            assert!(
                Instant::now() < give_up,
                "topics still known: {:?}",
                known_topics(&listener).await
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
