//! Server-driven wake-up: one etcd watch stream per client.
//!
//! A background task owns a single gRPC watch stream and multiplexes one etcd
//! watch per channel with local subscribers (etcd watch ids, chosen by the
//! client so creations and replies match). The waiter queue
//! ([`crate::queue`]) gives each waiter its own channel, watching its
//! predecessor's queue entry or the lock key. A `DELETE` event on a watched
//! key wakes that channel's subscribers through the [`ReleaseNotifier`]. A
//! watch is registered (the server confirmed it with a `created` reply)
//! before [`Watcher::subscribe_key`] returns, and may start at a past
//! revision, so a deletion after the caller's read is never missed.
//!
//! Watches whose channel has no subscribers left are cancelled within a second. When
//! the stream breaks (server restart, network), the task reconnects with
//! backoff and re-creates the watches of keys that still have waiters; a
//! watch that was live on the broken stream is re-created from "now", so
//! its waiters are woken once etcd confirmed it (a release may have
//! happened while the stream was down). Each watch wakes its own waiters,
//! so waiters that leave, or new ones that arrive, during the reconnect
//! change nothing for the others.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use etcd_client::{
    EventType, WatchClient, WatchOptions, WatchRequestSender, WatchResponse, WatchResponseStream,
};
use lock_core::{ClientOptions, LockError, ReleaseNotifier, ReleaseWatch};
use tokio::sync::{mpsc, oneshot};

use crate::errors;

/// How often watches without waiters are cancelled.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// First and longest pause between reconnection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

type Reply = oneshot::Sender<Result<(), LockError>>;

struct WatchCommand {
    channel: String,
    key: Vec<u8>,
    /// Revision to watch from (0: from now), so events between a read at
    /// `start_revision - 1` and the watch's creation are not missed.
    start_revision: i64,
    reply: Reply,
}

/// The client side of the watch task: started on first use, in the runtime
/// of the first waiter.
pub(crate) struct Watcher {
    client: WatchClient,
    options: ClientOptions,
    notifier: ReleaseNotifier,
    /// The running task's command queue; replaced if the task stopped
    /// (its runtime shut down) so the client keeps working in another runtime.
    commands: Mutex<Option<mpsc::UnboundedSender<WatchCommand>>>,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("waiting_keys", &self.notifier.channels().len())
            .field(
                "started",
                &self
                    .commands
                    .lock()
                    .map(|c| c.as_ref().is_some_and(|tx| !tx.is_closed()))
                    .unwrap_or(false),
            )
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for WatchCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchCommand")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl Watcher {
    pub(crate) fn new(client: WatchClient, options: ClientOptions) -> Self {
        Self {
            client,
            options,
            notifier: ReleaseNotifier::new(),
            commands: Mutex::new(None),
        }
    }

