//! The handshake side channel (vLLM's NIXL side channel): a small TCP service on each engine
//! where a peer sends its [`Hello`] — identity, incarnation, one agent metadata blob per rank,
//! geometry — and gets ours back, or a [`Message::Refused`] saying why not (a geometry field and
//! both values, so both logs tell the operator what to fix). It is also where clock samples for
//! SPEC B2 are taken: the reply echoes the request's send time and its own receive time. And it
//! is D's way to release P's leases when no transfer link can carry the release (SPEC O4): a
//! [`SideRelease`] instead of a Hello, answered by a [`Message::SideReleaseAck`].
//!
//! Trust (SPEC S1, S2): before either side reads anything larger than a few dozen bytes, each
//! proves it holds the cluster secret for this connection, with the challenge-response the tcp
//! agents use too (`kvlease_core::auth`, which computes and checks every proof; this module only
//! moves the bytes): the server opens with a fresh nonce; the dialer answers with its own nonce
//! and an HMAC over both; only then does the server answer with its own HMAC. **The dialer proves first**, so whoever merely reaches the port gets a nonce and
//! nothing to test guesses of the secret against. Only then does the server read a request (up
//! to [`MAX_FRAME`]); and only after the server's proof does the dialer send it, so its agent
//! metadata (over NIXL, what lets a peer read and write our registered memory) never reaches a
//! process that merely took over a dead engine's port. Requests and replies that matter (Hellos,
//! releases) carry an HMAC over their contents, both nonces and the direction, so a recorded one
//! cannot be replayed on another connection or reflected back. Without a secret the same
//! exchange runs under an empty key and proves nothing: such engines must stay on loopback
//! (SPEC S3).
//!
//! Under a flood (issue 22): a connection that has proven nothing costs a socket and a task with
//! a 36-byte buffer. It must prove itself within [`PROOF_TIMEOUT`] of our challenge; up to
//! [`MAX_UNPROVEN`] wait at once ([`MAX_UNPROVEN_PER_SOURCE`] from one address), and a newcomer
//! beyond either cap evicts the oldest instead of being turned away
//! (`kvlease_transport::admission`), so a real dialer, which proves itself within a round trip,
//! always gets in. Proven connections have their own [`MAX_PROVEN`] places and wait for one
//! rather than being refused. Established peers never wait on this channel at all: their
//! heartbeats travel over the transfer agents.
//!
//! Frames are a 4-byte big-endian length and a [`Message`]; anything malformed or oversized
//! closes that connection and is counted, never more (SPEC P7).

use kvlease_core::auth::{Answer, Challenge, Channel, ClusterKey, Nonces, Parties, Proven, Side, NONCE_LEN, TAG_LEN};
use kvlease_core::wire::{Hello, Message, SideRelease};
use kvlease_core::LeaseId;
use kvlease_transport::auth;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest handshake frame: a Hello carries a few hundred bytes per rank.
pub const MAX_FRAME: usize = 1 << 20;
pub const HANDSHAKE_TIMEOUT: Duration = kvlease_core::peers::HANDSHAKE_TIMEOUT;
/// How long a dialer has, from our challenge, to prove it holds the secret: a round trip and an
/// HMAC, with room for a loaded machine. Also the most a silent stranger holds its place.
pub const PROOF_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections that have proven nothing yet, at most; a newcomer beyond evicts the oldest.
pub const MAX_UNPROVEN: usize = 1024;
/// Of those, at most this many from one address; a newcomer beyond evicts that address's oldest.
pub const MAX_UNPROVEN_PER_SOURCE: usize = 256;
/// Proven connections served at once (they may allocate for a Hello); more wait for a place.
pub const MAX_PROVEN: usize = 16;
/// Opens the server's challenge: the side channel's own magic and version (3: the nonces and
/// proofs of `kvlease_core::auth`).
const CHALLENGE_MAGIC: [u8; 4] = *b"KLS3";
const SC: Channel = Channel::SideChannel;

