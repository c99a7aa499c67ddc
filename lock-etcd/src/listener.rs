//! Release notifications from one etcd watch stream per client, as a
//! [`NotificationSource`] for distlock-core's [`Listener`](distlock_core::Listener).
//!
//! The listener opens the stream on the first waiter, reads it on one task
//! and, on any failure, drops it and wakes every waiter with an error so
//! each subscribes again (see the kit's docs). This file only says how to
//! talk to etcd:
//!
//! - A topic is one etcd watch: a waiter's own channel name and the etcd
//!   key it waits on (its predecessor's queue entry, the lock key, or the
//!   prefix of a semaphore's permits). Every watch starts at the store's
//!   current revision, which etcd reports when it confirms the watch
//!   ([`Topic::confirmed_at`]). A watch from an older revision would be
//!   *unsynced*: etcd serves those from a catch-up loop that runs every
//!   100 ms, so a deletion would reach its waiter up to 100 ms late. The
//!   waiter queue ([`crate::queue`]) reads what changed between its
//!   look-up and that revision itself, and gives every watch a channel of
//!   its own, so one deletion wakes exactly one waiter.
//! - Watch ids are chosen by the client (fresh per stream), so a `created`
//!   confirmation is matched to its subscribe, which returns only once etcd
//!   confirmed the watch.
//! - A `DELETE` event wakes the watch's channel; other events (a value
//!   renewed under the same key) do not, except, for a topic that asks
//!   ([`Topic::creations`]: an observer of who holds a lock), a `PUT` that
//!   created its key, and ([`Topic::rewritten_at`]: a waiter watching the
//!   queue entry ahead of it) a `PUT` that rewrote it.
//! - etcd cancelling a live watch (the revision it lagged behind at was
//!   compacted) is reported as a lost stream: the kit's one lost path
//!   makes every waiter look up its place again and watch from a fresh
//!   revision. A watch refused before it was confirmed (no permission)
//!   fails its subscribe with the reason.
//!
//! etcd-client opens a watch stream only together with a first watch, so
//! each stream starts with a watch on the namespace prefix key itself
//! (`NS/lock/`, which no lock or queue entry ever is); it never fires. A
//! silently dead stream is noticed by the gRPC channel's HTTP/2 keep-alive
//! (the kit's quiet-connection ping is left at its default).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use distlock_core::{LockError, Notification, NotificationSource};
use etcd_client::{EventType, WatchClient, WatchOptions, WatchRequestSender, WatchResponseStream};
use tokio::sync::oneshot;

use crate::errors;

/// The watch id of the prefix-key watch that opens each stream.
const OPENING_WATCH: i64 = 1;

/// One etcd watch a waiter subscribes to.
#[derive(Debug, Clone)]
pub(crate) struct Topic {
    /// The local channel its deletions wake (unique per watch).
    pub(crate) channel: String,
    /// The etcd key watched.
    pub(crate) key: Vec<u8>,
    /// Watch every key below `key` instead (a semaphore's permits).
    pub(crate) prefix: bool,
    /// The store revision etcd confirmed the watch at (set when the
    /// subscribe returns; 0 before): the watch reports what happens after
    /// it.
    pub(crate) confirmed_at: Arc<AtomicI64>,
    /// Wake on the key's creation too, not only its deletion.
    pub(crate) creations: bool,
    /// The revision of the last deletion the watch reported (0: none): a
    /// waiter whose predecessor's entry went in the revision that created
    /// the lock key knows that predecessor took the lock.
    pub(crate) deleted_at: Arc<AtomicI64>,
    /// Wake on a put that rewrites the existing key too (a queue entry
    /// put again as its holder's marker, see [`crate::marker`]), and keep
    /// the revision of the last one here (0: none).
    pub(crate) rewritten_at: Option<Arc<AtomicI64>>,
}

/// How the listener talks to etcd's watch service.
pub(crate) struct EtcdWatches {
    client: WatchClient,
    /// The key of the watch that opens each stream.
    opening_key: Vec<u8>,
}

