//! Server-driven wake-up: the pub/sub connection as a
//! [`NotificationSource`], driven by [`distlock_core::Listener`].
//!
//! A release script publishes the owner token of the waiter it wakes on
//! that waiter's client's channel (`NS:{K'}:released:<client>`, see
//! [`crate::waiters`]); the message wakes that waiter alone.
//! The listener opens one pub/sub connection per client on the first wait,
//! subscribes a channel when its first local waiter arrives (confirmed
//! before the waiter's first attempt), wakes the channel's waiters on each
//! message, PINGs a quiet connection, unsubscribes idle channels, and on any
//! failure drops the connection so every waiter subscribes again.
//!
//! - One server: `SUBSCRIBE` on a pub/sub connection to it.
//! - Sentinel: the same, on the primary the sentinels name when the
//!   connection opens (a failover ends the connection: the old primary
//!   dies, or Sentinel disconnects its clients when it demotes it).
//! - Cluster: sharded pub/sub. The release script `SPUBLISH`es in the
//!   lock's slot (the channel carries the lock's hash tag), and a waiter
//!   `SSUBSCRIBE`s on the node that serves that slot, through a RESP3
//!   cluster connection whose pushes arrive on a channel. A node's
//!   connection dropping, or a node ending a subscription itself (its slot
//!   moved), is the listener's one lost path.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};

use distlock_core::{
    async_trait, ClientOptions, LockError, Notification, NotificationSource, Unclaimed,
};
use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::mpsc;

use crate::config::ClusterServer;
use crate::connection::cluster_client;
use crate::errors;
use crate::sentinel::SentinelPrimary;
use crate::tls::Certificates;

/// Where pub/sub connections go.
pub(crate) enum PubSub {
    /// One server, through this client.
    Node(redis::Client),
    /// The current primary of a Sentinel group.
    Sentinel(Arc<SentinelPrimary>),
    /// A Redis Cluster.
    Cluster(ClusterPubSub),
}

/// How to open a cluster pub/sub connection.
pub(crate) struct ClusterPubSub {
    pub(crate) server: ClusterServer,
    pub(crate) certificates: Certificates,
    pub(crate) options: ClientOptions,
}

/// The sending side of a pub/sub connection.
#[derive(Clone)]
pub(crate) enum Sink {
    /// A RESP2 pub/sub connection to one server.
    Node(PubSubSink),
    /// A RESP3 cluster connection, and the channels this client is
    /// unsubscribing (their `sunsubscribe` pushes are expected).
    Cluster(ClusterConnection, Arc<Mutex<HashSet<String>>>),
}

/// The receiving side of a pub/sub connection.
pub(crate) enum Stream {
    /// Messages of a pub/sub connection to one server; for a Sentinel
    /// primary, also which command connection goes to the same server.
    Node(PubSubStream, Option<Primary>),
    /// The cluster connection's pushes.
    Cluster(
        mpsc::UnboundedReceiver<PushInfo>,
        Arc<Mutex<HashSet<String>>>,
    ),
}

/// A Sentinel primary and the generation of its command connection.
pub(crate) struct Primary {
    primary: Arc<SentinelPrimary>,
    generation: u64,
}

impl Primary {
    /// The pub/sub connection found the server gone: so is the command
    /// connection to it, and the next request asks the sentinels (rather
    /// than fail once on a dead connection).
    fn gone(&self) {
        self.primary.forget(self.generation);
    }
}

impl PubSub {
    async fn open_node(
        client: &redis::Client,
        primary: Option<Primary>,
    ) -> Result<(Sink, Stream), LockError> {
        let what = "connecting the redis pub/sub connection";
        let pubsub = match client.get_async_pubsub().await {
            Ok(pubsub) => pubsub,
            Err(e) => {
                if let Some(primary) = &primary {
                    primary.gone();
                }
                return Err(errors::map(e, what));
            }
        };
        let (sink, stream) = pubsub.split();
        Ok((Sink::Node(sink), Stream::Node(stream, primary)))
    }
}

impl ClusterPubSub {
    async fn open(&self) -> Result<(Sink, Stream), LockError> {
        let what = "connecting the redis cluster pub/sub connection";
        let (tx, rx) = mpsc::unbounded_channel();
        let client = cluster_client(&self.server, &self.certificates, &self.options, Some(tx))
            .map_err(|e| errors::map(e, what))?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| errors::map(e, what))?;
        let expected = Arc::new(Mutex::new(HashSet::new()));
        Ok((
            Sink::Cluster(conn, expected.clone()),
            Stream::Cluster(rx, expected),
        ))
    }
}

/// The client's notification source: its pub/sub connections, and what
/// becomes of a wake-up that reaches no waiter here: a lock's line keeps
/// the woken waiter first with a turn, a semaphore's took it off the line
/// (the wake-up lost), so the listener leaves the line for a waiter that
/// no longer waits (see [`Unclaimed`]).
pub(crate) struct Source {
    pubsub: PubSub,
    unclaimed: Arc<OnceLock<Unclaimed>>,
}

