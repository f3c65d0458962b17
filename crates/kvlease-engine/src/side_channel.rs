//! The handshake side channel (vLLM's NIXL side channel): a small TCP service on each engine
//! where a peer sends its [`Hello`] — identity, incarnation, one agent metadata blob per rank,
//! geometry — and gets ours back. It is also where clock samples for SPEC B2 are taken: the
//! reply echoes the request's send time and its own receive time.
//!
//! Frames are a 4-byte big-endian length and a [`Message`]; anything malformed or oversized
//! closes that connection and is counted, never more (SPEC P7).

use kvlease_core::wire::{Hello, Message};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest handshake frame: a Hello carries a few hundred bytes per rank.
pub const MAX_FRAME: usize = 1 << 20;
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the limit")]
    Oversized(usize),
    #[error("malformed frame: {0}")]
    Malformed(#[from] kvlease_core::wire::WireError),
}

impl FrameError {
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            FrameError::Io(_) => None,
            FrameError::Oversized(_) => Some("oversized"),
            FrameError::Malformed(_) => Some("malformed"),
        }
    }
}

pub async fn write_frame(stream: &mut TcpStream, msg: &Message) -> Result<(), FrameError> {
    let bytes = msg.encode();
    let mut buf = Vec::with_capacity(4 + bytes.len());
    buf.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    buf.extend_from_slice(&bytes);
    stream.write_all(&buf).await?;
    Ok(())
}

pub async fn read_frame(stream: &mut TcpStream) -> Result<Message, FrameError> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::Oversized(len));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).await?;
    Ok(Message::decode(&buf)?)
}

/// D's side: send our Hello to `addr`, return P's, within [`HANDSHAKE_TIMEOUT`].
pub async fn exchange(addr: &str, ours: &Hello) -> Result<Hello, String> {
    let run = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
        stream.set_nodelay(true).ok();
        write_frame(&mut stream, &Message::Hello(ours.clone())).await.map_err(|e| e.to_string())?;
        match read_frame(&mut stream).await.map_err(|e| e.to_string())? {
            Message::Hello(h) => Ok(h),
            other => Err(format!("expected a Hello from {addr}, got {other:?}")),
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run).await.map_err(|_| format!("handshake with {addr} timed out"))?
}
