//! Server-driven wake-up: `LISTEN` on one connection per client, through
//! distlock-core's [`Listener`](distlock_core::Listener).
//!
//! A client listens on the channels of its namespace and table (see
//! [`channel_name`](crate::channel_name)): the connection sends `LISTEN`
//! once when it opens, so subscribing a key needs no server round trip
//! afterwards.
//!
//! - On the *next* channel (the namespace's channel and `_next`) a release
//!   wakes the one waiter it took off the key's waiter line: the payload
//!   is that waiter's owner token, `:`, and the key, and only that waiter
//!   is woken ([`Notification::for_waiter`]). Its line row names this
//!   connection's backend pid ([`Releases::pid`], read when it opens), so
//!   a release can tell a waiter whose client is gone.
//! - On the namespace's channel, payload the key, every waiter of the key
//!   is woken: sent by force-release, by a given-back grant, by a release
//!   that found no live waiter in line, and by clients of earlier versions.
//! - On the *holder* channel (the namespace's channel and `_holder`, lock
//!   table only), payload the key, the key's observers
//!   ([`LockAdmin::watch_holder`](distlock_core::LockAdmin::watch_holder))
//!   are woken, and never a waiter: sent by a labelled acquisition that
//!   took the lock, by the release of a labelled lock, by force-release
//!   and by the give-back of a labelled grant. Observers have local
//!   channels of their own ([`Topic::Holder`]), so they take no waiter's
//!   wake-up and no place in a line; a waiter's notifications never reach
//!   them either.
//!
//! Each notification is sent in the statement that changes the row, so it
//! is delivered when (and only if) that commits. A quiet connection is
//! pinged with `SELECT 1`; every failure is the kit's one lost path (the
//! connection is dropped and waiters subscribe again, reconnecting, and
//! join their lines again with the new pid). Holders that crash without
//! releasing are covered by the waiters' timers set to the holder's
//! remaining lease (and the observers' reads at its expiry).

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use distlock_core::{async_trait, LockError, LockKey, Notification, NotificationSource, Unclaimed};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Executor, Row};

use crate::config::TlsSettings;
use crate::errors;
use crate::keys::is_owner_token;
use crate::sql::Statement;

/// What a watch on the listener follows.
#[derive(Debug, Clone)]
pub(crate) enum Topic {
    /// Releases of a key, for its waiters.
    Waiters(LockKey),
    /// Changes of who holds a key, for its observers.
    Holder(LockKey),
}

/// The local channel of `key`'s observers: NUL never is in a key, so it is
/// never a waiter's channel (the key itself).
fn observers_of(key: &str) -> String {
    format!("\0holder:{key}")
}

/// The `LISTEN` connection of one client; see the [module](self) docs.
pub(crate) struct Releases {
    /// Where the connection goes (the pool's server, or `listen_url`).
    connect: PgConnectOptions,
    /// The TLS files `connect` names, read at each connect (see
    /// `TlsSettings::loaded`).
    tls: TlsSettings,
    /// The channel of this client's namespace and table: wakes every
    /// waiter of the key it names.
    channel: String,
    /// The channel that wakes one waiter.
    next: String,
    /// The channel that wakes a key's observers, if this client's table
    /// has holders (locks, not permits).
    holder: Option<String>,
    connect_timeout: Duration,
    /// The backend pid of the current connection (0: not connected yet).
    pid: Arc<AtomicI32>,
    /// What becomes of a wake-up on this connection's own channel for a
    /// waiter that no longer waits here, once set.
    unclaimed: OnceLock<Unclaimed>,
}

