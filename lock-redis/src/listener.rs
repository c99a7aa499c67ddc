//! Server-driven wake-up: the pub/sub connection as a
//! [`NotificationSource`], driven by [`lock_core::Listener`].
//!
//! A release script publishes on the lock's channel (`NS:{K'}:released`).
//! The listener opens one pub/sub connection per client on the first wait,
//! subscribes a channel when its first local waiter arrives (confirmed
//! before the waiter's first attempt), wakes the channel's waiters on each
//! message, PINGs a quiet connection, unsubscribes idle channels, and on any
//! failure drops the connection so every waiter subscribes again.

use futures_util::StreamExt;
use lock_core::{async_trait, LockError, NotificationSource};
use redis::aio::{PubSubSink, PubSubStream};

use crate::errors;

/// Opens pub/sub connections through a redis [`Client`](redis::Client).
pub(crate) struct PubSub {
    client: redis::Client,
}

impl PubSub {
    pub(crate) fn new(client: redis::Client) -> Self {
        Self { client }
    }
}

#[async_trait]
impl NotificationSource for PubSub {
    /// A channel name.
    type Topic = String;
    type Sink = PubSubSink;
    type Stream = PubSubStream;

    fn channel(&self, topic: &String) -> String {
        topic.clone()
    }

    async fn connect(&self) -> Result<(PubSubSink, PubSubStream), LockError> {
        let what = "connecting the redis pub/sub connection";
        let pubsub = self
            .client
            .get_async_pubsub()
            .await
            .map_err(|e| errors::map(e, what))?;
        Ok(pubsub.split())
    }

    async fn subscribe(&self, sink: &PubSubSink, topics: &[String]) -> Result<(), LockError> {
        sink.clone()
            .subscribe(topics)
            .await
            .map_err(|e| errors::map(e, "redis SUBSCRIBE"))
    }

    async fn unsubscribe(&self, sink: &PubSubSink, topics: &[String]) -> Result<(), LockError> {
        sink.clone()
            .unsubscribe(topics)
            .await
            .map_err(|e| errors::map(e, "redis UNSUBSCRIBE"))
    }

    async fn next(&self, stream: &mut PubSubStream) -> Option<Result<String, LockError>> {
        // `StreamExt::next` is cancel-safe: a message is either returned or
        // left in the stream.
        let message = stream.next().await?;
        Some(Ok(message.get_channel_name().to_owned()))
    }

    async fn ping(&self, sink: &PubSubSink, _stream: &mut PubSubStream) -> Result<(), LockError> {
        sink.clone()
            .ping::<redis::Value>()
            .await
            .map(drop)
            .map_err(|e| errors::map(e, "redis pub/sub PING"))
    }
}
