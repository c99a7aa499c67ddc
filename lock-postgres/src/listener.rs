//! Server-driven wake-up: `LISTEN` on one connection per client, through
//! distlock-core's [`Listener`](distlock_core::Listener).
//!
//! Release runs `pg_notify(channel, key)` in the same statement that frees
//! the row, so the notification is delivered when (and only if) the release
//! commits. A client listens on the one channel of its namespace and table
//! (see [`channel_name`](crate::channel_name)): the connection sends
//! `LISTEN` once when it opens, and each notification's payload, the user
//! key, names the local channel to wake. So subscribing a key needs no
//! server round trip once the connection listens. A quiet connection is
//! pinged with `SELECT 1`; every failure is the kit's one lost path (the
//! connection is dropped and waiters subscribe again, reconnecting). Holders
//! that crash without releasing are covered by the waiters' timers set to
//! the holder's remaining lease.

use std::time::Duration;

use distlock_core::{async_trait, LockError, LockKey, Notification, NotificationSource};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};

use crate::errors;

/// The `LISTEN` connection of one client; see the [module](self) docs.
pub(crate) struct Releases {
    /// Where the connection goes (the pool's server, or `listen_url`).
    connect: PgConnectOptions,
    /// The channel of this client's namespace and table.
    channel: String,
    connect_timeout: Duration,
}

impl Releases {
    pub(crate) fn new(
        connect: PgConnectOptions,
        channel: String,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            connect,
            channel,
            connect_timeout,
        }
    }
}

#[async_trait]
impl NotificationSource for Releases {
    type Topic = LockKey;
    type Sink = ();
    type Stream = PgListener;

    fn channel(&self, key: &LockKey) -> String {
        key.as_str().to_owned()
    }

    async fn connect(&self) -> Result<((), PgListener), LockError> {
        // A new pool of one per connection: a listener dropped after its
        // connection went silent returns that connection in the background
        // (UNLISTEN), which may never finish; it must not hold the slot the
        // next connection needs.
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(self.connect_timeout)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_lazy_with(self.connect.clone());
        let mut listener = PgListener::connect_with(&pool)
            .await
            .map_err(|e| errors::map(e, "connecting the listener"))?;
        // A lost connection ends the stream (the kit reconnects), rather
        // than being reconnected by sqlx behind the kit's back.
        listener.ignore_pool_close_event(true);
        listener.eager_reconnect(false);
        listener
            .listen(&self.channel)
            .await
            .map_err(|e| errors::map(e, "LISTEN"))?;
        tracing::debug!(channel = %self.channel, "listening for lock releases");
        Ok(((), listener))
    }

    /// Nothing to send: the connection listens on the namespace's channel
    /// since it opened.
    async fn subscribe(&self, _: &(), _: &[LockKey]) -> Result<(), LockError> {
        Ok(())
    }

    async fn next(&self, listener: &mut PgListener) -> Option<Result<Notification, LockError>> {
        // try_recv is cancel-safe: a partly read message stays buffered.
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                tracing::trace!(key = notification.payload(), "release notification");
                Some(Ok(notification.payload().to_owned().into()))
            }
            Ok(None) => None,
            Err(e) => Some(Err(errors::map(e, "reading release notifications"))),
        }
    }

    async fn ping(&self, _: &(), listener: &mut PgListener) -> Result<(), LockError> {
        // Notifications arriving meanwhile are buffered by the listener.
        sqlx::query("SELECT 1")
            .execute(listener)
            .await
            .map(|_| ())
            .map_err(|e| errors::map(e, "pinging the listener"))
    }
}