impl Releases {
    pub(crate) fn new(
        connect: PgConnectOptions,
        tls: TlsSettings,
        channel: String,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            connect,
            tls,
            next: next_channel(&channel),
            holder: None,
            channel,
            connect_timeout,
            pid: Arc::new(AtomicI32::new(0)),
            unclaimed: OnceLock::new(),
        }
    }

    /// Passes on a wake-up for a waiter that no longer waits here (see
    /// [`Unclaimed`]): a release woke it on this connection's own channel,
    /// because its row in the line names this connection's pid, and a
    /// lock's line then waits out its turn (a permit's lost the wake-up).
    /// Wake-ups on the shared channel are left alone: they may be another
    /// client's waiters'.
    pub(crate) fn pass_on_unclaimed(&self, unclaimed: Unclaimed) {
        let _ = self.unclaimed.set(unclaimed);
    }

    /// The backend pid of the listening connection, once it connected: a
    /// waiter's line row names it (a reconnection reads the new one; the
    /// waiters subscribe again and their next attempt stores it).
    pub(crate) fn pid(&self) -> Option<i32> {
        Some(self.pid.load(Ordering::SeqCst)).filter(|pid| *pid != 0)
    }

    /// The backend pid of the listening connection as it changes (0: not
    /// connected yet), for what runs apart from the listener.
    pub(crate) fn shared_pid(&self) -> Arc<AtomicI32> {
        self.pid.clone()
    }

    /// Also listens on the channel that wakes observers.
    pub(crate) fn with_observers(mut self) -> Self {
        self.holder = Some(holder_channel(&self.channel));
        self
    }

    /// The channel on which a release wakes one waiter.
    pub(crate) fn next(&self) -> &str {
        &self.next
    }
}

/// What [`next_channel`] adds to the namespace channel.
pub(crate) const NEXT_SUFFIX: &str = "_next";

/// What [`holder_channel`] adds to the namespace channel (the lock
/// acquire makes the channel of single wake-ups of it: see
/// `Statements::acquire_queued`).
pub(crate) const HOLDER_SUFFIX: &str = "_holder";

/// The channel that wakes one waiter, for the namespace channel `channel`.
pub(crate) fn next_channel(channel: &str) -> String {
    format!("{channel}{NEXT_SUFFIX}")
}

/// The wake-up channel of the listener with backend pid `pid`, for the
/// channel of single wake-ups `next` (what a release notifies: see
/// `sql::line::woken`).
fn own_next_channel(next: &str, pid: i32) -> String {
    format!("{next}_{pid}")
}

/// Whether `channel` wakes one waiter: the shared channel of single
/// wake-ups `next`, or a listener's own.
fn is_next_channel(next: &str, channel: &str) -> bool {
    channel.strip_prefix(next).is_some_and(|rest| {
        rest.is_empty()
            || rest
                .strip_prefix('_')
                .is_some_and(|pid| pid.parse::<i32>().is_ok())
    })
}

/// The channel that wakes a key's observers, for the namespace channel
/// `channel`.
pub(crate) fn holder_channel(channel: &str) -> String {
    format!("{channel}{HOLDER_SUFFIX}")
}

/// The backend pid of `listener`'s connection, asked with the simple
/// protocol.
async fn backend_pid(listener: &mut PgListener) -> Result<i32, sqlx::Error> {
    let row = listener
        .fetch_one(Statement::Simple("SELECT pg_backend_pid()"))
        .await?;
    row.try_get(0)
}

/// What a notification on the channel that wakes one waiter wakes: the
/// waiter whose owner token leads the payload (`owner:key`); `None` for a
/// payload in another form.
fn one_waiter(payload: &str) -> Option<Notification> {
    let (owner, key) = payload.split_once(':')?;
    is_owner_token(owner).then(|| Notification::for_waiter(key, owner))
}

#[async_trait]
impl NotificationSource for Releases {
    type Topic = Topic;
    type Sink = ();
    type Stream = PgListener;

    fn channel(&self, topic: &Topic) -> String {
        match topic {
            Topic::Waiters(key) => key.as_str().to_owned(),
            Topic::Holder(key) => observers_of(key.as_str()),
        }
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
            .connect_lazy_with(self.tls.loaded(self.connect.clone()).await?);
        let mut listener = PgListener::connect_with(&pool)
            .await
            .map_err(|e| errors::map(e, "connecting the listener"))?;
        // A lost connection ends the stream (the kit reconnects), rather
        // than being reconnected by sqlx behind the kit's back.
        listener.ignore_pool_close_event(true);
        listener.eager_reconnect(false);
        // Before LISTEN, so that LISTEN stays the connection's last query
        // (what an operator sees of it in pg_stat_activity); unprepared, as
        // LISTEN is, so that a pooler's shared server session never meets
        // a prepared statement of this connection's.
        let pid = backend_pid(&mut listener)
            .await
            .map_err(|e| errors::map(e, "reading the listener's backend pid"))?;
        // Its own wake-up channel (a release notifies the first waiter's
        // listener alone), and the shared one, on which releases by
        // clients of earlier versions wake one waiter.
        let own = own_next_channel(&self.next, pid);
        let channels = [
            Some(&self.channel),
            Some(&self.next),
            Some(&own),
            self.holder.as_ref(),
        ];
        listener
            .listen_all(channels.into_iter().flatten().map(String::as_str))
            .await
            .map_err(|e| errors::map(e, "LISTEN"))?;
        self.pid.store(pid, Ordering::SeqCst);
        tracing::debug!(channel = %self.channel, pid, "listening for lock releases");
        Ok(((), listener))
    }

