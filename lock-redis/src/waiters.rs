//! Server-driven wake-up: one shared pub/sub connection per client.
//!
//! A release script publishes on the lock's channel. The first local waiter
//! of a channel subscribes on the shared connection (and waits for the
//! server's confirmation) through [`ReleaseNotifier::subscribe`]; a reader
//! task turns every message into [`ReleaseNotifier::notify`]. Channels
//! without waiters are unsubscribed by a periodic sweep, which also PINGs the
//! connection so a silently dead one (no FIN) is replaced.
//!
//! A connection is lost when its stream ends, or when any request on it
//! (SUBSCRIBE, UNSUBSCRIBE, PING) fails or times out: its state on the server
//! is then unknown. Whatever noticed it, [`Inner::connection_lost`] is the
//! one path that follows: the connection is closed, every waiter is woken (a
//! release may have been missed), and one resubscribe task subscribes the
//! channels that still have waiters on a new connection, retrying with
//! backoff, then wakes the waiters once more.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use lock_core::{with_timeout, ClientOptions, LockError, ReleaseNotifier, ReleaseWatch};
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{oneshot, Mutex};
use tokio::task::JoinHandle;

use crate::errors;

/// How often channels without local waiters are unsubscribed.
const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// The shared subscription connection of one [`RedisLock`](crate::RedisLock).
#[derive(Debug)]
pub(crate) struct Waiters {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: redis::Client,
    options: ClientOptions,
    notifier: ReleaseNotifier,
    slot: Mutex<Slot>,
    generation: AtomicU64,
}

/// The connection and its bookkeeping; one lock, so subscribes, sweeps and
/// loss handling never interleave.
#[derive(Debug, Default)]
struct Slot {
    live: Option<Live>,
    /// A resubscribe task is running (at most one at a time).
    resubscribing: bool,
}

#[derive(Debug)]
struct Live {
    sink: PubSubSink,
    generation: u64,
    subscribed: HashSet<String>,
    reader: JoinHandle<()>,
    /// Dropping it (with the `Live`) ends the reader, which owns the stream
    /// half: only then does the driver close the connection.
    _stop: oneshot::Sender<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(live) = self.slot.get_mut().live.take() {
            live.reader.abort();
        }
    }
}

impl Waiters {
    /// Waiters that subscribe through `client` (connected lazily).
    pub(crate) fn new(client: redis::Client, options: ClientOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                client,
                options,
                notifier: ReleaseNotifier::new(),
                slot: Mutex::new(Slot::default()),
                generation: AtomicU64::new(0),
            }),
        }
    }

    /// Registers a waiter on `channel`; subscribed on the server when this
    /// returns.
    pub(crate) async fn watch(&self, channel: &str) -> Result<ReleaseWatch, LockError> {
        let inner = &self.inner;
        inner
            .notifier
            .subscribe(channel, || async {
                let mut slot = inner.slot.lock().await;
                inner
                    .subscribe_locked(&mut slot, &[channel.to_owned()])
                    .await
            })
            .await
    }
}

impl Inner {
    /// Subscribes `channels` (connecting first if needed) while holding the
    /// slot. A failed SUBSCRIBE loses the connection.
    async fn subscribe_locked(
        self: &Arc<Self>,
        slot: &mut Slot,
        channels: &[String],
    ) -> Result<(), LockError> {
        if let Some(finished) = slot.live.as_ref().filter(|l| l.reader.is_finished()) {
            let generation = finished.generation;
            self.connection_lost(slot, generation);
        }
        if slot.live.is_none() {
            slot.live = Some(self.connect().await?);
        }
        let Some(current) = slot.live.as_mut() else {
            return Err(LockError::unavailable("redis pub/sub connection missing"));
        };
        let generation = current.generation;
        // Recorded before the request: if this future is dropped while the
        // SUBSCRIBE is in flight, the server still subscribes, and the sweep
        // must know to unsubscribe the channel once nobody waits on it.
        current.subscribed.extend(channels.iter().cloned());
        let mut sink = current.sink.clone();
        let channels_owned = channels.to_vec();
        let result = self
            .options
            .timed("redis SUBSCRIBE", async move {
                sink.subscribe(channels_owned)
                    .await
                    .map_err(|e| errors::map(e, "redis SUBSCRIBE"))
            })
            .await;
        match result {
            Ok(()) => {
                tracing::trace!(
                    channels = channels.len(),
                    "subscribed to release notifications"
                );
                Ok(())
            }
            Err(e) => {
                tracing::debug!(error = %e, "redis SUBSCRIBE failed");
                self.connection_lost(slot, generation);
                Err(e)
            }
        }
    }

    /// The one path for a lost connection, whatever noticed it: forgets
    /// connection `generation` (closing it), wakes every waiter and makes sure
    /// a resubscribe task runs. Does nothing if that connection was already
    /// replaced (its loss was handled then).
    fn connection_lost(self: &Arc<Self>, slot: &mut Slot, generation: u64) {
        if slot.live.as_ref().map(|l| l.generation) != Some(generation) {
            return;
        }
        slot.live = None;
        tracing::debug!(generation, "redis pub/sub connection lost; waking waiters");
        // Releases may have been missed; and the next waiter of each channel
        // must subscribe again rather than trust the old subscription.
        self.notifier.reset();
        if !slot.resubscribing {
            slot.resubscribing = true;
            tokio::spawn(Self::resubscribe(Arc::downgrade(self)));
        }
    }