/// Why a handshake connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("the peer does not hold this cluster's secret (bad proof or bad signature)")]
    Unauthenticated,
    #[error("expected a Hello or a release")]
    NotARequest,
    #[error("the connection closed in the middle of the proof")]
    Truncated,
}

impl HandshakeError {
    /// The `kvlease_messages_rejected_total` reason, if this counts as a rejected message.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            HandshakeError::Frame(e) => e.reason(),
            HandshakeError::NotARequest | HandshakeError::Truncated => Some("malformed"),
            HandshakeError::Unauthenticated => Some("unauthenticated"),
        }
    }
}

/// What a proven dialer asks for.
#[derive(Debug)]
pub enum Request {
    Hello(Hello),
    Release(SideRelease),
}

/// The bytes a message's MAC covers: the message without its MAC. `None` for messages that
/// carry none.
fn unsigned(msg: &Message) -> Option<Vec<u8>> {
    match msg {
        Message::Hello(h) => Some(Message::Hello(Hello { auth: Vec::new(), ..h.clone() }).encode()),
        Message::SideRelease(r) => Some(Message::SideRelease(SideRelease { auth: Vec::new(), ..r.clone() }).encode()),
        _ => None,
    }
}

/// Signs a Hello or a release for this connection (SPEC S1, S2).
pub fn sign(key: &ClusterKey, n: &Nonces, side: Side, msg: &mut Message) {
    let Some(bytes) = unsigned(msg) else { return };
    let tag = key.frame_tag(SC, side, n, &bytes).to_vec();
    match msg {
        Message::Hello(h) => h.auth = tag,
        Message::SideRelease(r) => r.auth = tag,
        _ => {}
    }
}

/// Whether a Hello or a release was signed by `side` of this connection with the secret.
pub fn authentic(key: &ClusterKey, n: &Nonces, side: Side, msg: &Message) -> bool {
    let tag = match msg {
        Message::Hello(h) => &h.auth,
        Message::SideRelease(r) => &r.auth,
        _ => return false,
    };
    unsigned(msg).is_some_and(|bytes| key.verify_frame(SC, side, n, &bytes, tag))
}

/// Server side, first part: our challenge and the dialer's proof, in a fixed small buffer;
/// nothing we send depends on the secret. The caller bounds it by [`PROOF_TIMEOUT`] (and may
/// evict it). Returns the connection's nonces and our proof, for [`request`].
pub async fn challenge<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, key: &ClusterKey) -> Result<Proven, HandshakeError> {
    let challenge = Challenge::new(auth::nonce().map_err(|e| FrameError::Io(std::io::Error::other(e.to_string())))?);
    let mut opening = [0u8; 4 + NONCE_LEN];
    opening[..4].copy_from_slice(&CHALLENGE_MAGIC);
    opening[4..].copy_from_slice(challenge.nonce());
    stream.write_all(&opening).await.map_err(FrameError::Io)?;
    let mut answer = [0u8; NONCE_LEN + TAG_LEN];
    let mut got = 0;
    while got < answer.len() {
        match stream.read(&mut answer[got..]).await.map_err(FrameError::Io)? {
            // Connected and left without a word (a port probe): nothing to count.
            0 if got == 0 => return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()),
            0 => return Err(HandshakeError::Truncated),
            n => got += n,
        }
    }
    let mut dialer = [0; NONCE_LEN];
    dialer.copy_from_slice(&answer[..NONCE_LEN]);
    challenge.check(key, Parties::SIDE_CHANNEL, dialer, &answer[NONCE_LEN..]).map_err(|_| HandshakeError::Unauthenticated)
}

