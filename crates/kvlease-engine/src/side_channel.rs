//! The handshake side channel (vLLM's NIXL side channel): a small TCP service on each engine
//! where a peer sends its [`Hello`] — identity, incarnation, one agent metadata blob per rank,
//! geometry — and gets ours back. It is also where clock samples for SPEC B2 are taken: the
//! reply echoes the request's send time and its own receive time.
//!
//! Trust (SPEC S1, S2): before either side reads anything larger than a few dozen bytes, each
//! proves it holds the cluster secret for this connection. The server opens with a fresh nonce;
//! the dialer answers with its own nonce and an HMAC over both; the server answers with its own
//! HMAC over both. Only then does the server read a Hello (up to [`MAX_FRAME`]), so an outsider
//! can make it hold no more than a small fixed buffer per connection (and [`MAX_PENDING`]
//! connections at once); and only then does the dialer send its Hello, whose agent metadata (over
//! NIXL, what lets a peer read and write our registered memory) must never reach a process that
//! merely took over a dead engine's port. Both Hellos carry an HMAC over their contents, both
//! nonces and the direction, so a recorded Hello cannot be replayed on another connection or
//! reflected back. The dialer proves first, so nobody without the secret gets a MAC to test
//! guesses of it against. Without a secret the same exchange runs under an empty
//! key and proves nothing: such engines must stay on loopback (SPEC S3).
//!
//! Frames are a 4-byte big-endian length and a [`Message`]; anything malformed or oversized
//! closes that connection and is counted, never more (SPEC P7).

use hmac::{Hmac, Mac};
use kvlease_core::wire::{Hello, Message};
use sha2::Sha256;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest handshake frame: a Hello carries a few hundred bytes per rank.
pub const MAX_FRAME: usize = 1 << 20;
pub const HANDSHAKE_TIMEOUT: Duration = kvlease_core::peers::HANDSHAKE_TIMEOUT;
/// Handshakes a server serves at once; more connections are closed at once and counted.
pub const MAX_PENDING: usize = 64;
/// Opens the server's challenge: the side channel's own magic and version.
const CHALLENGE_MAGIC: [u8; 4] = *b"KLS2";
const NONCE: usize = 16;
const MAC: usize = 32;

/// The two fresh nonces of one handshake connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nonces {
    pub server: [u8; NONCE],
    pub client: [u8; NONCE],
}

/// Which side signed a Hello: a Hello signed by one side never verifies as the other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Dialer,
    Server,
}

/// Why a handshake connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("the peer does not hold this cluster's secret (bad proof or bad Hello signature)")]
    Unauthenticated,
    #[error("expected a Hello")]
    NotHello,
    #[error("the connection closed in the middle of the proof")]
    Truncated,
    #[error("timed out")]
    Timeout,
}

impl HandshakeError {
    /// The `kvlease_messages_rejected_total` reason, if this counts as a rejected message.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            HandshakeError::Frame(e) => e.reason(),
            HandshakeError::NotHello | HandshakeError::Truncated => Some("malformed"),
            HandshakeError::Unauthenticated => Some("unauthenticated"),
            HandshakeError::Timeout => None,
        }
    }
}

fn keyed(secret: Option<&[u8]>, label: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.unwrap_or_default()).expect("HMAC takes keys of any length");
    mac.update(label);
    mac
}

/// One side's proof that it holds the secret, bound to this connection's nonces.
fn proof(secret: Option<&[u8]>, n: &Nonces, side: Side) -> Hmac<Sha256> {
    let mut mac = keyed(
        secret,
        match side {
            Side::Dialer => b"kvlease-side-channel-dialer-proof-v2\n",
            Side::Server => b"kvlease-side-channel-server-proof-v2\n",
        },
    );
    mac.update(&n.server);
    mac.update(&n.client);
    mac
}

fn hello_mac(secret: Option<&[u8]>, n: &Nonces, side: Side, hello: &Hello) -> Hmac<Sha256> {
    let mut mac = keyed(secret, b"kvlease-hello-v2\n");
    mac.update(&n.server);
    mac.update(&n.client);
    mac.update(match side {
        Side::Dialer => b"dialer",
        Side::Server => b"server",
    });
    let mut unsigned = hello.clone();
    unsigned.auth.clear();
    mac.update(&Message::Hello(unsigned).encode());
    mac
}