impl Source {
    /// `pubsub`, passing unclaimed wake-ups on once `unclaimed` is set.
    pub(crate) fn new(pubsub: PubSub, unclaimed: Arc<OnceLock<Unclaimed>>) -> Self {
        Self { pubsub, unclaimed }
    }
}

/// What a message on `channel` wakes: the waiter whose owner token it
/// carries (a release woke it alone), else every waiter of the channel.
fn wake(channel: &str, payload: Option<String>) -> Notification {
    match payload.filter(|p| distlock_core::OwnerToken::from_hex(p).is_some()) {
        Some(owner) => Notification::for_waiter(channel, owner),
        None => Notification::from(channel.to_owned()),
    }
}

#[async_trait]
impl NotificationSource for Source {
    /// A channel name.
    type Topic = String;
    type Sink = Sink;
    type Stream = Stream;

    fn channel(&self, topic: &String) -> String {
        topic.clone()
    }

    async fn connect(&self) -> Result<(Sink, Stream), LockError> {
        match &self.pubsub {
            PubSub::Node(client) => PubSub::open_node(client, None).await,
            PubSub::Sentinel(primary) => {
                let (client, generation) = primary.client().await?;
                let primary = Primary {
                    primary: primary.clone(),
                    generation,
                };
                PubSub::open_node(&client, Some(primary)).await
            }
            PubSub::Cluster(cluster) => cluster.open().await,
        }
    }

    async fn subscribe(&self, sink: &Sink, topics: &[String]) -> Result<(), LockError> {
        match sink {
            Sink::Node(sink) => sink
                .clone()
                .subscribe(topics)
                .await
                .map_err(|e| errors::map(e, "redis SUBSCRIBE")),
            // One channel at a time: each goes to the node of its slot.
            Sink::Cluster(conn, _) => {
                for topic in topics {
                    conn.clone()
                        .ssubscribe(topic)
                        .await
                        .map_err(|e| errors::map(e, "redis SSUBSCRIBE"))?;
                }
                Ok(())
            }
        }
    }

    async fn unsubscribe(&self, sink: &Sink, topics: &[String]) -> Result<(), LockError> {
        match sink {
            Sink::Node(sink) => sink
                .clone()
                .unsubscribe(topics)
                .await
                .map_err(|e| errors::map(e, "redis UNSUBSCRIBE")),
            Sink::Cluster(conn, expected) => {
                for topic in topics {
                    expected
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(topic.clone());
                    conn.clone()
                        .sunsubscribe(topic)
                        .await
                        .map_err(|e| errors::map(e, "redis SUNSUBSCRIBE"))?;
                }
                Ok(())
            }
        }
    }

    async fn next(&self, stream: &mut Stream) -> Option<Result<Notification, LockError>> {
        let received = next(stream).await;
        if let Some(Ok(Notification {
            channel,
            waiter: Some(waiter),
        })) = &received
        {
            if let Some(unclaimed) = self.unclaimed.get() {
                unclaimed.pass_on_if_unclaimed(channel, waiter);
            }
        }
        received
    }

    async fn ping(&self, sink: &Sink, _stream: &mut Stream) -> Result<(), LockError> {
        match sink {
            Sink::Node(sink) => sink
                .clone()
                .ping::<Value>()
                .await
                .map(drop)
                .map_err(|e| errors::map(e, "redis pub/sub PING")),
            Sink::Cluster(conn, _) => conn
                .clone()
                .route_command(
                    redis::cmd("PING"),
                    RoutingInfo::MultiNode((
                        MultipleNodeRoutingInfo::AllMasters,
                        Some(ResponsePolicy::AllSucceeded),
                    )),
                )
                .await
                .map(drop)
                .map_err(|e| errors::map(e, "redis cluster pub/sub PING")),
        }
    }
}

/// The next message of `stream`, as a notification.
async fn next(stream: &mut Stream) -> Option<Result<Notification, LockError>> {
    match stream {
        // `StreamExt::next` is cancel-safe: a message is either
        // returned or left in the stream.
        Stream::Node(stream, primary) => match stream.next().await {
            Some(message) => Some(Ok(wake(
                message.get_channel_name(),
                message.get_payload::<String>().ok(),
            ))),
            None => {
                if let Some(primary) = primary {
                    primary.gone();
                }
                None
            }
        },
        // `recv` is cancel-safe too; pushes read and skipped carry
        // nothing a waiter needs.
        Stream::Cluster(pushes, expected) => loop {
            let push = pushes.recv().await?;
            let text = |at: usize| match push.data.get(at) {
                Some(Value::BulkString(name)) => Some(String::from_utf8_lossy(name).into_owned()),
                _ => None,
            };
            let channel = || text(0).unwrap_or_default();
            match push.kind {
                PushKind::SMessage => return Some(Ok(wake(&channel(), text(1)))),
                PushKind::Disconnection => {
                    return Some(Err(LockError::unavailable(
                        "a redis cluster node's pub/sub connection closed",
                    )))
                }
                PushKind::SUnsubscribe => {
                    let channel = channel();
                    let ours = expected
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&channel);
                    if !ours {
                        return Some(Err(LockError::unavailable(format!(
                                "the redis cluster ended the subscription to {channel} (its slot moved)"
                            ))));
                    }
                }
                _ => {}
            }
        },
    }
}
