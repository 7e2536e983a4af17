//! Publishing KV events the way vLLM's `ZmqEventPublisher` does: a PUB socket sending
//! `[topic, seq, payload]`, and an optional ROUTER socket that replays buffered batches from a
//! requested sequence number, ending with an all-0xff sequence marker.

use std::collections::VecDeque;

use bytes::Bytes;
use switchyard_kv::events::{HashEncoding, KvEventBatch, REPLAY_END_SEQ, WireFormat, encode_batch};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB endpoint to bind, e.g. `tcp://127.0.0.1:5557` (port 0 picks a free one).
    pub endpoint: String,
    /// ROUTER endpoint for replay; none disables replay.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    pub format: WireFormat,
    pub hashes: HashEncoding,
}

/// Where the sockets really listen.
#[derive(Debug, Clone)]
pub struct BoundPublisher {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot bind {endpoint}: {source}")]
pub struct PublisherError {
    endpoint: String,
    #[source]
    source: zeromq::ZmqError,
}

/// Bind the sockets and publish every batch received on `batches` until the channel closes.
pub async fn start(
    config: PublisherConfig,
    mut batches: mpsc::UnboundedReceiver<KvEventBatch>,
) -> Result<BoundPublisher, PublisherError> {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher
        .bind(&config.endpoint)
        .await
        .map_err(|source| PublisherError {
            endpoint: config.endpoint.clone(),
            source,
        })?
        .to_string();
    let mut replay = None;
    let mut replay_endpoint = None;
    if let Some(requested) = &config.replay_endpoint {
        let mut router = zeromq::RouterSocket::new();
        let bound = router
            .bind(requested)
            .await
            .map_err(|source| PublisherError {
                endpoint: requested.clone(),
                source,
            })?;
        replay_endpoint = Some(bound.to_string());
        replay = Some(router);
    }
    let topic = Bytes::from(config.topic.clone().into_bytes());
    tokio::spawn(async move {
        let mut buffer: VecDeque<(u64, Bytes)> =
            VecDeque::with_capacity(config.buffer_steps.min(65_536));
        let mut next_seq: u64 = 0;
        loop {
            tokio::select! {
                batch = batches.recv() => {
                    let Some(batch) = batch else { return };
                    let payload = Bytes::from(encode_batch(&batch, config.format, config.hashes));
                    let seq = next_seq;
                    next_seq += 1;
                    let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                    if let Ok(message) = ZmqMessage::try_from(frames)
                        && let Err(error) = publisher.send(message).await {
                            tracing::warn!(%error, "KV event publish failed");
                        }
                    if buffer.len() >= config.buffer_steps.max(1) {
                        buffer.pop_front();
                    }
                    buffer.push_back((seq, payload));
                }
                request = recv_replay(&mut replay) => {
                    let Some(router) = replay.as_mut() else { continue };
                    let Ok(request) = request else { continue };
                    let frames = request.into_vec();
                    let [identity, _empty, start] = frames.as_slice() else {
                        tracing::warn!(frames = frames.len(), "invalid replay request");
                        continue;
                    };
                    let start = switchyard_kv::events::decode_seq(start).unwrap_or(u64::MAX);
                    for (seq, payload) in buffer.iter().filter(|(seq, _)| *seq >= start) {
                        let reply = vec![identity.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                        if let Ok(message) = ZmqMessage::try_from(reply) {
                            let _ = router.send(message).await;
                        }
                    }
                    let end = vec![identity.clone(), Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&REPLAY_END_SEQ.to_be_bytes()), Bytes::new()];
                    if let Ok(message) = ZmqMessage::try_from(end) {
                        let _ = router.send(message).await;
                    }
                }
            }
        }
    });
    Ok(BoundPublisher {
        endpoint,
        replay_endpoint,
    })
}

async fn recv_replay(router: &mut Option<zeromq::RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match router {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}
