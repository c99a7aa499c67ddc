//! Server-driven wake-up: one shared pub/sub connection per client.
//!
//! A release script publishes on the lock's channel. The first local waiter
//! of a channel subscribes on the shared connection (and waits for the
//! server's confirmation) through [`ReleaseNotifier::subscribe`]; a reader
//! task turns every message into [`ReleaseNotifier::notify`]. When the
//! connection drops, every waiter is woken (a release may have been missed),
//! the channels that still have waiters are subscribed again on a new
//! connection, and the waiters are woken once more. Channels without waiters
//! are unsubscribed by a periodic sweep, which also PINGs the connection so a
//! silently dead one (no FIN) is replaced.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use lock_core::{with_timeout, ClientOptions, LockError, ReleaseNotifier, ReleaseWatch};
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::Mutex;
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
    live: Mutex<Option<Live>>,
    generation: AtomicU64,
}

#[derive(Debug)]
struct Live {
    sink: PubSubSink,
    generation: u64,
    subscribed: HashSet<String>,
    reader: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(live) = self.live.get_mut().take() {
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
                live: Mutex::new(None),
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
                let mut live = inner.live.lock().await;
                inner
                    .subscribe_locked(&mut live, &[channel.to_owned()])
                    .await
            })
            .await
    }
}

impl Inner {
    /// Subscribes `channels` (connecting first if needed); `live` is the
    /// locked connection slot, so subscribes and sweeps never interleave.
    async fn subscribe_locked(
        self: &Arc<Self>,
        live: &mut Option<Live>,
        channels: &[String],
    ) -> Result<(), LockError> {
        if live.as_ref().is_none_or(|l| l.reader.is_finished()) {
            *live = Some(self.connect().await?);
        }
        let Some(current) = live.as_mut() else {
            return Err(LockError::unavailable("redis pub/sub connection missing"));
        };
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
                current.subscribed.extend(channels.iter().cloned());
                tracing::trace!(
                    channels = channels.len(),
                    "subscribed to release notifications"
                );
                Ok(())
            }
            Err(e) => {
                // The connection is in an unknown state: start over next time.
                if let Some(old) = live.take() {
                    old.reader.abort();
                }
                Err(e)
            }
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
        let reader = tokio::spawn(read(Arc::downgrade(self), stream, generation));
        tracing::debug!(generation, "redis pub/sub connection established");
        Ok(Live {
            sink,
            generation,
            subscribed: HashSet::new(),
            reader,
        })
    }

    /// Unsubscribes channels that have no local waiters any more, and
    /// checks the connection with a PING. Returns false if the connection
    /// did not answer.
    async fn sweep(&self, generation: u64) -> bool {
        let mut live = self.live.lock().await;
        let Some(current) = live.as_mut().filter(|l| l.generation == generation) else {
            return true;
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
            tracing::debug!(error = %e, "redis pub/sub connection does not answer");
            return false;
        }
        let idle: Vec<String> = current
            .subscribed
            .iter()
            .filter(|c| !self.notifier.has_waiters(c))
            .cloned()
            .collect();
        if idle.is_empty() {
            return true;
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
            Err(e) => tracing::debug!(error = %e, "unsubscribing idle channels failed"),
        }
        true
    }

    /// After a lost connection: subscribe the channels that still have
    /// waiters on a new connection, retrying with backoff, then wake them.
    ///
    /// Boxed with an explicit `Send` type: it breaks the cycle
    /// connect -> read -> resubscribe -> connect for the compiler.
    fn resubscribe(weak: Weak<Self>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut delay = Duration::from_millis(50);
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let channels = inner.notifier.channels();
                if channels.is_empty() {
                    return;
                }
                let result = {
                    let mut live = inner.live.lock().await;
                    inner.subscribe_locked(&mut live, &channels).await
                };
                match result {
                    Ok(()) => {
                        tracing::debug!(channels = channels.len(), "resubscribed after reconnect");
                        // Releases may have happened while we were away.
                        inner.notifier.reset();
                        return;
                    }
                    Err(e) => tracing::debug!(error = %e, "resubscribing failed; retrying"),
                }
                drop(inner);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        })
    }
}

/// Reads messages of one connection until it ends.
async fn read(weak: Weak<Inner>, mut stream: PubSubStream, generation: u64) {
    let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
    sweep.tick().await;
    loop {
        tokio::select! {
            message = stream.next() => {
                let Some(message) = message else { break };
                let Some(inner) = weak.upgrade() else { return };
                inner.notifier.notify(message.get_channel_name());
            }
            _ = sweep.tick() => {
                let Some(inner) = weak.upgrade() else { return };
                // Sweeping waits for the server's confirmation, which the
                // connection's own driver task reads, not this one.
                if !inner.sweep(generation).await {
                    // A silently dead connection (no FIN, e.g. a network
                    // black hole): treat it as lost.
                    break;
                }
            }
        }
    }
    let Some(inner) = weak.upgrade() else { return };
    {
        let mut live = inner.live.lock().await;
        if live.as_ref().is_some_and(|l| l.generation == generation) {
            *live = None;
        }
    }
    tracing::debug!(generation, "redis pub/sub connection lost; waking waiters");
    inner.notifier.reset();
    drop(inner);
    tokio::spawn(Inner::resubscribe(weak));
}