impl EtcdWatches {
    /// Watches through `client`; `opening_key` is a key inside the
    /// namespace that nothing ever writes.
    pub(crate) fn new(client: WatchClient, opening_key: Vec<u8>) -> Self {
        Self {
            client,
            opening_key,
        }
    }
}

/// One watch stream's request side and its watches, shared by the sink
/// (subscribe, unsubscribe) and the stream (its reader).
pub(crate) struct Conn {
    requests: tokio::sync::Mutex<WatchRequestSender>,
    watches: Mutex<Watches>,
}

struct Watches {
    next_id: i64,
    by_id: HashMap<i64, Watch>,
    by_channel: HashMap<String, i64>,
}

struct Watch {
    channel: String,
    /// See [`Topic::creations`].
    creations: bool,
    /// See [`Topic::deleted_at`].
    deleted_at: Arc<AtomicI64>,
    /// See [`Topic::rewritten_at`].
    rewritten_at: Option<Arc<AtomicI64>>,
    /// The subscribe waiting for etcd's `created` (and the revision it
    /// reports); `None` once confirmed.
    confirm: Option<oneshot::Sender<Result<i64, LockError>>>,
}

impl Conn {
    fn watches(&self) -> MutexGuard<'_, Watches> {
        self.watches.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails every subscribe still waiting for a confirmation: the stream
    /// ended.
    fn fail_pending(&self, why: &LockError) {
        let mut watches = self.watches();
        for watch in watches.by_id.values_mut() {
            if let Some(confirm) = watch.confirm.take() {
                let _ = confirm.send(Err(LockError::new(why.kind(), why.message())));
            }
        }
    }

    /// Handles one response; returns the channel to wake, or an error if a
    /// live watch was lost.
    fn handle(&self, response: &etcd_client::WatchResponse) -> Option<Result<String, LockError>> {
        let id = response.watch_id();
        let mut watches = self.watches();
        if response.canceled() {
            // Ours to forget (a cancel we asked for was forgotten already).
            let watch = watches.by_id.remove(&id)?;
            watches.by_channel.remove(&watch.channel);
            let reason = response.cancel_reason();
            return match watch.confirm {
                Some(confirm) => {
                    let error = if reason.contains("permission denied") {
                        LockError::config(format!(
                            "etcd refused to watch a lock: {reason}; grant the user's role read permission on the lock namespace prefix"
                        ))
                    } else {
                        LockError::unavailable(format!("etcd refused to watch a lock: {reason}"))
                    };
                    let _ = confirm.send(Err(error));
                    None
                }
                None => Some(Err(LockError::unavailable(format!(
                    "etcd cancelled a live lock watch (compact revision {}): {reason}",
                    response.compact_revision()
                )))),
            };
        }
        let watch = watches.by_id.get_mut(&id)?;
        if response.created() {
            if let Some(confirm) = watch.confirm.take() {
                let revision = response.header().map_or(0, |h| h.revision());
                let _ = confirm.send(Ok(revision));
            }
        }
        let rewrite = |event: &etcd_client::Event| {
            matches!(event.event_type(), EventType::Put)
                && event
                    .kv()
                    .is_some_and(|kv| kv.create_revision() != kv.mod_revision())
        };
        let wakes = |event: &etcd_client::Event| match event.event_type() {
            EventType::Delete => true,
            // A put that created the key (its create revision is this
            // put's); a renewal's put rewrites an existing key.
            EventType::Put if rewrite(event) => watch.rewritten_at.is_some(),
            EventType::Put => watch.creations,
        };
        if let Some(rewritten_at) = &watch.rewritten_at {
            keep_latest(response.events(), rewrite, rewritten_at);
        }
        keep_latest(
            response.events(),
            |event| matches!(event.event_type(), EventType::Delete),
            &watch.deleted_at,
        );
        response
            .events()
            .iter()
            .any(wakes)
            .then(|| Ok(watch.channel.clone()))
    }
}

/// Keeps in `at` the revision of the newest of `events` that `which`
/// picks, if it is newer.
fn keep_latest(
    events: &[etcd_client::Event],
    which: impl Fn(&etcd_client::Event) -> bool,
    at: &AtomicI64,
) {
    let newest = events
        .iter()
        .filter(|event| which(event))
        .filter_map(|event| event.kv().map(|kv| kv.mod_revision()))
        .max();
    if let Some(revision) = newest {
        at.fetch_max(revision, Ordering::AcqRel);
    }
}

