//! Server-driven wake-up: one `LISTEN` connection per client, feeding a
//! [`ReleaseNotifier`].
//!
//! Release runs `pg_notify(channel, key)` in the same statement that frees the
//! row, so the notification is delivered when (and only if) the release
//! commits. Each client listens on the one channel of its namespace and table
//! (see [`channel_name`](crate::channel_name)) on a single connection, started
//! when the first waiter subscribes; a background task turns notifications
//! into [`ReleaseNotifier::notify`] calls for the key in the payload. When
//! that connection is lost, the task reconnects, listens again and calls
//! [`ReleaseNotifier::reset`] so every waiter retries (notifications sent
//! meanwhile are lost). A connection that stays silent for 10 s is pinged
//! (bounded by the operation timeout), so a black-holed connection is
//! replaced too. Holders that crash without releasing are covered by the
//! waiters' timers set to the holder's remaining lease.
//!
//! The task runs on the runtime of the call that started it. If it ends
//! anyway — that runtime shut down while the client lives on in another, or
//! it panicked — it wakes every waiter as it goes; the next waiter or
//! acquire attempt starts a new task, which wakes every waiter again once it
//! listens.

use std::sync::Mutex;
use std::time::Duration;

use lock_core::{LockError, LockKey, ReleaseNotifier, ReleaseWatch};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::errors;

/// What the listener task is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// (Re)connecting.
    Connecting,
    /// `LISTEN` is confirmed on the current connection.
    Listening,
    /// The last attempt to connect failed; retrying after a pause.
    Failed(String),
}

/// One client's listener: started lazily, stopped when the client is dropped.
pub(crate) struct Waiters {
    notifier: ReleaseNotifier,
    channel: String,
    connect: PgConnectOptions,
    connect_timeout: Duration,
    operation_timeout: Duration,
    state: watch::Sender<State>,
    task: Mutex<Option<JoinHandle<()>>>,
}

/// How long the listener connection may be silent before it is pinged.
const HEALTH_CHECK_AFTER: Duration = Duration::from_secs(10);

impl Waiters {
    /// `connect` reaches the server; the listener opens its own connection.
    pub(crate) fn new(
        connect: PgConnectOptions,
        channel: String,
        connect_timeout: Duration,
        operation_timeout: Duration,
    ) -> Self {
        Self {
            notifier: ReleaseNotifier::new(),
            channel,
            connect,
            connect_timeout,
            operation_timeout,
            state: watch::channel(State::Connecting).0,
            task: Mutex::new(None),
        }
    }

    /// The LISTEN/NOTIFY channel of this client's namespace and table.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Registers a waiter for `key`; returns once the server listens.
    pub(crate) async fn watch(&self, key: &LockKey) -> Result<ReleaseWatch, LockError> {
        self.notifier
            .subscribe(key.as_str(), || self.ensure_listening())
            .await
    }

    /// Replaces a listener task that ended while waiters wait (see the
    /// module docs). Called before each acquire attempt: the waiters the
    /// ending task woke retry, and their next wait is served by the new task.
    pub(crate) fn revive(&self) {
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if task.as_ref().is_some_and(JoinHandle::is_finished)
            && !self.notifier.channels().is_empty()
        {
            self.start(&mut task);
        }
    }

    /// Starts the listener task unless it is running.
    fn start(&self, task: &mut Option<JoinHandle<()>>) {
        let ended = match task {
            None => false,
            Some(running) if !running.is_finished() => return,
            Some(_) => true,
        };
        if ended {
            tracing::warn!(channel = %self.channel, "the listener for lock releases ended (its runtime shut down, or it panicked); starting a new one");
        }
        // The ended task may have left `Listening` behind.
        self.state.send_replace(State::Connecting);
        *task = Some(tokio::spawn(listen(
            self.connect.clone(),
            self.channel.clone(),
            self.notifier.clone(),
            self.state.clone(),
            self.connect_timeout,
            self.operation_timeout,
            ended,
        )));
    }

