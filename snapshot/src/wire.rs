//! The control → proxy protocol on the Unix socket: length-prefixed JSON frames.
//!
//! A frame is a 4-byte big-endian length and that many bytes of JSON. The proxy speaks first
//! (`Hello`, with the version and fingerprint it serves), the control answers with the current
//! snapshot unless the proxy already has it, then with every new one; the proxy acknowledges
//! each (`Applied` or `Rejected` with the reason). Unknown message types are errors, so a
//! mismatched peer fails loudly instead of half-working.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::Snapshot;

/// Version of this protocol, sent in `Hello`.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest frame either side accepts (a snapshot of thousands of pools fits many times over).
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// What the control process sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ControlMessage {
    /// A complete snapshot to serve (its `version` is set).
    Snapshot { snapshot: Box<Snapshot> },
}

/// What a proxy sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ProxyMessage {
    /// First frame of a connection: who is asking and what it serves now.
    Hello {
        protocol: u32,
        pid: u32,
        /// 0 when it serves nothing yet.
        version: u64,
        fingerprint: Option<String>,
    },
    Applied {
        version: u64,
    },
    Rejected {
        version: u64,
        reason: String,
    },
}

/// Whether a peer with user id `uid` may use the control socket: this process's user or root.
/// (The user id is read from /proc, without unsafe calls.)
pub fn peer_allowed(uid: Option<u32>) -> bool {
    use std::os::unix::fs::MetadataExt;
    let own = std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    uid == Some(own) || uid == Some(0)
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes is over the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("invalid frame: {0}")]
    Json(#[from] serde_json::Error),
}

/// Write one message as a frame.
pub async fn write_frame<W, T>(writer: &mut W, message: &T) -> Result<(), WireError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let payload = serde_json::to_vec(message)?;
    if payload.len() > MAX_FRAME_BYTES {
        return Err(WireError::TooLarge(payload.len()));
    }
    let length = u32::try_from(payload.len()).map_err(|_| WireError::TooLarge(payload.len()))?;
    writer.write_all(&length.to_be_bytes()).await?;
    writer.write_all(&payload).await?;
    writer.flush().await?;
    Ok(())
}

/// Read one message; `None` when the peer closed the connection between frames.
pub async fn read_frame<R, T>(reader: &mut R) -> Result<Option<T>, WireError>
where
    R: AsyncRead + Unpin,
    T: for<'de> Deserialize<'de>,
{
    let mut header = [0u8; 4];
    match reader.read_exact(&mut header).await {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error.into()),
    }
    let length = u32::from_be_bytes(header) as usize;
    if length > MAX_FRAME_BYTES {
        return Err(WireError::TooLarge(length));
    }
    let mut payload = vec![0u8; length];
    reader.read_exact(&mut payload).await?;
    Ok(Some(serde_json::from_slice(&payload)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_limits_hold() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let snapshot = crate::load_str("t", "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\nspec: {model: m, endpoints: [\"10.0.0.1:80\"]}\n")
            .unwrap()
            .with_version(7);
        let hello = ProxyMessage::Hello {
            protocol: PROTOCOL_VERSION,
            pid: 1,
            version: 0,
            fingerprint: None,
        };
        write_frame(&mut a, &hello).await.unwrap();
        write_frame(
            &mut a,
            &ControlMessage::Snapshot {
                snapshot: Box::new(snapshot.clone()),
            },
        )
        .await
        .unwrap();
        assert_eq!(
            read_frame::<_, ProxyMessage>(&mut b).await.unwrap(),
            Some(hello)
        );
        let Some(ControlMessage::Snapshot { snapshot: received }) =
            read_frame(&mut b).await.unwrap()
        else {
            panic!("no snapshot");
        };
        assert_eq!(*received, snapshot);
        drop(a);
        assert!(
            read_frame::<_, ProxyMessage>(&mut b)
                .await
                .unwrap()
                .is_none(),
            "clean close"
        );

        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&(MAX_FRAME_BYTES as u32 + 1).to_be_bytes())
            .await
            .unwrap();
        assert!(matches!(
            read_frame::<_, ProxyMessage>(&mut b).await,
            Err(WireError::TooLarge(_))
        ));
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&3u32.to_be_bytes()).await.unwrap();
        a.write_all(b"{x}").await.unwrap();
        assert!(matches!(
            read_frame::<_, ProxyMessage>(&mut b).await,
            Err(WireError::Json(_))
        ));
    }
}