/// Signs `hello` for this connection (SPEC S1, S2).
pub fn sign(secret: Option<&[u8]>, n: &Nonces, side: Side, hello: &mut Hello) {
    hello.auth = hello_mac(secret, n, side, hello).finalize().into_bytes().to_vec();
}

/// Whether `hello` was signed by `side` of this connection with the secret.
pub fn authentic(secret: Option<&[u8]>, n: &Nonces, side: Side, hello: &Hello) -> bool {
    hello_mac(secret, n, side, hello).verify_slice(&hello.auth).is_ok()
}

fn nonce() -> Result<[u8; NONCE], std::io::Error> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(format!("no randomness from the OS for a nonce: {e}")))?;
    Ok(n)
}

/// Server side, up to the dialer's Hello: challenge, check the proof with a fixed small buffer,
/// then read and check the Hello. Returns it with the nonces to sign our reply with.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, secret: Option<&[u8]>) -> Result<(Hello, Nonces), HandshakeError> {
    let run = async {
        let server = nonce().map_err(FrameError::Io)?;
        let mut challenge = [0u8; 4 + NONCE];
        challenge[..4].copy_from_slice(&CHALLENGE_MAGIC);
        challenge[4..].copy_from_slice(&server);
        stream.write_all(&challenge).await.map_err(FrameError::Io)?;
        let mut answer = [0u8; NONCE + MAC];
        let mut got = 0;
        while got < answer.len() {
            match stream.read(&mut answer[got..]).await.map_err(FrameError::Io)? {
                // Connected and left without a word (a port probe): nothing to count.
                0 if got == 0 => return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()),
                0 => return Err(HandshakeError::Truncated),
                n => got += n,
            }
        }
        let mut client = [0u8; NONCE];
        client.copy_from_slice(&answer[..NONCE]);
        let nonces = Nonces { server, client };
        proof(secret, &nonces, Side::Dialer).verify_slice(&answer[NONCE..]).map_err(|_| HandshakeError::Unauthenticated)?;
        stream.write_all(&proof(secret, &nonces, Side::Server).finalize().into_bytes()).await.map_err(FrameError::Io)?;
        let Message::Hello(hello) = read_frame(stream).await? else { return Err(HandshakeError::NotHello) };
        if !authentic(secret, &nonces, Side::Dialer, &hello) {
            return Err(HandshakeError::Unauthenticated);
        }
        Ok((hello, nonces))
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run).await.map_err(|_| HandshakeError::Timeout)?
}

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

pub async fn write_frame<S: AsyncWrite + Unpin>(stream: &mut S, msg: &Message) -> Result<(), FrameError> {
    let bytes = msg.encode();
    let mut buf = Vec::with_capacity(4 + bytes.len());
    buf.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    buf.extend_from_slice(&bytes);
    stream.write_all(&buf).await?;
    Ok(())
}