    /// Starts the listener task if needed and waits until `LISTEN` is
    /// confirmed, or the connection attempt fails, or the connect timeout.
    async fn ensure_listening(&self) -> Result<(), LockError> {
        let mut rx = self.state.subscribe();
        self.start(&mut self.task.lock().unwrap_or_else(|e| e.into_inner()));
        if *rx.borrow_and_update() == State::Listening {
            return Ok(());
        }
        // Wait for the outcome of the attempt in flight (or the next one).
        let wait = async {
            loop {
                if rx.changed().await.is_err() {
                    return Err(LockError::unavailable(
                        "the PostgreSQL listener for waiters stopped",
                    ));
                }
                match &*rx.borrow_and_update() {
                    State::Listening => return Ok(()),
                    State::Failed(message) => {
                        return Err(LockError::unavailable(format!(
                            "cannot listen for lock releases: {message}"
                        )))
                    }
                    State::Connecting => {}
                }
            }
        };
        let limit = self.connect_timeout * 2;
        lock_core::with_timeout(limit, "listening for lock releases", wait).await
    }
}

impl std::fmt::Debug for Waiters {
    // By hand: the connect options hold the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters")
            .field("channel", &self.channel)
            .field("state", &*self.state.borrow())
            .finish_non_exhaustive()
    }
}

impl Drop for Waiters {
    fn drop(&mut self) {
        if let Some(task) = self.task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}

/// Wakes every waiter when the listener task ends, however it ends (a
/// runtime shutting down drops it; a panic unwinds it): they retry instead
/// of waiting for notifications nobody forwards any more.
struct WakeOnExit(ReleaseNotifier);

impl Drop for WakeOnExit {
    fn drop(&mut self) {
        self.0.reset();
    }
}

/// The listener task: connect, LISTEN, forward notifications; on loss,
/// reconnect with a growing pause and reset the waiters. `replacing` says
/// it replaces a task that ended: it then resets the waiters once it
/// listens, as after a reconnect.
async fn listen(
    connect: PgConnectOptions,
    channel: String,
    notifier: ReleaseNotifier,
    state: watch::Sender<State>,
    connect_timeout: Duration,
    operation_timeout: Duration,
    replacing: bool,
) {
    let _wake_on_exit = WakeOnExit(notifier.clone());
    let mut pause = Duration::from_millis(50);
    let mut connected_before = replacing;
    loop {
        state.send_replace(State::Connecting);
        let attempt = lock_core::with_timeout(connect_timeout, "connecting the listener", async {
            // A new pool of one per connection: a listener dropped after its
            // connection went silent returns that connection in the
            // background (UNLISTEN), which may never finish; it must not
            // hold the slot the next connection needs.
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .acquire_timeout(connect_timeout)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_lazy_with(connect.clone());
            let mut listener = PgListener::connect_with(&pool)
                .await
                .map_err(|e| errors::map(e, "connecting the listener", None, connect_timeout))?;
            listener.ignore_pool_close_event(true);
            listener.eager_reconnect(false);
            listener
                .listen(&channel)
                .await
                .map_err(|e| errors::map(e, "LISTEN", None, connect_timeout))?;
            Ok(listener)
        })
        .await;
        let mut listener = match attempt {
            Ok(listener) => listener,
            Err(e) => {
                tracing::debug!(error = %e, "listener for lock releases cannot connect; retrying");
                state.send_replace(State::Failed(e.to_string()));
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        pause = Duration::from_millis(50);
        state.send_replace(State::Listening);
        tracing::debug!(channel = %channel, "listening for lock releases");
        if connected_before {
            // Releases may have happened while we were not listening.
            notifier.reset();
        }
        connected_before = true;
        loop {
            // After a quiet spell, check the connection is alive: a
            // black-holed connection is otherwise not noticed until TCP gives
            // up, and its waiters would only wake at the holders' expiry.
            let received = match tokio::time::timeout(HEALTH_CHECK_AFTER, listener.try_recv()).await
            {
                Ok(received) => received,
                Err(_) => {
                    // try_recv is cancel-safe (a partly read message stays
                    // buffered); notifications arriving meanwhile are kept.
                    let ping = sqlx::query("SELECT 1").execute(&mut listener);
                    match tokio::time::timeout(operation_timeout, ping).await {
                        Ok(Ok(_)) => continue,
                        _ => {
                            tracing::debug!("listener connection does not answer; reconnecting");
                            break;
                        }
                    }
                }
            };
            match received {
                Ok(Some(notification)) => {
                    tracing::trace!(key = notification.payload(), "release notification");
                    notifier.notify(notification.payload());
                }
                Ok(None) => {
                    tracing::debug!("listener connection lost; reconnecting");
                    break;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "listener failed; reconnecting");
                    break;
                }
            }
        }
        state.send_replace(State::Connecting);
        drop(listener);
        // Wake everyone now: they retry (and fail fast if the server is
        // gone) instead of waiting for a notification that cannot come.
        notifier.reset();
    }
}