/// Server side, second part, for a proven dialer: our proof, then its request (a Hello or a
/// release, up to [`MAX_FRAME`]), signed for this connection. The caller bounds it in time.
pub async fn request<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &ClusterKey,
    proven: &Proven,
) -> Result<Request, HandshakeError> {
    let n = &proven.nonces;
    stream.write_all(&proven.proof).await.map_err(FrameError::Io)?;
    let msg = read_frame(stream).await?;
    if !matches!(msg, Message::Hello(_) | Message::SideRelease(_)) {
        return Err(HandshakeError::NotARequest);
    }
    if !authentic(key, n, Side::Dialer, &msg) {
        return Err(HandshakeError::Unauthenticated);
    }
    match msg {
        Message::Hello(h) => Ok(Request::Hello(h)),
        Message::SideRelease(r) => Ok(Request::Release(r)),
        _ => Err(HandshakeError::NotARequest),
    }
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

/// D's side of the proofs on a connection to `addr`: answer the challenge with our proof, then
/// check the server's. Returns the connection's nonces.
async fn prove<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, addr: &str, key: &ClusterKey) -> Result<Nonces, DialError> {
    let at = || addr.to_string();
    let mut challenge = [0u8; 4 + NONCE_LEN];
    stream.read_exact(&mut challenge).await.map_err(|e| DialError::NoChallenge(at(), e))?;
    if challenge[..4] != CHALLENGE_MAGIC {
        return Err(DialError::NotKvlease(at()));
    }
    let dialer = auth::nonce().map_err(|e| DialError::Io(at(), std::io::Error::other(e.to_string())))?;
    let mut nonces = Nonces { dialer, acceptor: [0; NONCE_LEN] };
    nonces.acceptor.copy_from_slice(&challenge[4..]);
    let ours = Answer::new(key, Parties::SIDE_CHANNEL, nonces);
    let mut answer = [0u8; NONCE_LEN + TAG_LEN];
    answer[..NONCE_LEN].copy_from_slice(&ours.nonces.dialer);
    answer[NONCE_LEN..].copy_from_slice(&ours.proof);
    stream.write_all(&answer).await.map_err(|e| DialError::Io(at(), e))?;
    let mut theirs = [0u8; TAG_LEN];
    if stream.read_exact(&mut theirs).await.is_err() {
        return Err(DialError::ProofRefused(at()));
    }
    ours.check(&theirs).map_err(|_| DialError::ServerUnproven(at()))
}

/// D's side, on a connection to `addr`: prove, send our Hello, return P's once it proves it was
/// signed with the secret for this connection; or P's refusal, with its reason. The caller
/// bounds it in time ([`HANDSHAKE_TIMEOUT`]), connecting included.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    addr: &str,
    key: &ClusterKey,
    ours: Hello,
) -> Result<Hello, DialError> {
    let at = || addr.to_string();
    let nonces = prove(&mut stream, addr, key).await?;
    let mut ours = Message::Hello(ours);
    sign(key, &nonces, Side::Dialer, &mut ours);
    write_frame(&mut stream, &ours).await.map_err(|e| DialError::Frame(at(), e))?;
    let theirs = match read_frame(&mut stream).await {
        Ok(m @ Message::Hello(_)) => m,
        Ok(Message::Refused { what, reason }) => return Err(DialError::Refused { addr: at(), what, reason }),
        Ok(_) => return Err(DialError::NotHello(at())),
        Err(e) => return Err(DialError::HelloRefused(at(), e)),
    };
    if !authentic(key, &nonces, Side::Acceptor, &theirs) {
        return Err(DialError::Unsigned(at()));
    }
    let Message::Hello(theirs) = theirs else { return Err(DialError::NotHello(at())) };
    Ok(theirs)
}