    /// The command queue of the watch task, started (in the current
    /// runtime) on first use or if the previous task stopped.
    fn commands(&self) -> mpsc::UnboundedSender<WatchCommand> {
        let mut slot = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = slot.as_ref().filter(|tx| !tx.is_closed()) {
            return tx.clone();
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let task = WatchTask {
            client: self.client.clone(),
            options: self.options.clone(),
            notifier: self.notifier.clone(),
            commands: rx,
            entries: HashMap::new(),
            by_id: HashMap::new(),
            next_id: 1,
        };
        if slot.is_some() {
            // Watches of the stopped task are gone; the next waiter of each
            // key must watch again.
            self.notifier.reset();
        }
        tokio::spawn(task.run());
        *slot = Some(tx.clone());
        tx
    }

    /// The registry that wakes this client's waiters.
    pub(crate) fn notifier(&self) -> &ReleaseNotifier {
        &self.notifier
    }

    /// Registers a subscriber on `channel` (a name of the caller's choice,
    /// one etcd watch per channel) for deletions of the etcd key
    /// `etcd_key` from `start_revision` on (0: from now); the etcd watch is
    /// live when this returns.
    pub(crate) async fn subscribe_key(
        &self,
        channel: &str,
        etcd_key: Vec<u8>,
        start_revision: i64,
    ) -> Result<ReleaseWatch, LockError> {
        self.notifier
            .subscribe(channel, || async {
                let (reply, confirmed) = oneshot::channel();
                self.commands()
                    .send(WatchCommand {
                        channel: channel.to_owned(),
                        key: etcd_key,
                        start_revision,
                        reply,
                    })
                    .map_err(|_| LockError::unavailable("the etcd watch task has stopped"))?;
                self.options
                    .timed("etcd watch create", async {
                        confirmed.await.map_err(|_| {
                            LockError::unavailable("the etcd watch task dropped the request")
                        })?
                    })
                    .await
            })
            .await
    }
}

/// One etcd watch, for one channel (lock key) with local waiters.
struct Entry {
    key: Vec<u8>,
    id: i64,
    /// Revision the first creation watches from (0 once created: a
    /// re-created watch starts from now and its waiters are woken).
    start_revision: i64,
    created: bool,
    /// Wake the channel's waiters once this watch is confirmed: it was
    /// live before and is re-created from now, so a deletion in between
    /// may have been missed.
    wake_on_create: bool,
    /// Subscribers waiting for the `created` confirmation.
    pending: Vec<Reply>,
}

struct WatchTask {
    client: WatchClient,
    options: ClientOptions,
    notifier: ReleaseNotifier,
    commands: mpsc::UnboundedReceiver<WatchCommand>,
    entries: HashMap<String, Entry>,
    by_id: HashMap<i64, String>,
    next_id: i64,
}

enum Exit {
    /// The client was dropped: stop.
    Dropped,
    /// No watches left: close the stream until the next waiter.
    Idle,
    /// The stream failed: reconnect.
    Broken(LockError),
}

struct Stream {
    sender: WatchRequestSender,
    responses: WatchResponseStream,
}

impl WatchTask {
    async fn run(mut self) {
        let mut backoff = BACKOFF_MIN;
        loop {
            self.sweep();
            if self.entries.is_empty() {
                // Idle: no stream until someone waits.
                match self.commands.recv().await {
                    Some(command) => {
                        self.add(command);
                    }
                    None => return,
                }
                continue;
            }
            match self.open().await {
                Ok(stream) => {
                    backoff = BACKOFF_MIN;
                    match self.serve(stream).await {
                        Exit::Dropped => return,
                        Exit::Idle => {}
                        Exit::Broken(e) => {
                            tracing::debug!(error = %e, "etcd watch stream broke; reconnecting");
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot open the etcd watch stream; retrying");
                    // Subscribers wait under their own timeout; fail them
                    // now with the reason instead.
                    for entry in self.entries.values_mut() {
                        for reply in entry.pending.drain(..) {
                            let _ = reply.send(Err(LockError::unavailable(format!(
                                "cannot watch the lock in etcd: {e}"
                            ))));
                        }
                    }
                    let sleep = tokio::time::sleep(backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    tokio::pin!(sleep);
                    loop {
                        tokio::select! {
                            _ = &mut sleep => break,
                            command = self.commands.recv() => match command {
                                Some(command) => {
                                    self.add(command);
                                }
                                None => return,
                            },
                        }
                    }
                }
            }
        }
    }

    fn fresh_id(&mut self) -> i64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Records a subscription; the watch is sent on the stream by the caller.
    /// Returns the id to create, if a new server watch is needed.
    fn add(&mut self, command: WatchCommand) -> Option<i64> {
        if let Some(entry) = self.entries.get_mut(&command.channel) {
            if entry.created {
                let _ = command.reply.send(Ok(()));
            } else {
                entry.pending.push(command.reply);
            }
            return None;
        }
        let id = self.fresh_id();
        self.by_id.insert(id, command.channel.clone());
        self.entries.insert(
            command.channel,
            Entry {
                key: command.key,
                id,
                start_revision: command.start_revision,
                created: false,
                wake_on_create: false,
                pending: vec![command.reply],
            },
        );
        Some(id)
    }

    /// Forgets entries whose channel has no local waiters and nobody waiting
    /// for creation; returns their watch ids (to cancel on the server).
    fn sweep(&mut self) -> Vec<i64> {
        let notifier = &self.notifier;
        let mut gone = Vec::new();
        self.entries.retain(|channel, entry| {
            entry.pending.retain(|reply| !reply.is_closed());
            let keep = !entry.pending.is_empty() || notifier.has_waiters(channel);
            if !keep {
                gone.push(entry.id);
            }
            keep
        });
        for id in &gone {
            self.by_id.remove(id);
        }
        gone
    }

    fn watch_options(id: i64, start_revision: i64) -> WatchOptions {
        let options = WatchOptions::new().with_watch_id(id);
        if start_revision > 0 {
            options.with_start_revision(start_revision)
        } else {
            options
        }
    }

    /// Opens the stream and (re-)creates every entry's watch on it.
    async fn open(&mut self) -> Result<Stream, LockError> {
        // Fresh ids: the old stream's ids mean nothing on the new one.
        self.by_id.clear();
        let channels: Vec<String> = self.entries.keys().cloned().collect();
        for channel in &channels {
            let id = self.fresh_id();
            self.by_id.insert(id, channel.clone());
            if let Some(entry) = self.entries.get_mut(channel) {
                entry.id = id;
                // A watch confirmed on the old stream starts from now on
                // this one; one never confirmed keeps its start revision
                // and misses nothing.
                entry.wake_on_create |= entry.created;
                entry.created = false;
            }
        }
        let mut requests = channels.iter().filter_map(|c| {
            self.entries
                .get(c)
                .map(|e| (e.key.clone(), Self::watch_options(e.id, e.start_revision)))
        });
        let Some((first_key, first_options)) = requests.next() else {
            return Err(LockError::unavailable("nothing to watch"));
        };
        let rest: Vec<_> = requests.collect();
        let mut client = self.client.clone();
        let stream =
            lock_core::with_timeout(self.options.connect_timeout, "etcd watch stream", async {
                client
                    .watch(first_key, Some(first_options))
                    .await
                    .map_err(errors::mapper("etcd watch"))
            })
            .await?;
        let (mut sender, responses) = stream.split();
        for (key, options) in rest {
            sender
                .watch(key, Some(options))
                .await
                .map_err(errors::mapper("etcd watch"))?;
        }
        Ok(Stream { sender, responses })
    }

    /// Runs the stream until it breaks, has nothing left to watch, or the
    /// client is dropped.
    async fn serve(&mut self, stream: Stream) -> Exit {
        match self.serve_inner(stream).await {
            Ok(exit) => exit,
            Err(e) => Exit::Broken(e),
        }
    }

    async fn serve_inner(&mut self, mut stream: Stream) -> Result<Exit, LockError> {
        let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = self.commands.recv() => {
                    let Some(command) = command else { return Ok(Exit::Dropped) };
                    let key = command.key.clone();
                    let start_revision = command.start_revision;
                    if let Some(id) = self.add(command) {
                        stream
                            .sender
                            .watch(key, Some(Self::watch_options(id, start_revision)))
                            .await
                            .map_err(errors::mapper("etcd watch"))?;
                    }
                }
                message = stream.responses.message() => {
                    match message.map_err(errors::mapper("etcd watch stream"))? {
                        Some(response) => {
                            if let Some((key, id)) = self.handle(response) {
                                stream
                                    .sender
                                    .watch(key, Some(Self::watch_options(id, 0)))
                                    .await
                                    .map_err(errors::mapper("etcd watch"))?;
                            }
                        }
                        None => return Err(LockError::unavailable("etcd closed the watch stream")),
                    }
                }
                _ = sweep.tick() => {
                    for id in self.sweep() {
                        stream.sender.cancel(id).await.map_err(errors::mapper("etcd watch cancel"))?;
                    }
                    if self.entries.is_empty() {
                        // Close the stream; the run loop idles until the next waiter.
                        return Ok(Exit::Idle);
                    }
                }
            }
        }
    }

    /// Handles one response; returns a watch to create again (a live watch
    /// etcd cancelled, e.g. after a compaction) as `(key, new id)`.
    fn handle(&mut self, response: WatchResponse) -> Option<(Vec<u8>, i64)> {
        let id = response.watch_id();
        let Some(channel) = self.by_id.get(&id).cloned() else {
            // A cancelled watch's late events, or a progress notification.
            return None;
        };
        if response.canceled() {
            let reason = response.cancel_reason().to_owned();
            tracing::debug!(channel = %channel, reason = %reason, "etcd cancelled a lock watch");
            self.by_id.remove(&id);
            let entry = self.entries.remove(&channel)?;
            if entry.created && !reason.contains("permission denied") {
                // Its waiters still rely on it: watch again (from now) and
                // wake them once it is live, as a release may have been missed.
                let new_id = self.fresh_id();
                self.by_id.insert(new_id, channel.clone());
                let key = entry.key.clone();
                self.entries.insert(
                    channel,
                    Entry {
                        id: new_id,
                        start_revision: 0,
                        created: false,
                        wake_on_create: true,
                        ..entry
                    },
                );
                return Some((key, new_id));
            }
            let error = if reason.contains("permission denied") {
                LockError::config(format!(
                    "etcd refused to watch the lock {channel:?}: {reason}; grant the user's role read permission on the lock namespace prefix"
                ))
            } else {
                LockError::unavailable(format!(
                    "etcd cancelled the watch of lock {channel:?}: {reason}"
                ))
            };
            for reply in entry.pending {
                let _ = reply.send(Err(LockError::new(error.kind(), error.message())));
            }
            if entry.created || entry.wake_on_create {
                // Waiters relied on this watch (live now, or before a
                // reconnect) and can no longer: wake them so they retry,
                // and let the next waiter watch again.
                self.notifier.reset();
            }
            return None;
        }
        if response.created() {
            if let Some(entry) = self.entries.get_mut(&channel) {
                if !entry.created {
                    entry.created = true;
                    entry.start_revision = 0;
                    for reply in entry.pending.drain(..) {
                        let _ = reply.send(Ok(()));
                    }
                    if std::mem::take(&mut entry.wake_on_create) {
                        tracing::trace!(channel = %channel, "etcd watch re-created; waking its waiters");
                        self.notifier.notify(&channel);
                    }
                }
            }
        }
        let released = response
            .events()
            .iter()
            .any(|event| event.event_type() == EventType::Delete);
        if released {
            tracing::trace!(channel = %channel, "etcd reported a lock key deleted");
            self.notifier.notify(&channel);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use conformance_tests::server::{self, ServerHandle};

    use super::*;

    /// Issue 12, suspected item: after a reconnect, a waiter that leaves
    /// before etcd confirmed its re-created watch must not keep the other
    /// waiters from being woken (a release may have been missed while the
    /// stream was down).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_leaving_during_a_reconnect_does_not_stop_the_wake_up() {
        let server = ServerHandle::from_env_or_start(Arc::new(server::Etcd)).expect("etcd");
        let url = server.url();
        let endpoint = url.trim_start_matches("etcd://").to_owned();
        let client = etcd_client::Client::connect([endpoint], None)
            .await
            .expect("etcd client");
        let notifier = ReleaseNotifier::new();
        let (_commands, rx) = mpsc::unbounded_channel();
        let mut task = WatchTask {
            client: client.watch_client(),
            options: ClientOptions::default(),
            notifier: notifier.clone(),
            commands: rx,
            entries: HashMap::new(),
            by_id: HashMap::new(),
            next_id: 1,
        };
        let mut stays = notifier
            .subscribe("stays", || async { Ok(()) })
            .await
            .expect("subscribe");
        let leaves = notifier
            .subscribe("leaves", || async { Ok(()) })
            .await
            .expect("subscribe");
        // Both watches were live on a stream that broke.
        for channel in ["stays", "leaves"] {
            let (reply, _) = oneshot::channel();
            task.add(WatchCommand {
                channel: channel.to_owned(),
                key: format!("reconnect-test/{channel}").into_bytes(),
                start_revision: 0,
                reply,
            });
            let entry = task.entries.get_mut(channel).expect("entry");
            entry.created = true;
            entry.pending.clear();
        }
        // The reconnect re-creates both watches; one waiter leaves before
        // etcd confirmed its watch, and is swept.
        let stream = task.open().await.expect("open the watch stream");
        drop(leaves);
        task.sweep();
        let serve = tokio::spawn(async move {
            task.serve(stream).await;
        });
        let woken = tokio::time::timeout(Duration::from_secs(10), stays.released()).await;
        serve.abort();
        assert!(
            woken.is_ok(),
            "the remaining waiter was not woken after the reconnect"
        );
    }
}