pub async fn read_frame<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Message, FrameError> {
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

/// D's side, on a connection to `addr`: answer the challenge, send our Hello, return P's once it
/// proves it was signed with the secret for this connection. The caller bounds it in time
/// ([`HANDSHAKE_TIMEOUT`]), connecting included.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    addr: &str,
    secret: Option<&[u8]>,
    mut ours: Hello,
) -> Result<Hello, DialError> {
    let at = || addr.to_string();
    let mut challenge = [0u8; 4 + NONCE];
    stream.read_exact(&mut challenge).await.map_err(|e| DialError::NoChallenge(at(), e))?;
    if challenge[..4] != CHALLENGE_MAGIC {
        return Err(DialError::NotKvlease(at()));
    }
    let client = nonce().map_err(|e| DialError::Io(at(), e))?;
    let mut nonces = Nonces { server: [0; NONCE], client };
    nonces.server.copy_from_slice(&challenge[4..]);
    let mut answer = [0u8; NONCE + MAC];
    answer[..NONCE].copy_from_slice(&nonces.client);
    answer[NONCE..].copy_from_slice(&proof(secret, &nonces, Side::Dialer).finalize().into_bytes());
    stream.write_all(&answer).await.map_err(|e| DialError::Io(at(), e))?;
    let mut theirs = [0u8; MAC];
    if stream.read_exact(&mut theirs).await.is_err() {
        return Err(DialError::ProofRefused(at()));
    }
    if proof(secret, &nonces, Side::Server).verify_slice(&theirs).is_err() {
        return Err(DialError::ServerUnproven(at()));
    }
    sign(secret, &nonces, Side::Dialer, &mut ours);
    write_frame(&mut stream, &Message::Hello(ours)).await.map_err(|e| DialError::Frame(at(), e))?;
    let theirs = match read_frame(&mut stream).await {
        Ok(Message::Hello(h)) => h,
        Ok(_) => return Err(DialError::NotHello(at())),
        // A server closes without a word on a bad proof or signature.
        Err(e) => return Err(DialError::HelloRefused(at(), e)),
    };
    if !authentic(secret, &nonces, Side::Server, &theirs) {
        return Err(DialError::Unsigned(at()));
    }
    Ok(theirs)
}