/// The receiving side of one watch stream.
pub(crate) struct Stream {
    responses: WatchResponseStream,
    conn: Arc<Conn>,
}

/// A watch from the current revision (see the module docs).
fn watch_options(id: i64, prefix: bool) -> WatchOptions {
    let options = WatchOptions::new().with_watch_id(id);
    if prefix {
        options.with_prefix()
    } else {
        options
    }
}

#[async_trait]
impl NotificationSource for EtcdWatches {
    type Topic = Topic;
    type Sink = Arc<Conn>;
    type Stream = Stream;

    fn channel(&self, topic: &Topic) -> String {
        topic.channel.clone()
    }

    async fn connect(&self) -> Result<(Arc<Conn>, Stream), LockError> {
        let mut client = self.client.clone();
        let stream = client
            .watch(
                self.opening_key.clone(),
                Some(watch_options(OPENING_WATCH, false)),
            )
            .await
            .map_err(errors::mapper("etcd watch"))?;
        let (requests, responses) = stream.split();
        let conn = Arc::new(Conn {
            requests: tokio::sync::Mutex::new(requests),
            watches: Mutex::new(Watches {
                next_id: OPENING_WATCH + 1,
                by_id: HashMap::new(),
                by_channel: HashMap::new(),
            }),
        });
        Ok((
            conn.clone(),
            Stream {
                responses,
                conn: conn.clone(),
            },
        ))
    }

    async fn subscribe(&self, conn: &Arc<Conn>, topics: &[Topic]) -> Result<(), LockError> {
        let mut confirmations = Vec::with_capacity(topics.len());
        for topic in topics {
            // Registered before it is sent, so the reader matches the
            // confirmation whenever it comes.
            let (confirm, confirmed) = oneshot::channel();
            let id = {
                let mut watches = conn.watches();
                let id = watches.next_id;
                watches.next_id += 1;
                watches.by_id.insert(
                    id,
                    Watch {
                        channel: topic.channel.clone(),
                        creations: topic.creations,
                        deleted_at: topic.deleted_at.clone(),
                        rewritten_at: topic.rewritten_at.clone(),
                        confirm: Some(confirm),
                    },
                );
                watches.by_channel.insert(topic.channel.clone(), id);
                id
            };
            conn.requests
                .lock()
                .await
                .watch(topic.key.clone(), Some(watch_options(id, topic.prefix)))
                .await
                .map_err(errors::mapper("etcd watch"))?;
            confirmations.push((confirmed, &topic.confirmed_at));
        }
        for (confirmed, confirmed_at) in confirmations {
            let revision = confirmed.await.map_err(|_| {
                LockError::unavailable("the etcd watch stream ended before etcd confirmed a watch")
            })??;
            confirmed_at.store(revision, Ordering::Release);
        }
        Ok(())
    }

    async fn unsubscribe(&self, conn: &Arc<Conn>, topics: &[Topic]) -> Result<(), LockError> {
        let ids: Vec<i64> = {
            let mut watches = conn.watches();
            topics
                .iter()
                .filter_map(|topic| {
                    let id = watches.by_channel.remove(&topic.channel)?;
                    watches.by_id.remove(&id);
                    Some(id)
                })
                .collect()
        };
        let mut requests = conn.requests.lock().await;
        for id in ids {
            requests
                .cancel(id)
                .await
                .map_err(errors::mapper("etcd watch cancel"))?;
        }
        Ok(())
    }

    async fn next(&self, stream: &mut Stream) -> Option<Result<Notification, LockError>> {
        loop {
            let error = match stream.responses.message().await {
                Ok(Some(response)) => match stream.conn.handle(&response) {
                    Some(wake) => return Some(wake.map(Notification::from)),
                    None => continue,
                },
                Ok(None) => LockError::unavailable("etcd closed the watch stream"),
                Err(e) => errors::map(e, "etcd watch stream"),
            };
            stream.conn.fail_pending(&error);
            return Some(Err(error));
        }
    }
}