/// D's side of a release over the side channel at `addr` (SPEC O4): prove, send the signed
/// release, return P's answer: its incarnation and the ids it did not release. The caller bounds
/// it in time, connecting included.
pub async fn release<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    addr: &str,
    key: &ClusterKey,
    release: SideRelease,
) -> Result<(u64, Vec<LeaseId>), DialError> {
    let at = || addr.to_string();
    let nonces = prove(&mut stream, addr, key).await?;
    let mut msg = Message::SideRelease(release);
    sign(key, &nonces, Side::Dialer, &mut msg);
    write_frame(&mut stream, &msg).await.map_err(|e| DialError::Frame(at(), e))?;
    match read_frame(&mut stream).await {
        Ok(Message::SideReleaseAck { incarnation, lost_ids }) => Ok((incarnation, lost_ids)),
        Ok(Message::Refused { what, reason }) => Err(DialError::Refused { addr: at(), what, reason }),
        Ok(_) => Err(DialError::NotHello(at())),
        Err(e) => Err(DialError::HelloRefused(at(), e)),
    }
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
    #[error("cannot send our request to {0}: {1}")]
    Frame(String, FrameError),
    #[error("expected a Hello from {0}")]
    NotHello(String),
    /// Both hold the secret (the proofs passed): its log says why it closed.
    #[error("{0} closed the connection after our request ({1}); its log says why")]
    HelloRefused(String, FrameError),
    /// It said why.
    #[error("{addr} refused the handshake: {reason}")]
    Refused { addr: String, what: String, reason: String },
    #[error("the engine at {0} did not sign its handshake with this cluster's secret")]
    Unsigned(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;
    use tokio::net::TcpStream;

    fn key(secret: &[u8]) -> ClusterKey {
        ClusterKey::new(Some(secret))
    }

    async fn dial(addr: &str, secret: &[u8], ours: Hello) -> Result<Hello, DialError> {
        let stream = TcpStream::connect(addr).await.map_err(|e| DialError::Io(addr.to_string(), e))?;
        exchange(stream, addr, &key(secret), ours).await
    }

    fn hello(engine_id: &str) -> Hello {
        Hello {
            engine_id: engine_id.into(),
            incarnation: 1,
            agents: vec![],
            info: b"{}".to_vec(),
            t_send: 1,
            echo: (0, 0),
            auth: vec![],
            notif_key: vec![],
        }
    }

    /// Serves one connection on a fresh listener as the engine does: challenge, request; a Hello
    /// is answered with a signed Hello, a release with an ack. Returns its address and verdict.
    async fn server(secret: &'static [u8]) -> (String, tokio::task::JoinHandle<Result<Request, HandshakeError>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let k = key(secret);
            let proven = challenge(&mut s, &k).await?;
            let got = request(&mut s, &k, &proven).await?;
            let reply = match &got {
                Request::Hello(_) => {
                    let mut ours = Message::Hello(hello("P"));
                    sign(&k, &proven.nonces, Side::Acceptor, &mut ours);
                    ours
                }
                Request::Release(r) => Message::SideReleaseAck { incarnation: 9, lost_ids: r.lease_ids[1..].to_vec() },
            };
            write_frame(&mut s, &reply).await.unwrap();
            Ok(got)
        });
        (addr, task)
    }

    /// SPEC S2: engines holding the same secret complete the handshake both ways.
    #[tokio::test]
    async fn s2_same_secret_handshakes() {
        let (addr, task) = server(b"k").await;
        let theirs = dial(&addr, b"k", hello("D")).await.unwrap();
        assert_eq!(theirs.engine_id, "P");
        assert!(matches!(task.await.unwrap(), Ok(Request::Hello(h)) if h.engine_id == "D"));
    }

    /// SPEC S2, issue 22: the server's challenge is a bare nonce, and a dialer without the secret
    /// gets nothing more: no proof of the server's to test guesses of the secret against, and
    /// nothing it sends after its proof is read (here a frame header announcing 1 MiB).
    #[tokio::test]
    async fn s2_the_server_proves_nothing_before_the_dialer_does() {
        let (addr, task) = server(b"k").await;
        let err = dial(&addr, b"not-k", hello("D")).await.unwrap_err().to_string();
        assert!(err.contains("secret"), "{err}");
        assert!(matches!(task.await.unwrap(), Err(HandshakeError::Unauthenticated)));

        let (addr, task) = server(b"k").await;
        let mut raw = TcpStream::connect(&addr).await.unwrap();
        let mut challenge = [0u8; 4 + NONCE_LEN];
        raw.read_exact(&mut challenge).await.unwrap();
        assert_eq!(challenge[..4], CHALLENGE_MAGIC);
        raw.write_all(&[0u8; NONCE_LEN + TAG_LEN]).await.unwrap();
        let _ = raw.write_all(&(MAX_FRAME as u32).to_be_bytes()).await;
        assert!(matches!(task.await.unwrap(), Err(HandshakeError::Unauthenticated)));
        let mut rest = Vec::new();
        let _ = raw.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "nothing after the challenge: {} bytes", rest.len());
    }

    /// SPEC P7: a dialer that proves the secret but then sends an oversized frame, or a message
    /// that is not a request, is dropped and counted; a proof cut short is malformed.
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
            let mut challenge = [0u8; 4 + NONCE_LEN];
            raw.read_exact(&mut challenge).await.unwrap();
            let mut n = Nonces { dialer: [5; NONCE_LEN], acceptor: [0; NONCE_LEN] };
            n.acceptor.copy_from_slice(&challenge[4..]);
            let mut answer = n.dialer.to_vec();
            answer.extend_from_slice(&Answer::new(&key(b"k"), Parties::SIDE_CHANNEL, n).proof);
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
            challenge.extend([9; NONCE_LEN]);
            s.write_all(&challenge).await.unwrap();
            let mut answer = [0u8; NONCE_LEN + TAG_LEN];
            s.read_exact(&mut answer).await.unwrap();
            s.write_all(&[0; TAG_LEN]).await.unwrap(); // it cannot compute the server's proof
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            rest
        });
        let err = dial(&addr, b"k", hello("D")).await.unwrap_err().to_string();
        assert!(err.contains("does not hold"), "{err}");
        assert!(squatter.await.unwrap().is_empty(), "the squatter got nothing after the proofs");
    }

    /// SPEC S2: a Hello or a release recorded on one connection does not verify on another (fresh
    /// nonces), nor as the other side's (direction), nor altered.
    #[test]
    fn s2_signed_requests_do_not_replay_or_reflect() {
        let k = key(b"k");
        let (a, b) =
            (Nonces { dialer: [2; NONCE_LEN], acceptor: [1; NONCE_LEN] }, Nonces { dialer: [2; NONCE_LEN], acceptor: [3; NONCE_LEN] });
        let release = SideRelease {
            engine_id: "d".into(),
            incarnation: 1,
            granted_by: 2,
            lease_ids: vec![3],
            what: "no_handshake".into(),
            why: String::new(),
            auth: vec![],
        };
        for mut m in [Message::Hello(hello("D")), Message::SideRelease(release)] {
            sign(&k, &a, Side::Dialer, &mut m);
            assert!(authentic(&k, &a, Side::Dialer, &m));
            assert!(!authentic(&k, &b, Side::Dialer, &m), "replayed on another connection");
            assert!(!authentic(&k, &a, Side::Acceptor, &m), "reflected");
            assert!(!authentic(&key(b"other"), &a, Side::Dialer, &m), "another secret");
            let mut altered = m.clone();
            match &mut altered {
                Message::Hello(h) => h.incarnation = 2,
                Message::SideRelease(r) => r.lease_ids = vec![4],
                _ => unreachable!(),
            }
            assert!(!authentic(&k, &a, Side::Dialer, &altered), "altered");
        }
    }

    /// SPEC O4: a release over the side channel is proven, signed, and answered with P's
    /// incarnation and the ids it did not release.
    #[tokio::test]
    async fn o4_a_release_over_the_side_channel_is_answered() {
        let (addr, task) = server(b"k").await;
        let stream = TcpStream::connect(&addr).await.unwrap();
        let rel = SideRelease {
            engine_id: "d".into(),
            incarnation: 1,
            granted_by: 9,
            lease_ids: vec![3, 4],
            what: "no_handshake".into(),
            why: "its handshake failed".into(),
            auth: vec![],
        };
        assert_eq!(release(stream, &addr, &key(b"k"), rel).await.unwrap(), (9, vec![4]));
        assert!(matches!(task.await.unwrap(), Ok(Request::Release(r)) if r.lease_ids == vec![3, 4] && r.granted_by == 9));
    }
}