    async fn connect(self: &Arc<Self>) -> Result<Live, LockError> {
        let pubsub = with_timeout(
            self.options.connect_timeout,
            "connecting the redis pub/sub connection",
            async {
                self.client
                    .get_async_pubsub()
                    .await
                    .map_err(|e| errors::map(e, "connecting the redis pub/sub connection"))
            },
        )
        .await?;
        let (sink, stream) = pubsub.split();
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let (stop, stopped) = oneshot::channel();
        let reader = tokio::spawn(read(Arc::downgrade(self), stream, stopped, generation));
        tracing::debug!(generation, "redis pub/sub connection established");
        Ok(Live {
            sink,
            generation,
            subscribed: HashSet::new(),
            reader,
            _stop: stop,
        })
    }

    /// Unsubscribes channels that have no local waiters any more, and
    /// checks the connection with a PING. A failed request loses the
    /// connection.
    async fn sweep(self: &Arc<Self>, generation: u64) {
        let mut slot = self.slot.lock().await;
        let Some(current) = slot.live.as_mut().filter(|l| l.generation == generation) else {
            return;
        };
        let mut sink = current.sink.clone();
        let ping = self
            .options
            .timed("redis pub/sub PING", async move {
                sink.ping::<redis::Value>()
                    .await
                    .map_err(|e| errors::map(e, "redis pub/sub PING"))
            })
            .await;
        if let Err(e) = ping {
            // Also a silently dead connection (no FIN, a network black hole).
            tracing::debug!(error = %e, "redis pub/sub connection does not answer");
            self.connection_lost(&mut slot, generation);
            return;
        }
        let idle: Vec<String> = current
            .subscribed
            .iter()
            .filter(|c| !self.notifier.has_waiters(c))
            .cloned()
            .collect();
        if idle.is_empty() {
            return;
        }
        let mut sink = current.sink.clone();
        let request = idle.clone();
        let result = self
            .options
            .timed("redis UNSUBSCRIBE", async move {
                sink.unsubscribe(request)
                    .await
                    .map_err(|e| errors::map(e, "redis UNSUBSCRIBE"))
            })
            .await;
        match result {
            Ok(()) => {
                for channel in &idle {
                    current.subscribed.remove(channel);
                }
                tracing::trace!(channels = idle.len(), "unsubscribed idle channels");
            }
            Err(e) => {
                tracing::debug!(error = %e, "unsubscribing idle channels failed");
                self.connection_lost(&mut slot, generation);
            }
        }
    }

    /// After a lost connection: subscribe the channels that still have
    /// waiters on a new connection, retrying with backoff, then wake them.
    /// Started only by [`connection_lost`](Self::connection_lost), which
    /// starts no second one while this runs; a loss during a round is seen
    /// by that round (its SUBSCRIBE fails) or, once `resubscribing` is
    /// cleared, starts a new task.
    ///
    /// Boxed with an explicit `Send` type: it breaks the cycle
    /// connect -> read -> connection_lost -> resubscribe -> connect for the
    /// compiler.
    fn resubscribe(weak: Weak<Self>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut delay = Duration::from_millis(50);
            loop {
                let Some(inner) = weak.upgrade() else { return };
                {
                    let mut slot = inner.slot.lock().await;
                    let channels = inner.notifier.channels();
                    if channels.is_empty() {
                        slot.resubscribing = false;
                        return;
                    }
                    match inner.subscribe_locked(&mut slot, &channels).await {
                        Ok(()) => {
                            slot.resubscribing = false;
                            drop(slot);
                            tracing::debug!(
                                channels = channels.len(),
                                "resubscribed after a lost connection"
                            );
                            // Releases may have happened while we were away.
                            inner.notifier.reset();
                            return;
                        }
                        Err(e) => tracing::debug!(error = %e, "resubscribing failed; retrying"),
                    }
                }
                drop(inner);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        })
    }
}

/// Reads messages of one connection until it ends or its `Live` is dropped.
async fn read(
    weak: Weak<Inner>,
    mut stream: PubSubStream,
    mut stopped: oneshot::Receiver<()>,
    generation: u64,
) {
    let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
    sweep.tick().await;
    loop {
        tokio::select! {
            // The connection was replaced; whoever did it handled the loss.
            _ = &mut stopped => return,
            message = stream.next() => {
                let Some(message) = message else { break };
                let Some(inner) = weak.upgrade() else { return };
                inner.notifier.notify(message.get_channel_name());
            }
            _ = sweep.tick() => {
                let Some(inner) = weak.upgrade() else { return };
                // Sweeping waits for the server's confirmation, which the
                // connection's own driver task reads, not this one.
                inner.sweep(generation).await;
            }
        }
    }
    let Some(inner) = weak.upgrade() else { return };
    let mut slot = inner.slot.lock().await;
    inner.connection_lost(&mut slot, generation);
}