    /// Nothing to send: the connection listens on the namespace's channel
    /// since it opened.
    async fn subscribe(&self, _: &(), _: &[Topic]) -> Result<(), LockError> {
        Ok(())
    }

    async fn next(&self, listener: &mut PgListener) -> Option<Result<Notification, LockError>> {
        loop {
            // try_recv is cancel-safe: a partly read message stays buffered.
            let notification = match listener.try_recv().await {
                Ok(Some(notification)) => notification,
                Ok(None) => return None,
                Err(e) => return Some(Err(errors::map(e, "reading release notifications"))),
            };
            let payload = notification.payload();
            tracing::trace!(
                channel = notification.channel(),
                payload,
                "release notification"
            );
            let channel = notification.channel();
            if self.holder.as_deref() == Some(channel) {
                return Some(Ok(observers_of(payload).into()));
            }
            if !is_next_channel(&self.next, channel) {
                return Some(Ok(payload.to_owned().into()));
            }
            // A payload in another form names no waiter (no client writes
            // one): it wakes nobody.
            if let Some(one) = one_waiter(payload) {
                if let (Some(unclaimed), Some(waiter)) = (self.unclaimed.get(), &one.waiter) {
                    let own = self.pid().map(|pid| own_next_channel(&self.next, pid));
                    if own.as_deref() == Some(channel) {
                        unclaimed.pass_on_if_unclaimed(&one.channel, waiter);
                    }
                }
                return Some(Ok(one));
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_up_channels_are_the_shared_one_and_a_listeners_own() {
        let next = next_channel("distlock_00");
        assert!(is_next_channel(&next, &next));
        assert!(is_next_channel(&next, &own_next_channel(&next, 4242)));
        assert!(!is_next_channel(&next, "distlock_00"));
        assert!(!is_next_channel(&next, &holder_channel("distlock_00")));
        assert!(!is_next_channel(&next, "distlock_00_nextx"));
        // The longest stays within PostgreSQL's 63-byte channel names.
        assert!(own_next_channel(&next_channel(&"d".repeat(25)), i32::MIN).len() <= 63);
    }

    #[test]
    fn a_single_wake_up_names_owner_and_key() {
        let owner = "0123456789abcdef".repeat(2);
        let woken = one_waiter(&format!("{owner}:jobs:a:b")).unwrap();
        assert_eq!(woken, Notification::for_waiter("jobs:a:b", owner.clone()));
        assert_eq!(
            one_waiter(&format!("{owner}:")).unwrap(),
            Notification::for_waiter("", owner)
        );
        assert!(one_waiter("nope:key").is_none());
        assert!(one_waiter("key").is_none());
        assert_eq!(next_channel("distlock_00"), "distlock_00_next");
        assert_eq!(holder_channel("distlock_00"), "distlock_00_holder");
    }

    #[test]
    fn observers_never_share_a_waiters_channel() {
        let source = Releases::new(
            PgConnectOptions::new(),
            TlsSettings::default(),
            "distlock_00".to_owned(),
            Duration::from_secs(1),
        );
        let key = LockKey::new("jobs:a").unwrap();
        let waiters = source.channel(&Topic::Waiters(key.clone()));
        let observers = source.channel(&Topic::Holder(key));
        assert_eq!(waiters, "jobs:a");
        assert_ne!(observers, waiters);
        assert!(LockKey::new(observers).is_err(), "no key names it");
    }
}