/// Why a handshake this engine dialled failed.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("no challenge from {0}: {1}")]
    NoChallenge(String, std::io::Error),
    #[error("{0} is not a kvlease side channel of this version")]
    NotKvlease(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("{0} refused our proof: does it hold this cluster's secret?")]
    ProofRefused(String),
    #[error("{0} does not hold this cluster's secret; not sending it our agents")]
    ServerUnproven(String),
    #[error("cannot send our Hello to {0}: {1}")]
    Frame(String, FrameError),
    #[error("expected a Hello from {0}")]
    NotHello(String),
    #[error("{0} refused the handshake ({1}): does it hold this cluster's secret?")]
    HelloRefused(String, FrameError),
    #[error("the engine at {0} did not sign its handshake with this cluster's secret")]
    Unsigned(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    use tokio::net::TcpStream;

    async fn dial(addr: &str, secret: Option<&[u8]>, ours: Hello) -> Result<Hello, String> {
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        exchange(stream, addr, secret, ours).await.map_err(|e| e.to_string())
    }

    fn hello(engine_id: &str) -> Hello {
        Hello { engine_id: engine_id.into(), incarnation: 1, agents: vec![], info: b"{}".to_vec(), t_send: 1, echo: (0, 0), auth: vec![] }
    }

    /// Runs `accept` once on a fresh listener; returns its address and the verdict.
    async fn server(secret: &'static [u8]) -> (String, tokio::task::JoinHandle<Result<(Hello, Nonces), HandshakeError>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let got = accept(&mut s, Some(secret)).await;
            if let Ok((_, n)) = &got {
                let mut ours = hello("P");
                sign(Some(secret), n, Side::Server, &mut ours);
                write_frame(&mut s, &Message::Hello(ours)).await.unwrap();
            }
            got
        });
        (addr, task)
    }

    /// SPEC S2: engines holding the same secret complete the handshake both ways.
    #[tokio::test]
    async fn s2_same_secret_handshakes() {
        let (addr, task) = server(b"k").await;
        let theirs = dial(&addr, Some(b"k"), hello("D")).await.unwrap();
        assert_eq!(theirs.engine_id, "P");
        assert_eq!(task.await.unwrap().unwrap().0.engine_id, "D");
    }

    /// SPEC S2: a dialer without the secret is refused on its proof, before the server reads
    /// (or allocates for) anything it sends after: here a frame header announcing 1 MiB.
    #[tokio::test]
    async fn s2_wrong_secret_is_refused_before_the_hello_is_read() {
        let (addr, task) = server(b"k").await;
        let err = dial(&addr, Some(b"not-k"), hello("D")).await.unwrap_err();
        assert!(err.contains("secret"), "{err}");
        assert!(matches!(task.await.unwrap(), Err(HandshakeError::Unauthenticated)));

        let (addr, task) = server(b"k").await;
        let mut raw = TcpStream::connect(&addr).await.unwrap();
        let mut challenge = [0u8; 4 + NONCE];
        raw.read_exact(&mut challenge).await.unwrap();
        raw.write_all(&[0u8; NONCE + MAC]).await.unwrap();
        let _ = raw.write_all(&(MAX_FRAME as u32).to_be_bytes()).await;
        assert!(matches!(task.await.unwrap(), Err(HandshakeError::Unauthenticated)));
    }

    /// SPEC P7: a dialer that proves the secret but then sends an oversized frame, or a message
    /// that is not a Hello, is dropped and counted; a proof cut short is malformed.
    #[tokio::test]
    async fn p7_junk_after_a_valid_proof_is_counted() {
        for (junk, want) in [
            ((MAX_FRAME as u32 + 1).to_be_bytes().to_vec(), "oversized"),
            (
                {
                    let m = Message::LeaseLost { lease_ids: vec![1] }.encode();
                    let mut f = (m.len() as u32).to_be_bytes().to_vec();
                    f.extend(m);
                    f
                },
                "malformed",
            ),
        ] {
            let (addr, task) = server(b"k").await;
            let mut raw = TcpStream::connect(&addr).await.unwrap();
            let mut challenge = [0u8; 4 + NONCE];
            raw.read_exact(&mut challenge).await.unwrap();
            let mut n = Nonces { server: [0; NONCE], client: [5; NONCE] };
            n.server.copy_from_slice(&challenge[4..]);
            let mut answer = n.client.to_vec();
            answer.extend_from_slice(&proof(Some(b"k"), &n, Side::Dialer).finalize().into_bytes());
            answer.extend(junk);
            raw.write_all(&answer).await.unwrap();
            let err = task.await.unwrap().unwrap_err();
            assert_eq!(err.reason(), Some(want), "{err}");
        }
        let (addr, task) = server(b"k").await;
        let mut raw = TcpStream::connect(&addr).await.unwrap();
        raw.write_all(b"HB:1,2").await.unwrap();
        drop(raw);
        assert_eq!(task.await.unwrap().unwrap_err().reason(), Some("malformed"), "a proof cut short");
    }

    /// SPEC S2: a server without the secret (say, a process that took over a dead engine's
    /// port) never receives the dialer's Hello, and so never its agents' metadata.
    #[tokio::test]
    async fn s2_dialer_sends_no_hello_to_a_server_without_the_secret() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let squatter = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut challenge = CHALLENGE_MAGIC.to_vec();
            challenge.extend([9; NONCE]);
            s.write_all(&challenge).await.unwrap();
            let mut answer = [0u8; NONCE + MAC];
            s.read_exact(&mut answer).await.unwrap();
            s.write_all(&[0; MAC]).await.unwrap(); // it cannot compute the server's proof
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            rest
        });
        let err = dial(&addr, Some(b"k"), hello("D")).await.unwrap_err();
        assert!(err.contains("does not hold"), "{err}");
        assert!(squatter.await.unwrap().is_empty(), "the squatter got nothing after the proofs");
    }

    /// SPEC S2: a Hello recorded on one connection does not verify on another (fresh nonces), nor
    /// as the other side's (direction).
    #[test]
    fn s2_hellos_do_not_replay_or_reflect() {
        let (a, b) = (Nonces { server: [1; NONCE], client: [2; NONCE] }, Nonces { server: [3; NONCE], client: [2; NONCE] });
        let mut h = hello("D");
        sign(Some(b"k"), &a, Side::Dialer, &mut h);
        assert!(authentic(Some(b"k"), &a, Side::Dialer, &h));
        assert!(!authentic(Some(b"k"), &b, Side::Dialer, &h), "replayed on another connection");
        assert!(!authentic(Some(b"k"), &a, Side::Server, &h), "reflected");
        assert!(!authentic(Some(b"other"), &a, Side::Dialer, &h), "another secret");
        let mut altered = h.clone();
        altered.incarnation = 2;
        assert!(!authentic(Some(b"k"), &a, Side::Dialer, &altered), "altered");
    }
}
